"""What kind of value a tensor input is, beyond its shape: refused where the step cannot
keep it, and its dtype recorded where the graph holds it.

The compiled step splits each batched input along its batch dim and runs the captured
graph on every slice; it can do that exactly for a dense, strided tensor that runs
torch's own ops. Other inputs are refused by name at compile time and at each call
(``check_kind``), before anything runs:

- a nested tensor (``torch.nested``, either layout): no fixed sizes to split or trace;
- a sparse tensor (COO, CSR, ...): torch.export cannot trace its storage, and fx's
  graph has no batch rule for ``torch.sparse`` ops;
- a subclass with a ``__torch_function__`` of its own (a units, quantised or masked
  tensor type): torch.export runs plain aten ops on it, and torch.fx calls the override
  on each microbatch's slice, where eager's saw the whole batch.

A dtype is what torch.export specialises on: a branch on ``x.dtype`` or a cast that was a
no-op for the example is held in its graph. ``Structure`` records each input's leaf
dtypes beside its pytree spec (``inputs.input_layout``); a call with another dtype is an
``InputDtypeError`` where the graph holds them (``Structure.fixed``), and a module that
may compile variants compiles one for it, once (``variants.for_dtypes``).

>>> check_kind("'x'", torch.randn(2, 3).to_sparse())
InputError: input 'x' is a sparse tensor (layout torch.sparse_coo) ... (.to_dense())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.errors import InputError

__all__ = ["InputDtypeError", "InputPresenceError", "Structure", "check_kind", "check_kinds",
           "dtype_error", "odd_kind"]


class InputPresenceError(InputError):
    """An input is None where the example passed a tensor, or a tensor where it passed
    None (a call without ``labels``, for logits): another graph, which a module that may
    compile variants compiles for it once (``variants.for_presence``)."""


class InputDtypeError(InputPresenceError):
    """A tensor input of another dtype than the example's, where the graph holds the
    example's (torch.export's: ``Structure.fixed``): another graph, compiled once for it
    by a module that may compile variants (``variants.for_dtypes``)."""


#: the ``__torch_function__`` of a subclass that runs torch's ops unchanged
_PLAIN_FUNCTIONS = (torch.Tensor.__torch_function__.__func__,  # type: ignore[attr-defined]
                    torch._C._disabled_torch_function_impl)  # nn.Parameter's
_OVERRIDES: dict[type, bool] = {}  # subclass -> whether it has an override of its own


@dataclass(frozen=True)
class Structure:
    """How one input is nested (its pytree ``spec``) and its leaves' dtypes (None for a
    leaf that is not a tensor); ``fixed``: the graph holds those dtypes (torch.export's),
    so a call with another runs another graph. Part of the capture's key
    (``captures.capture_key``): a variant made for a call of another dtype is captured
    again."""

    spec: Any
    dtypes: tuple[torch.dtype | None, ...]
    fixed: bool = False

    @staticmethod
    def dtypes_of(leaves: list[Any], d: int | None) -> tuple[torch.dtype | None, ...]:
        """The dtypes recorded for an input's ``leaves`` (its batch dim ``d``): None for a
        leaf that is not a tensor, and for a scalar (0-dim) tensor passed whole: a count
        or a factor the graph divides or multiplies by (transformers' Trainer passes
        ``num_items_in_batch`` as a float, where the example mbcompile makes for it is an
        integer count: a variant for it would compile again at every Trainer's first
        step, for nothing)."""
        return tuple(t.dtype if isinstance(t, torch.Tensor) and (d is not None or t.dim())
                     else None for t in leaves)


def odd_kind(t: torch.Tensor) -> bool:
    """Whether ``t`` is anything but a dense strided tensor of torch's own (three attribute
    reads: it runs on every leaf of every call)."""
    return type(t) is not torch.Tensor or t.layout is not torch.strided or t.is_nested


def check_kind(name: str, t: torch.Tensor) -> None:
    """Raise ``InputError`` where input leaf ``t`` (``name``: as ``inputs.leaf_name`` says
    it) is a nested or sparse tensor or a subclass that changes what ops compute."""
    if t.is_nested:
        raise InputError(
            f"input {name} is a nested tensor (torch.nested, layout {t.layout}); the compiled "
            "step splits dense strided tensors along their batch dim, and a nested tensor "
            "has no fixed sizes to split or trace. Fix: pad it to a dense tensor "
            "(.to_padded_tensor(0.0)) and pass the lengths or a padding mask as another "
            "input; nothing was run")
    if t.layout is not torch.strided:
        raise InputError(
            f"input {name} is a sparse tensor (layout {t.layout}); the compiled step splits "
            "and traces dense strided tensors only (torch.sparse ops have no batch rule). "
            "Fix: pass a dense tensor (.to_dense()) and compute densely in forward; nothing "
            "was run")
    kind = type(t)
    if kind is torch.Tensor or kind is nn.Parameter:
        return
    if kind not in _OVERRIDES:
        found = getattr(kind.__torch_function__, "__func__", kind.__torch_function__)
        _OVERRIDES[kind] = found not in _PLAIN_FUNCTIONS
    if _OVERRIDES[kind]:
        raise InputError(
            f"input {name} is a {kind.__module__}.{kind.__qualname__}, a tensor subclass "
            "with a __torch_function__ of its own; the compiled step would not run it as "
            "eager does: torch.export traces torch's plain ops (the override never runs), "
            "and torch.fx calls it on each microbatch's slice, where eager's sees the whole "
            "batch. Fix: pass a plain tensor (.as_subclass(torch.Tensor)) and write what "
            "the type does in forward; nothing was run")


def check_kinds(name: str, value: Any) -> None:
    """``check_kind`` for every tensor in input ``name`` of the example call; and an
    ``InputError`` for tensors inside a leaf torch's pytree cannot look into."""
    if isinstance(value, torch.Tensor):
        check_kind(repr(name), value)
        return
    for path, leaf in pytree.tree_flatten_with_path(value)[0]:
        if isinstance(leaf, torch.Tensor):
            check_kind(repr(name) if not path else f"{name}{pytree.keystr(path)}", leaf)
            continue
        if isinstance(leaf, nn.Module) or type(leaf) in (bool, int, float, str):
            continue
        inner = leaf.values() if isinstance(leaf, Mapping) else \
            vars(leaf).values() if hasattr(leaf, "__dict__") else ()
        if any(isinstance(v, torch.Tensor) for v in inner):
            opaque = type(leaf)
            raise InputError(
                f"input {name!r} holds tensors inside a {opaque.__module__}."
                f"{opaque.__qualname__}, which mbcompile cannot look into (torch's pytree "
                "does not know it): its tensors would be constants of the graph, not split "
                "into microbatches. Fix: pass a dict, tuple or list of them (dict(batch), "
                "dataclasses.asdict(batch)), or register the class with "
                "torch.utils._pytree (register_dataclass, register_pytree_node)")


def dtype_error(changed: list[tuple[str, torch.dtype, torch.dtype]]) -> str:
    """Why a call whose tensor leaves ``changed`` ((name, the example's dtype, the call's))
    does not fit a graph that holds the example's dtypes, and the fix."""
    said = ", ".join(f"input {name} is {now} where the example passed {was}"
                     for name, was, now in changed)
    was = changed[0][1]
    return (f"{said}; the graph was captured by torch.export, which holds the example's "
            "dtypes (a branch on x.dtype, a cast that was a no-op for the example), so "
            f"this call would run as the example's. Fix: pass {was} (.to({was})), or "
            "compile with an example call of these dtypes; nothing was run")
