"""What a guard compares for values that are not plain numbers: containers, objects, globals.

A forward reads more than numbers: a dict of flags (``if self.flags["hard"]``), a config
object (``self.cfg.beta``), an enum (``self.mode is Mode.TRAIN``), a module-level
constant (``SCALE * loss``), a helper method it calls (``self.head_fn(x)``). Each is
baked into the graph by the trace, so each is guarded: a container or plain object by
its ``fingerprint`` (plain values by value, anything else by identity, recursively), a
global by value, a method by the absence of an instance attribute that would shadow it.

>>> fingerprint({"hard": False, "sizes": (2, 3)})[0]
(('hard', False), ('sizes', (2, 3)))
"""

from __future__ import annotations

import enum
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

__all__ = ["ATOMS", "fingerprint", "forward_globals", "plain_object", "shadowable_methods"]

#: compared by value: numbers, strings, flags, None, enum members
ATOMS = (bool, int, float, str, type(None), enum.Enum)
_DEPTH, _ITEMS = 6, 2_000  # deeper or larger: compared by identity only


def fingerprint(value: Any) -> tuple[Any, frozenset[int]]:
    """A comparable image of ``value`` (plain values by value, other objects by ``id``)
    and the ``id`` of every container and object it went through."""
    reached: set[int] = set()
    budget = [_ITEMS]
    return _image(value, reached, _DEPTH, budget), frozenset(reached)


_ATOM_TYPES = frozenset({bool, int, float, str, type(None)})


def _image(value: Any, reached: set[int], depth: int, budget: list[int]) -> Any:
    if type(value) in _ATOM_TYPES:  # the common case first: this runs on every call
        return value
    budget[0] -= 1
    if isinstance(value, ATOMS):
        return value
    if depth == 0 or budget[0] <= 0 or id(value) in reached:
        return ("id", id(value))
    if isinstance(value, (dict, list, tuple, set, frozenset)) or plain_object(value):
        reached.add(id(value))
    if isinstance(value, dict):
        return tuple((_image(k, reached, depth - 1, budget), _image(v, reached, depth - 1, budget))
                     for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,
                tuple(_image(v, reached, depth - 1, budget) for v in value))
    if isinstance(value, (set, frozenset)):
        return frozenset(_image(v, reached, depth - 1, budget) for v in value)
    if plain_object(value):
        return (type(value), _image(vars(value), reached, depth, budget))
    return ("id", id(value))  # a tensor, a module, a function: by identity


def plain_object(value: Any) -> bool:
    return (hasattr(value, "__dict__") and not callable(value)
            and not isinstance(value, (nn.Module, torch.Tensor, types.ModuleType, type))
            and not type(value).__module__.startswith("torch"))


def _forwards(model: nn.Module) -> Iterator[types.FunctionType]:
    """The ``forward`` of every module class in ``model`` that is not torch's own, and the
    methods it calls on ``self`` by name (each function once)."""
    seen: set[int] = set()
    for module in model.modules():
        fn = type(module).forward
        if getattr(fn, "__code__", None) is None or fn.__module__.startswith("torch.nn"):
            continue
        helpers = [getattr(type(module), n, None) for n in fn.__code__.co_names]
        for f in (fn, *helpers):
            if isinstance(f, types.FunctionType) and id(f) not in seen:
                seen.add(id(f))
                yield f


def forward_globals(model: nn.Module) -> list[tuple[dict[str, Any], str, Any]]:
    """``(globals, name, value)`` of each module-level value a user's forward names that
    holds a plain value (a number, a flag, an enum member, a tuple of them)."""
    found = []
    for fn in _forwards(model):
        space = fn.__globals__
        for name in fn.__code__.co_names:
            value = space.get(name)
            if name in space and _comparable(value):
                found.append((space, name, value))
    return found


def _comparable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_comparable(v) for v in value)
    return isinstance(value, ATOMS)


def shadowable_methods(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """``(module, name)`` of each method a user's forward calls on ``self`` by name that
    is the class's own (no instance attribute yet): assigning one later would change
    what forward calls."""
    found = []
    for module in model.modules():
        fn = type(module).forward
        code = getattr(fn, "__code__", None)
        if code is None or fn.__module__.startswith("torch.nn"):
            continue
        for name in code.co_names:
            if name not in vars(module) and callable(getattr(type(module), name, None)) \
                    and not name.startswith("__"):
                found.append((module, name))
    return found
