"""The module-level values an installed package's model code reads, guarded like the user's.

``code_reach`` walks the user's code and stops at installed packages (site-packages), whose
objects are the package's own state (a logger, a registry of attention functions). But a
transformers model's ``forward`` is that package's code, and a module-level flag or number
it reads (``USE_FAST_PATH = True``; ``MAX_LEN = 512``) is baked into the graph like a
global of the user's: changed after compile, eager would follow it and the compiled step
would not. So for each module of the model whose ``forward`` is an installed package's
(not torch's), this walk takes the plain values (numbers, strings, flags, None, tuples of
them) that its code names as globals as slots, and follows the functions it names that
are an installed package's too, the same way. Each slot is then guarded by value
(``guards.slot_guards``): a change compiles again, with a ``RecompileWarning`` that
names it. Objects (a dict, a logger) are not looked into: they are the package's.

Example: ``modeling_x.py`` holds ``SCALE = 2.0`` and ``XModel.forward`` returns
``SCALE * h``; ``modeling_x.SCALE = 3.0`` after compile recompiles the step for 3.0.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

import torch.nn as nn

from .sources import installed_package

__all__ = ["walk_installed_models"]

class Reach(Protocol):
    """What the walk records into (``code_reach.Reach``)."""

    def slot(self, owner: Any, key: str, where: str) -> Any: ...

    def enter(self, code: types.CodeType, space: dict[str, Any]) -> bool: ...


#: a code object's global names and inner code objects (``code_reach``'s, worked out once)
Names = Callable[[types.CodeType], Any]


def walk_installed_models(model: nn.Module, reach: Reach, names: Names) -> None:
    """Slots for the plain module-level values each installed model class's ``forward`` (and
    the methods it names on its class, and the installed functions it calls) names."""
    for module in model.modules():
        kind = type(module)
        forward = getattr(kind.forward, "__func__", kind.forward)
        if not _installed_function(forward):
            continue
        _walk(forward, reach, names)
        for name in forward.__code__.co_names:
            member = getattr(kind, name, None)
            member = getattr(member, "__func__", member)
            if _installed_function(member):
                _walk(member, reach, names)


def _walk(fn: types.FunctionType, reach: Reach, names: Names) -> None:
    _walk_code(fn.__code__, fn.__globals__, reach, names)


def _walk_code(code: types.CodeType, space: dict[str, Any], reach: Reach, names: Names
               ) -> None:
    if not reach.enter(code, space):
        return
    info = names(code)
    module = space.get("__name__", "?")
    for name in info.globals:
        value = space.get(name, _ABSENT)  # absent: a builtin (``len``), not a global
        if value is not _ABSENT and _plain(value):
            reach.slot(space, name, f"the global {module}.{name}")
        elif _installed_function(value):
            _walk(value, reach, names)
    for inner in info.inner:
        _walk_code(inner, space, reach, names)


_ABSENT = object()


def _installed_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and installed_package(value.__code__.co_filename)


def _plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))
