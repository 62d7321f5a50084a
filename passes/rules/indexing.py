"""Rules of indexing with tensors: ``x[idx]``, ``index_select``, ``gather``/``scatter``,
``index_put``.

An index tensor along a non-batch dim picks within each sample. Along the batch dim it
picks other samples, except ``torch.arange(B)`` (each sample's own position), which makes
``x[torch.arange(B), labels]`` the identity on the batch dim; positions never index a
batch-free table, since they restart at 0 in every microbatch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from ..facts import Batched, Container, Fact, ValueInfo
from .context import RuleContext, handles_positions, int_fact, join_facts
from .families import per_sample
from .spellings import node_name

__all__ = [
    "aten_index_rule",
    "gather_rule",
    "getitem_rule",
    "index_put_rule",
    "index_select_rule",
]


def _index_entries(ctx: RuleContext, index: Any, ndim: int) -> list[tuple[int, Any]]:
    """``(input dim, entry)`` for each entry of a Python index that consumes input dims."""
    entries = list(index) if isinstance(index, (tuple, list)) else [index]

    def width(e: Any) -> int:
        if e is None or e is Ellipsis:
            return 0
        info = ctx.info(e)
        if isinstance(info, ValueInfo) and info.is_tensor and info.dtype == torch.bool:
            return max(info.ndim, 1)
        return 1

    used = sum(width(e) for e in entries)
    out: list[tuple[int, Any]] = []
    dim = 0
    for e in entries:
        if e is Ellipsis:
            dim += ndim - used
            continue
        w = width(e)
        for k in range(w):
            out.append((dim + k, e))
        dim += w
    return out


def _check_tensor_index(ctx: RuleContext, source: Any, by_dim: dict[int, Any]) -> None:
    """Indexing ``source`` with tensors: the batch dim may only be indexed by positions."""
    fact = ctx.fact(source)
    for dim, idx in by_dim.items():
        ifact = ctx.fact(idx)
        if not (isinstance(idx, fx.Node) and ctx.is_tensor(idx)):
            continue
        if isinstance(fact, Batched) and dim == fact.dim:
            if isinstance(ifact, Batched) and ifact.positions and ifact.factor == fact.factor \
                    and fact.major:
                continue  # x[arange(B)]: each sample picks itself
            ctx.mix("it selects rows of the batch dim with an index tensor (x[idx] along "
                    "the batch): sample i of the output can come from any sample",
                    "index only the non-batch dims; to pick one row per sample use "
                    "x[torch.arange(x.size(0)), idx] or torch.gather along a feature dim")
        if isinstance(ifact, Batched) and ifact.positions:
            ctx.mix("it indexes a batch-free tensor with sample positions (table[arange(B)]): "
                    "positions restart at 0 in every microbatch",
                    "index batch-free tables with per-sample data (ids), not with positions")


@handles_positions
def getitem_rule(ctx: RuleContext) -> Fact:
    """``x[i]`` on tuples picks a fact; on tensors the batch dim must stay whole."""
    container, index = ctx.arg(0), ctx.arg(1)
    fact = ctx.fact(container)
    if isinstance(fact, Container):
        if isinstance(index, slice):  # x.shape[-1:]: the items it keeps, renumbered
            kept = [f for _, f in fact.items][index]
            return Container(tuple(enumerate(kept)))
        return fact.get(index)
    info_in = ctx.info(container)
    if isinstance(info_in, tuple):  # a tuple-valued op without per-piece facts
        return join_facts([fact], ctx) if not isinstance(fact, Batched) else ctx.batched_out()
    if isinstance(info_in, ValueInfo) and not info_in.is_tensor:
        return int_fact(ctx)  # x.shape[0], size()[1]
    entries = _index_entries(ctx, index, ctx.ndim(container))
    tensors = {d: e for d, e in entries if isinstance(e, fx.Node) and ctx.is_tensor(e)}
    _check_tensor_index(ctx, container, tensors)
    out = per_sample(ctx)
    if (isinstance(fact, Batched) and fact.positions and not tensors
            and isinstance(out, Batched) and out.factor == fact.factor):
        return dataclasses.replace(out, positions=True)  # pos[:, None]
    return out


@handles_positions
def aten_index_rule(ctx: RuleContext) -> Fact:
    """aten.index(x, [i0, i1, ...]): advanced indexing, entry k indexes dim k (None: all)."""
    source, indices = ctx.arg(0, "input"), ctx.arg(1, "indices") or []
    by_dim: dict[int, Any] = {}
    dim = 0
    for idx in indices:
        info = ctx.info(idx)
        width = info.ndim if isinstance(info, ValueInfo) and info.dtype == torch.bool else 1
        for k in range(width):
            by_dim[dim + k] = idx
        dim += width
    _check_tensor_index(ctx, source, {d: i for d, i in by_dim.items() if i is not None})
    return per_sample(ctx)


def _dim_of(ctx: RuleContext, value: Any, d: Any) -> int | None:
    ndim = ctx.ndim(value)
    return d % ndim if isinstance(d, int) and ndim else None


@handles_positions
def index_select_rule(ctx: RuleContext) -> Fact:
    """index_select(x, dim, idx): along the batch dim only with arange(B) (identity)."""
    source, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d = _dim_of(ctx, source, dim)
    _check_tensor_index(ctx, source, {d: idx} if d is not None else {})
    return per_sample(ctx)


@handles_positions
def gather_rule(ctx: RuleContext) -> Fact:
    """gather/scatter/take_along_dim along a non-batch dim, index batched like the input.

    ``out[i][j] = x[i][idx[i][j]]`` (dim 1) stays in sample i when x and idx share
    the batch dim; along the batch dim it reads other samples.
    """
    name = node_name(ctx.node)
    if name == "take_along_dim":
        source, idx, dim = ctx.arg(0, "input"), ctx.arg(1, "indices"), ctx.arg(2, "dim")
    else:
        source, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d = _dim_of(ctx, source, dim)
    fact, ifact = ctx.fact(source), ctx.fact(idx)
    if name == "take_along_dim" and dim is None and isinstance(fact, Batched):
        ctx.mix("without a dim it indexes the flattened input, whose elements are every "
                "sample's", "name the dim it takes along: take_along_dim(x, idx, dim=-1)")
    if isinstance(fact, Batched) and d == fact.dim and not (
            isinstance(ifact, Batched) and ifact.positions):
        ctx.mix(f"it {'writes' if 'scatter' in name or 'index_' in name else 'reads'} along "
                "the batch dim with an index tensor, so a sample's output comes from (or goes "
                "to) other samples",
                "gather and scatter along a non-batch dim")
    if isinstance(ifact, Batched) and ifact.positions:
        ctx.mix("it uses sample positions (torch.arange(B)) as gather/scatter indices; "
                "positions restart at 0 in every microbatch", "gather with per-sample data")
    if isinstance(ifact, Batched) and isinstance(fact, Batched) and ifact.dim != fact.dim:
        ctx.mix(f"its index has the batch at dim {ifact.dim} but the input at dim {fact.dim}, "
                "so the index of one sample reads another sample's row",
                "give the index the input's batch dim")
    if isinstance(ifact, Batched) and not isinstance(fact, Batched) and ifact.dim != d \
            and ctx.is_tensor(source) and ctx.ndim(source) > 1:
        ctx.mix("it reads row i of a batch-free tensor for sample i (its index has the batch "
                "along a dim it does not gather), a position-dependent value",
                "expand the batch-free tensor to the batch first, or gather along the "
                "index's batch dim")
    return per_sample(ctx)


@handles_positions
def index_put_rule(ctx: RuleContext) -> Fact:
    """index_put(x, indices, values) (``x[idx] = v``): the batch dim by a mask or positions."""
    source, indices = ctx.arg(0, "input"), ctx.arg(1, "indices") or []
    fact = ctx.fact(source)
    dim = 0
    for idx in indices:
        info = ctx.info(idx)
        width = info.ndim if isinstance(info, ValueInfo) and info.dtype == torch.bool else 1
        ifact = ctx.fact(idx)
        if isinstance(fact, Batched) and dim <= fact.dim < dim + width and idx is not None:
            aligned = isinstance(ifact, Batched) and (
                ifact.positions or (width > 1 and ifact.dim == fact.dim - dim))
            if not aligned:
                ctx.mix("it writes into rows of the batch dim chosen by an index tensor, so "
                        "one sample's values can land in another sample",
                        "assign with a per-sample mask: torch.where(mask, v, x)")
        dim += width
    return per_sample(ctx)
