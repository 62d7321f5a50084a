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
import sys
import types
from typing import Any

import torch
import torch.nn as nn

from .whose_code import user_code

__all__ = ["ATOMS", "entries_of", "fingerprint", "plain_object", "shadowable_methods",
           "user_defined"]

#: compared by value: numbers, strings, flags, None, enum members
ATOMS = (bool, int, float, str, type(None), enum.Enum)
_DEPTH, _ITEMS = 6, 2_000  # deeper or larger: compared by identity only


def fingerprint(value: Any) -> tuple[Any, frozenset[int]]:
    """A comparable image of ``value`` (plain values by value, other objects by ``id``)
    and the ``id`` of every container and object it went through."""
    reached: set[int] = set()
    budget = [_ITEMS]
    return _image(value, reached, _DEPTH, budget), frozenset(reached)


def _image(value: Any, reached: set[int], depth: int, budget: list[int]) -> Any:
    kind = _KINDS.get(type(value)) or _kind(type(value))  # by type: no __class__ lookups
    if kind == "atom":  # the common case first: this runs on every call
        return value
    budget[0] -= 1
    if kind == "id" or depth == 0 or budget[0] <= 0 or id(value) in reached:
        return ("id", id(value))  # a tensor, a module, a function: by identity
    reached.add(id(value))
    if kind == "dict":
        return tuple((_image(k, reached, depth - 1, budget), _image(v, reached, depth - 1, budget))
                     for k, v in value.items())
    if kind == "seq":
        return (type(value).__name__,
                tuple(_image(v, reached, depth - 1, budget) for v in value))
    if kind == "set":
        return frozenset(_image(v, reached, depth - 1, budget) for v in value)
    return (type(value), _image(object.__getattribute__(value, "__dict__"), reached, depth,
                                budget))


_KINDS: dict[type, str] = {}


def entries_of(value: Any) -> Any:
    """A container's entries, one level deep, compared with ``==`` on every call: functions,
    classes and objects by identity, plain values by value (an installed package's registry:
    ``ACT2FN``, an attention interface's mapping). Cheap: no walk, C-level copies.

    >>> entries_of({"tanh": abs}) == entries_of({"tanh": abs})
    True
    >>> entries_of([1, 2]) == entries_of([1, 3])
    False
    """
    if isinstance(value, dict):
        return tuple(value.items())
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    return tuple(value)


def _kind(t: type) -> str:
    """How ``_image`` reads a value of type ``t`` (worked out once per type)."""
    if issubclass(t, ATOMS):
        kind = "atom"
    elif issubclass(t, dict):
        kind = "dict"
    elif issubclass(t, (list, tuple)):
        kind = "seq"
    elif issubclass(t, (set, frozenset)):
        kind = "set"
    elif _plain_type(t):
        kind = "object"
    else:
        kind = "id"
    _KINDS[t] = kind
    return kind


def _plain_type(t: type) -> bool:
    return (t.__dictoffset__ != 0 and not issubclass(t, _OPAQUE)
            and not any("__call__" in vars(c) for c in t.__mro__ if c is not object)
            and not t.__module__.startswith("torch"))


_OPAQUE = (nn.Module, torch.Tensor, types.ModuleType, type, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType)


def plain_object(value: Any) -> bool:
    """A user's object whose attributes are state (a dataclass, a namespace, a config)."""
    return (_KINDS.get(type(value)) or _kind(type(value))) == "object"


def user_defined(value: Any) -> bool:
    """A function, class or module of the user's (not torch's or Python's own): a global
    that forward calls or reads through, guarded by identity."""
    if isinstance(value, types.FunctionType):
        return user_code(value.__code__.co_filename)
    if isinstance(value, types.ModuleType):
        return user_code(getattr(value, "__file__", None))
    if isinstance(value, type):
        module = sys.modules.get(value.__module__)
        return user_code(getattr(module, "__file__", None))
    return False


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
