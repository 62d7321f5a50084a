"""The module-level values an installed package's model code reads, guarded like the user's.

``code_reach`` walks the user's code and stops at installed packages (site-packages). But a
transformers model's ``forward`` is that package's code, and what it reads at module level
is baked into the graph like a global of the user's: a flag or a number
(``USE_FAST_PATH = True``), an entry of a registry (``ACT2FN["gelu"]``, the attention
function ``ALL_ATTENTION_FUNCTIONS`` holds for ``"sdpa"``). Changed after compile, eager
would follow it and the compiled step would not. So for each module of the model whose
``forward`` is an installed package's (not torch's), this walk follows its code (through
``functools.wraps`` wrappers: transformers decorates most forwards), the methods it names
on its class and the installed functions it names, and takes as slots:

- the plain values (numbers, strings, flags, None, tuples of them): guarded by value;
- the package's functions it calls (``eager_attention_forward``): by identity;
- the containers (a dict, a list, a tuple, a set; ``ACT2FN``), and the containers an
  object of the package's holds in its attributes or its class's (``ALL_ATTENTION_FUNCTIONS``:
  its ``_local_mapping``, its class's ``_global_mapping``), ``library`` slots: guarded by
  their entries (functions and classes by identity, plain values by value, and what an
  entry holds, containers and plain objects, to six levels: ``guard_values.entries_of``;
  what cannot be compared so is refused at compile), and never taken as forward's own
  state to replay.

Each guard is checked on every call (``slot_guards.slot_guards``): a change compiles again, with
a ``RecompileWarning`` that names it. A logger (a class of Python's own) is not looked into.

Example: ``modeling_x.py`` holds ``SCALE = 2.0`` and ``XModel.forward`` returns
``SCALE * h``; ``modeling_x.SCALE = 3.0`` after compile recompiles the step for 3.0, and so
does ``modeling_x.ACTIVATIONS["tanh"] = torch.sigmoid`` where forward reads that entry, and
``modeling_x.ACTIVATIONS["clip"][1]["max"] = 5`` (a dict inside an entry, changed in place).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, Protocol

import torch.nn as nn

from .sources import installed_package

__all__ = ["walk_installed_models"]

class Reach(Protocol):
    """What the walk records into (``code_reach.Reach``)."""

    def slot(self, owner: Any, key: str, where: str, library: bool = False) -> Any: ...

    def enter(self, code: types.CodeType, space: dict[str, Any]) -> bool: ...


#: a code object's global names and inner code objects (``code_reach``'s, worked out once)
Names = Callable[[types.CodeType], Any]
_CONTAINERS = (dict, list, tuple, set, frozenset)


def walk_installed_models(model: nn.Module, reach: Reach, names: Names) -> None:
    """Slots for the module-level values each installed model class's ``forward`` (and
    the methods it names on its class, and the installed functions it calls) names."""
    for module in model.modules():
        kind = type(module)
        forward = getattr(kind.forward, "__func__", kind.forward)
        if not _installed_function(forward):
            continue
        for fn in _unwrapped(forward):
            _walk(fn, reach, names)
            for name in fn.__code__.co_names:
                member = getattr(kind, name, None)
                member = getattr(member, "__func__", member)
                if _installed_function(member):
                    _walk(member, reach, names)


def _unwrapped(fn: types.FunctionType) -> list[types.FunctionType]:
    """``fn`` and the functions it wraps (``functools.wraps``' ``__wrapped__``)."""
    found = [fn]
    while _installed_function(inner := getattr(found[-1], "__wrapped__", None)) and \
            inner not in found:
        found.append(inner)
    return found


def _walk(fn: types.FunctionType, reach: Reach, names: Names) -> None:
    for each in _unwrapped(fn):
        _walk_code(each.__code__, each.__globals__, reach, names)


def _walk_code(code: types.CodeType, space: dict[str, Any], reach: Reach, names: Names
               ) -> None:
    if not reach.enter(code, space):
        return
    info = names(code)
    module = space.get("__name__", "?")
    for name in info.globals:
        value = space.get(name, _ABSENT)  # absent: a builtin (``len``), not a global
        where = f"the global {module}.{name}"
        if value is _ABSENT:
            continue
        if _plain(value):
            reach.slot(space, name, where)
        elif isinstance(value, _CONTAINERS):
            reach.slot(space, name, where, library=True)
        elif _installed_function(value):  # by identity: patched after compile, it compiles
            reach.slot(space, name, where, library=True)  # again (``eager_attention_forward``)
            _walk(value, reach, names)
        elif _package_object(value):
            reach.slot(space, name, where, library=True)  # the object itself, by identity
            _held_containers(value, where, reach)
    for inner in info.inner:
        _walk_code(inner, space, reach, names)


def _held_containers(value: Any, where: str, reach: Reach) -> None:
    """Library slots for the containers an object of a package's holds: in its own
    attributes, and in the class attributes of its package's classes (a registry the class
    shares: ``AttentionInterface._global_mapping``)."""
    for key, held in list(vars(value).items()):
        if isinstance(held, _CONTAINERS):
            reach.slot(vars(value), key, f"{where}.{key}", library=True)
    for kind in type(value).__mro__:
        if not installed_package(_class_file(kind)):
            continue
        for key, held in list(vars(kind).items()):
            if not key.startswith("__") and isinstance(held, _CONTAINERS):
                # a class's ``vars`` is a new live view at each call: one per class, so that
                # the slot is recorded once (per owner)
                owner = _CLASSES.setdefault(kind, vars(kind))
                reach.slot(owner, key, f"{kind.__module__}.{kind.__qualname__}.{key}",
                           library=True)


_CLASSES: dict[type, Any] = {}
_ABSENT = object()


def _class_file(kind: type) -> str | None:
    return getattr(sys.modules.get(kind.__module__), "__file__", None)


def _package_object(value: Any) -> bool:
    """An object of a class an installed package defines (not a class, function or module)."""
    return hasattr(value, "__dict__") and not isinstance(
        value, (type, types.FunctionType, types.ModuleType, nn.Module)) and \
        installed_package(_class_file(type(value)))


def _installed_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and installed_package(value.__code__.co_filename)


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))
