"""Every name an op goes by, and the table key each spelling maps to.

One op has several spellings: ``torch.softmax``, the method ``x.softmax`` (a
``call_method`` node whose target is the string ``"softmax"``), ``F.softmax`` and
``torch.ops.aten._softmax`` (any overload maps to its packet). ``spellings("softmax")``
lists those that exist in this torch, so a table line names a whole op at once. An op a
library registers after this table is filled (``transformers::grouped_mm_fallback``) is
keyed by its qualified name, which ``qualified_name`` gives for a node's target.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .. import ops

__all__ = [
    "aten",
    "is_aten",
    "modules_named",
    "named",
    "node_name",
    "qualified_name",
    "rule_key",
    "spellings",
]


def rule_key(op: Any) -> Any:
    """The table key of an op: ATen overloads map to their packet."""
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    if isinstance(op, ops.TensorHook):
        return ops.TensorHook  # one rule for every hook forward registers
    return op


def qualified_name(target: Any) -> str | None:
    """``"ns::op"`` for a library op, ``"module.function"`` for a Python function (torch's
    builtins as ``"torch.X"``); None for anything else (a method name, a module class)."""
    schema = getattr(target, "_schema", None)
    if schema is not None:  # an OpOverload
        return schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if callable(target) and not isinstance(target, type):
        name = f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', '')}"
        return name.replace("torch._C._VariableFunctions", "torch")
    return None


def aten(*names: str) -> list[Any]:
    """ATen overload packets (``torch.ops.aten.<name>``) that exist in this torch."""
    out = []
    for name in names:
        try:
            out.append(getattr(torch.ops.aten, name))
        except (AttributeError, RuntimeError):
            continue
    return out


def spellings(*names: str, functional: bool = True, method: bool = True,
              torch_ns: bool = True, aten_ns: bool = True) -> list[Any]:
    """``torch.X``, ``Tensor.X`` (as the method name), ``F.X`` and ``aten.X`` for each name."""
    out: list[Any] = []
    for name in names:
        if torch_ns and hasattr(torch, name):
            out.append(getattr(torch, name))
        if method and hasattr(torch.Tensor, name):
            out.append(name)
        if functional and hasattr(F, name):
            out.append(getattr(F, name))
        if aten_ns:
            out.extend(aten(name))
    return out


#: Python-level ops fx records by their own function (``x[i]``, ``x.shape``, ``len(x)``).
_PYTHON_OPS = {f.__name__: f for f in (operator.getitem, operator.floordiv, operator.mod,
                                      builtins.getattr, builtins.len)}


def named(names: Iterable[str]) -> list[Any]:
    """Every spelling of each name, as ``node_name`` reads it: ``spellings(name)`` (less
    torch's dtypes, ``torch.float``) and the Python operator of that name (``getitem``)."""
    out: list[Any] = []
    for name in sorted(names):
        out += [op for op in spellings(name) if isinstance(op, str) or callable(op)]
        if name in _PYTHON_OPS:
            out.append(_PYTHON_OPS[name])
    return out


def modules_named(*names: str) -> list[type[nn.Module]]:
    """The ``torch.nn`` layer classes of these names that exist in this torch."""
    return [getattr(nn, n) for n in names if hasattr(nn, n)]


def is_aten(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def node_name(node: fx.Node) -> str:
    """The op's short name: ``view``, ``linear`` (for ``aten.linear.default`` too)."""
    t = node.target
    if isinstance(t, str):
        return t
    if is_aten(t):
        return str(t).split(".")[1]  # "aten.linear.default" -> "linear"
    return getattr(t, "__name__", str(t))
