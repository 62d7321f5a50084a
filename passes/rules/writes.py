"""Rules of functional writes: what functionalization makes of ``x[...] = y``.

torch.export's functionalization turns ``x[:, 1:] = y`` into ``slice_scatter(x, y, 1, 1)``,
``x[:, 0] = v`` into ``select_scatter``, ``x.diagonal().copy_(y)`` into
``diagonal_scatter`` and ``x.copy_(y)`` into ``copy``. A write is per-sample when every
sample's part of ``y`` lands in that sample's rows of ``x``: ``y``'s batch dim maps onto
``x``'s, and the region written does not pick rows of the batch dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..facts import Batched, Fact, ValueInfo
from .context import Rule, RuleContext, has_batched, join_facts
from .families import linear, per_sample

__all__ = [
    "copy_rule",
    "diagonal_scatter_rule",
    "masked_scatter_rule",
    "select_scatter_rule",
    "slice_scatter_rule",
]


def copy_rule(ctx: RuleContext) -> Fact:
    """copy(self, src): src's values broadcast into self's shape and dtype, the functional
    form of ``x.copy_(y)`` and ``x[...] = y``. Only the values of src reach the result, so
    it is per-sample as src is (in self's layout when src is batch-free); a reduction
    copied into a batch-free tensor stays a reduction (the copy is linear)."""
    src = ctx.arg(1, "src")
    sfact = ctx.fact(src)
    if isinstance(sfact, Batched):
        # broadcasting cannot resize src's batch dim: it lands on the output's one batch dim
        return ctx.batched_out(major=sfact.major)
    return linear(ctx)


def _number_at(ctx: RuleContext, value: Any, batch: int) -> int | None:
    """An int argument (a constant or export's SymInt node) at batch gbs (0) or gbs + 1 (1)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    info = ctx.info(value)
    if isinstance(info, ValueInfo) and not info.is_tensor:
        return info.int_a if batch == 0 else info.int_b
    return None


def _whole_slice(ctx: RuleContext, value: Any, dim: int, start: Any, end: Any,
                 step: Any) -> bool:
    """Whether ``value[start:end:step]`` along ``dim`` keeps every row at both batch sizes
    (``x[0:B]``, ``x[:]``, ``x[0:sys.maxsize]``): then a write there replaces the whole dim."""
    info = ctx.info(value)
    if not isinstance(info, ValueInfo) or not info.is_tensor:
        return False
    for batch, shape in enumerate((info.shape_a, info.shape_b)):
        size = shape[dim]
        first = 0 if start is None else _number_at(ctx, start, batch)
        last = size if end is None else _number_at(ctx, end, batch)
        stride = 1 if step is None else _number_at(ctx, step, batch)
        if first is None or last is None or stride != 1:
            return False
        first, last = (first + size if first < 0 else first), (last + size if last < 0 else last)
        if first > 0 or last < size:
            return False
    return True


def _scatter_into(name: str, src_dims: Callable[[RuleContext, int], list[int]],
                  written: Callable[[RuleContext, Batched, int], str | None]) -> Rule:
    """``<op>_scatter(self, src, ...)``: self with src written into a region of it (the
    functional form of ``x[region] = src``). Per-sample when every sample's part of src
    lands in that sample's rows of self: src's batch dim must map onto self's (with the
    same rows per sample and order), and the region must not pick rows of the batch dim.

    ``src_dims(ctx, ndim)`` lists, for each dim of src, the dim of self it lands on;
    ``written(ctx, fact, ndim)`` says how the write picks rows of self's batch dim
    ``fact.dim`` (a reason to reject), or None when it leaves that dim whole.
    """

    def rule(ctx: RuleContext) -> Fact:
        dst, src = ctx.arg(0, "input"), ctx.arg(1, "src")
        dfact, sfact = ctx.fact(dst), ctx.fact(src)
        ndim = ctx.ndim(dst)
        fact = dfact if isinstance(dfact, Batched) else None
        if isinstance(sfact, Batched):
            lands = src_dims(ctx, ndim)[sfact.dim] if sfact.dim < ctx.ndim(src) else None
            moved = dataclasses.replace(sfact, dim=lands if lands is not None else -1)
            if fact is not None and (moved.dim, moved.factor, moved.major) != (
                    fact.dim, fact.factor, fact.major):
                ctx.mix(f"it writes a tensor whose batch dim ({sfact}) lands on dim "
                        f"{moved.dim} of a tensor batched as {fact}, so one sample's values "
                        "go into another sample's rows",
                        f"give the written value the batch dim of the tensor it is written "
                        f"into ({name} keeps dims in place)")
            fact = fact or moved
        if fact is not None and fact.dim >= 0:
            reason = written(ctx, fact, ndim)
            if reason is not None:
                ctx.mix(f"{reason}, so which samples receive the values depends on where a "
                        "microbatch starts",
                        "write along a non-batch dim (x[:, 1:] = y), or into every sample "
                        "with a per-sample mask: torch.where(mask, y, x)")
        return per_sample(ctx)

    return rule


def _dim_at(ctx: RuleContext, index: int, name: str, ndim: int, default: int = 0) -> int:
    d = ctx.arg(index, name, default)
    return d % ndim if isinstance(d, int) and ndim else -1


def _slice_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """slice_scatter(self, src, dim, start, end, step): rows start:end:step of dim."""
    dim = _dim_at(ctx, 2, "dim", ndim)
    if dim != fact.dim or _whole_slice(ctx, ctx.arg(0, "input"), dim, ctx.arg(3, "start"),
                                       ctx.arg(4, "end"), ctx.arg(5, "step")):
        return None
    return f"it writes into a slice of the batch dim (x[start:end] = y along dim {dim})"


def _select_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """select_scatter(self, src, dim, index): the one row ``index`` of dim."""
    if _dim_at(ctx, 2, "dim", ndim) != fact.dim:
        return None
    return f"it writes into row {ctx.arg(3, 'index')} of the batch dim (x[i] = y)"


def _diagonal_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """diagonal_scatter(self, src, offset, dim1, dim2): the diagonal of dims dim1, dim2."""
    if fact.dim not in (_dim_at(ctx, 3, "dim1", ndim), _dim_at(ctx, 4, "dim2", ndim, 1)):
        return None
    return "it writes the diagonal of a pair of dims that includes the batch dim"


def _same_dims(ctx: RuleContext, ndim: int) -> list[int]:
    return list(range(ndim))  # slice_scatter: src has self's dims


def _all_but_selected(ctx: RuleContext, ndim: int) -> list[int]:
    dim = _dim_at(ctx, 2, "dim", ndim)
    return [d for d in range(ndim) if d != dim]  # select_scatter: src lacks the selected dim


def _diagonal_src_dims(ctx: RuleContext, ndim: int) -> list[int]:
    pair = (_dim_at(ctx, 3, "dim1", ndim), _dim_at(ctx, 4, "dim2", ndim, 1))
    return [d for d in range(ndim) if d not in pair] + [-1]  # the diagonal goes last


slice_scatter_rule = _scatter_into("slice_scatter", _same_dims, _slice_written)
select_scatter_rule = _scatter_into("select_scatter", _all_but_selected, _select_written)
diagonal_scatter_rule = _scatter_into("diagonal_scatter", _diagonal_src_dims,
                                      _diagonal_written)


def masked_scatter_rule(ctx: RuleContext) -> Fact:
    """masked_scatter(self, mask, source): the masked positions of self, in row-major order
    over the whole tensor, take source's elements one after another. Over a batched self
    the element a sample takes depends on how many positions earlier samples mask."""
    facts = ctx.arg_facts()
    if has_batched(facts):
        ctx.mix("it fills the masked positions with source's elements in order over the whole "
                "batch, so the values sample i receives depend on how many positions the "
                "samples before it mask (and a microbatch starts again at source's first "
                "element)",
                "give the values the shape of the tensor and select with the mask: "
                "torch.where(mask, values, x)")
    return join_facts(facts, ctx)

