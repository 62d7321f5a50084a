"""The shapes torch.export traces with: which dims are dynamic, and a refusal of code
that needs one size of a dim that varies.

>>> kwargs, dynamic = export_kwargs(model, {"input_ids": ids, "labels": labels},
...                                 {"input_ids": 0, "labels": 0}, {"input_ids": {1: None}})
>>> dynamic["input_ids"]
{1: DimHint(DYNAMIC), 0: Dim('batch')}

The batch dim of every batched tensor is one shared ``Dim("batch")``; a non-batch dim
that varies between calls (``compile(..., dynamic=...)``) is ``Dim.DYNAMIC``: export
works out which of them are equal (the ids' and the labels' length), and refuses code
that only works at one size (``length_baked_in`` words that refusal).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import CaptureError

__all__ = ["export_kwargs", "grow_batch", "has_tensor", "length_baked_in"]


def has_tensor(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))


def grow_batch(value: Any, dim: int, size: int) -> Any:
    """``value`` with its batch dim repeated up to ``size`` samples (export needs >= 2)."""

    def grow(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.shape[dim] >= size:
            return t
        reps = -(-size // max(t.shape[dim], 1))
        return torch.cat([t] * reps, dim).narrow(dim, 0, size)

    return pytree.tree_map(grow, value)


def export_kwargs(model: torch.nn.Module, example: Mapping[str, Any],
                   in_dims: Mapping[str, int | None],
                   symbolic: Mapping[str, Mapping[int, Any]] | None = None
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The keyword call to export and its ``dynamic_shapes``: the batch dim one shared
    ``Dim("batch")``, each ``symbolic`` dim (input -> dims, the lengths that vary between
    calls) ``Dim.DYNAMIC``, so export finds which of them are equal and refuses code that
    needs one size (``_export_error``)."""
    params = inspect.signature(model.forward).parameters
    batch = torch.export.Dim("batch")
    storages = [_storage(t) for t in pytree.tree_leaves(dict(example))
                if isinstance(t, torch.Tensor)]
    shared = {p for p in storages if storages.count(p) > 1}
    owner: dict[int, str] = {}  # a storage -> the first input that holds it
    for name, value in example.items():
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and _storage(t):
                owner.setdefault(_storage(t), name)
    kwargs: dict[str, Any] = {}
    dynamic: dict[str, Any] = {}
    for name, value in example.items():
        dim = in_dims.get(name)
        if has_tensor(value):
            if dim is not None:
                value = grow_batch(value, dim, 2)
            # a strided view (ids[:, :n]) would make export trace its strides as sizes and
            # guard on them (length != stride): the graph's ops read values, not layout;
            # views of one tensor in one input stay (a write through one is read through
            # the other). Another input's tensor (labels=input_ids) is copied apart: export
            # fails on a write into either, which compile() refuses by name (check_held)
            value = pytree.tree_map(lambda t, n=name: _apart(t, n, shared, owner), value)
            kwargs[name] = value
            free = (symbolic or {}).get(name, {})
            dynamic[name] = pytree.tree_map(
                lambda t, d=dim, free=free: _dims_of(t, d, batch, free), value)
            continue
        default = params[name].default if name in params else inspect.Parameter.empty
        if name == "use_cache" and value is None:
            value = False  # a key/value cache is inference state, not part of a training step
        elif value is default or (value is None and default is inspect.Parameter.empty):
            continue
        kwargs[name] = value
        dynamic[name] = None
    return kwargs, dynamic


def _storage(t: torch.Tensor) -> int:
    """Where ``t``'s values live (its storage's address; 0 on the meta device, where
    nothing does, so that no meta tensor is copied)."""
    return t.untyped_storage().data_ptr()


def _apart(t: Any, name: str, shared: set[int], owner: Mapping[int, str]) -> Any:
    """``t`` as export is given it in input ``name`` (``export_kwargs``)."""
    if not isinstance(t, torch.Tensor) or _storage(t) not in shared:
        return _contiguous(t)
    return t if owner.get(_storage(t)) == name else t.clone()


def _contiguous(t: Any) -> Any:
    return t.contiguous() if isinstance(t, torch.Tensor) and not t.is_contiguous() else t


def _dims_of(t: Any, dim: int | None, batch: Any, free: Mapping[int, Any]) -> Any:
    """One tensor's ``dynamic_shapes`` entry (None: every size static)."""
    if not isinstance(t, torch.Tensor):
        return None
    dims = {d: torch.export.Dim.DYNAMIC for d in free if d < t.dim() and d != dim}
    if dim is not None:
        dims[dim] = batch
    return dims or None


_SPECIALISED_DIM = re.compile(r"\['(\w+)'\]\S*?\.size\(\)\[(\d+)\] as dynamic but your code "
                             r"specialized it to be a constant \((\d+)\)")


def length_baked_in(model: torch.nn.Module, text: str, in_dims: Mapping[str, int | None]
                    ) -> CaptureError | None:
    """The refusal of an export that specialised non-batch dims marked dynamic (``text``:
    export's error), or None when the error is about something else."""
    found = [(name, int(dim), size) for name, dim, size in _SPECIALISED_DIM.findall(text)
             if in_dims.get(name) != int(dim)]
    if not found:
        return None
    dims = ", ".join(f"input {name!r} dim {dim} (size {size})" for name, dim, size in found)
    return CaptureError(
        f"torch.export could not capture {type(model).__name__}.forward with {dims} symbolic "
        "(varying between calls): the code only works for that size there (a size read off "
        "the input used as a Python number, a loop over it, a layer that needs that many "
        "features, a reshape with that size), so one compiled step cannot run the other "
        "sizes.\n"
        "  Fix: name only the dims that vary, dynamic={input: {dim: (min, max)}} (dynamic=True "
        "makes every non-batch dim symbolic, features too); or pad every batch to one length "
        "(the tokenizer's padding='max_length'), or to a multiple the model works with "
        "(pad_to_multiple_of= in the collator), and compile with dynamic=False.")
