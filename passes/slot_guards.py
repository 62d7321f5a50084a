"""The guards of the globals and closure variables forward's code reached (``code_reach``):
each taken as the user holds it, checked on every call like an attribute's guard
(``guards.Guard``)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from .errors import CaptureError
from .guard_values import Unguardable, entries_of, user_defined
from .guards import _MISSING, _PENDING, Guard, plain
from .whose_code import holds_state

__all__ = ["slot_guards"]


def slot_guards(slots: Sequence[Any], model_name: str, model: nn.Module) -> list[Guard]:
    """The guards of the globals and closure variables forward's code reached
    (``code_reach.Slot``: ``owner[key]``), taken as the user holds them: a plain value by
    value, a container or plain object by its fingerprint (``unwritten`` takes it), a tensor,
    a generator, a function, class or module of the user's, ``model`` or one of its
    modules (a hook recording into ``model.acts`` through a closure) by identity. A file
    object, a numpy array or a module outside the model are refused: what forward reads of
    them would be baked in unguarded. Anything else (torch's functions, a logger) is not
    guarded."""
    own = {id(m) for m in model.modules()}
    guards = []
    for slot in slots:
        value = slot.owner.get(slot.key, _MISSING)
        if value is _MISSING:
            continue
        guard = Guard(slot.owner, slot.key, value, item=True, where=slot.where,
                      reads=slot.reads)
        if plain(value):
            guards.append(guard)
        elif slot.library:  # an installed package's container (its entries) or object
            guards.append(replace(guard, entries=_entries(value, slot.where, model_name))
                          if isinstance(value, (dict, list, tuple, set, frozenset))
                          else replace(guard, identity=True))
        elif holds_state(value) and not callable(value):
            guards.append(replace(guard, contents=_PENDING))
        elif isinstance(value, (torch.Tensor, torch.Generator)) or user_defined(value) or \
                holds_state(value) or id(value) in own:  # (a callable's attributes: slots)
            guards.append(replace(guard, identity=True))
        elif isinstance(value, (io.IOBase, nn.Module)) or \
                type(value).__module__.startswith("numpy"):  # an array, a numpy generator
            raise CaptureError(
                f"{model_name}.forward reads {slot.where}, a {type(value).__name__} that is not "
                "part of the model; what forward reads of it would be fixed at compile time. "
                "Fix: make it a submodule or buffer of the model (a module, an array), or "
                "keep the file outside forward")
    return guards


def _entries(value: Any, where: str, model_name: str) -> Any:
    """``entries_of(value)``, or the ``CaptureError`` that says why it cannot be guarded."""
    try:
        return entries_of(value)
    except Unguardable as exc:
        raise CaptureError(
            f"{model_name}.forward reads {where}, an installed package's container that "
            f"holds {exc}; a change in place there could not be seen, so what forward "
            "reads of it would be fixed at compile time. Fix: keep what forward reads of it "
            "flatter (plain values, functions, classes), or read it outside forward and "
            "pass the value in; nothing was changed") from None

