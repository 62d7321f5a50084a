"""Helpers that run the same code: parameter-free modules of distinct classes from one source.

A model may give every layer a helper module of a class made afresh for that layer (a
class statement run once per layer, as transformers 5.25 does for each attention layer's
``_kernel_funcs = {"rotary_pos_emb": Func()}``). The classes are distinct objects, so
class identity calls the layers unlike, though each helper computes what the others do.
Two such helpers are alike here when they hold no parameters or buffers, have no hooks,
and their classes run the same code: the same name, module and bases, and every method
the same code object, defaults and closure contents; their own attributes equal.

>>> def make():
...     class Func(nn.Module):
...         def forward(self, x):
...             return x * 2
...     return Func()
>>> a, b = make(), make()
>>> type(a) is type(b), helpers_alike(a, b)
(False, True)
"""

from __future__ import annotations

import types
from typing import Any

import torch.nn as nn

__all__ = ["HOOKS", "MODULE_STATE", "helpers_alike", "same_code"]

#: instance attributes every module has: compared apart (hooks must be empty, the rest
#: is bookkeeping), or by recursion (the submodules)
MODULE_STATE = frozenset(vars(nn.Module()))
#: a module's hook dictionaries
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
         "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
         "_forward_hooks_always_called")
#: class attributes that name or document a class rather than say what it does
_CLASS_NAMES = frozenset({"__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                          "__annotations__", "__firstlineno__", "__static_attributes__"})


def same_code(a: type, b: type) -> bool:
    """Whether classes ``a`` and ``b`` run the same code: one class, or two made by one class
    statement (name, module, bases, and each attribute the same code or value)."""
    if a is b:
        return True
    if (a.__qualname__, a.__module__, a.__bases__) != (b.__qualname__, b.__module__, b.__bases__):
        return False
    mine = {k: v for k, v in vars(a).items() if k not in _CLASS_NAMES}
    theirs = {k: v for k, v in vars(b).items() if k not in _CLASS_NAMES}
    return mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k], (a, b)) for k in mine)


def helpers_alike(x: Any, y: Any) -> bool:
    """Whether ``x`` and ``y`` hold the same, where parameter-free helper modules count by
    what they run (``same_code``, their attributes, their submodules), not by identity;
    dicts, lists, tuples and sets are compared item by item, anything else with ``==``."""
    if x is y:
        return True
    if isinstance(x, nn.Module) and isinstance(y, nn.Module):
        return _modules_alike(x, y)
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(helpers_alike(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(map(helpers_alike, x, y))
    try:
        return bool(x == y)
    except Exception:  # an object that does not compare: not known alike
        return False


def _modules_alike(x: nn.Module, y: nn.Module) -> bool:
    if not (_helper(x) and _helper(y) and same_code(type(x), type(y))):
        return False
    own = [{k: v for k, v in vars(m).items() if k not in MODULE_STATE} for m in (x, y)]
    if own[0].keys() != own[1].keys() or not all(helpers_alike(own[0][k], own[1][k])
                                                 for k in own[0]):
        return False
    if x.training != y.training or x._modules.keys() != y._modules.keys():
        return False
    return all(helpers_alike(x._modules[k], y._modules[k]) for k in x._modules)


def _helper(m: nn.Module) -> bool:
    """A module with no parameters, buffers or hooks of its own or below it."""
    if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return False
    return not any(getattr(sub, hooks) for sub in m.modules() for hooks in HOOKS)


def _same(x: Any, y: Any, owners: tuple[type, type]) -> bool:
    """A class attribute of ``owners[0]`` and the same of ``owners[1]``: one object, equal
    plain values, or functions (also static and class methods, properties) that run the
    same code."""
    if x is y or (x, y) == owners:  # the classes themselves (``super()``'s ``__class__``)
        return True
    if type(x) is not type(y):
        return False
    if isinstance(x, (staticmethod, classmethod)):
        return _same(x.__func__, y.__func__, owners)
    if isinstance(x, property):
        return all(_same(getattr(x, k), getattr(y, k), owners) for k in ("fget", "fset", "fdel"))
    if isinstance(x, types.FunctionType):
        return _same_function(x, y, owners)
    if isinstance(x, type):
        return same_code(x, y)
    if isinstance(x, tuple):  # defaults
        return len(x) == len(y) and all(_same(a, b, owners) for a, b in zip(x, y))
    return helpers_alike(x, y)


def _same_function(f: types.FunctionType, g: types.FunctionType, owners: tuple[type, type]
                   ) -> bool:
    """One code object (compared by value: its bytecode, constants and names), the same
    globals, defaults and closure contents."""
    if f.__code__ != g.__code__ or f.__globals__ is not g.__globals__:
        return False
    if not (_same(f.__defaults__, g.__defaults__, owners)
            and _same(f.__kwdefaults__, g.__kwdefaults__, owners)):
        return False
    try:
        cells = [tuple(c.cell_contents for c in fn.__closure__ or ()) for fn in (f, g)]
    except ValueError:  # a cell not filled yet: nothing to compare it by
        return False
    return len(cells[0]) == len(cells[1]) and all(_same(a, b, owners) for a, b in zip(*cells))
