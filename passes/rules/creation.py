"""Rules of creation ops: ``zeros(B, D)``, ``x.new_ones(T, T)``, ``full(size, v)``,
``torch.arange(B)``.

Their values are batch-free; only their shape may come from the batch (``B`` from
``x.size(0)``), which makes them per-sample. A fill value must not be a batch size or a
position (inside the microbatch loop both are the microbatch's). ``torch.arange(B)`` is
``Batched(positions=True)``: each sample's index in its batch.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..facts import Batched, BatchSize, Fact, Free, Reduced
from .context import Rule, RuleContext, handles_positions, join_facts

__all__ = [
    "arange_rule",
    "new_full_rule",
    "new_like_rule",
    "new_tensor_rule",
    "size_like_rule",
    "value_arg",
]


@handles_positions
def arange_rule(ctx: RuleContext) -> Fact:
    """torch.arange(B): each sample's position in its batch (0, 1, ..., B-1)."""
    args = [a for a in ctx._args]
    start = ctx._kwargs.get("start", args[0] if len(args) >= 2 else 0)
    end = ctx._kwargs.get("end", args[1] if len(args) >= 2 else (args[0] if args else None))
    step = ctx._kwargs.get("step", args[2] if len(args) >= 3 else 1)
    facts = [ctx.fact(v) for v in (start, end, step)]
    if not any(isinstance(f, (BatchSize, Batched, Reduced)) for f in facts):
        return Free()
    efact = ctx.fact(end)
    if (isinstance(efact, BatchSize) and efact.multiple and ctx.fact(start) == Free()
            and start == 0 and step == 1):
        out = ctx.batched_out(major=True)
        if isinstance(out, Batched):
            return dataclasses.replace(out, positions=True)
    ctx.mix("it builds a range from the batch size that is not 0..B-1 (a start, step or "
            "end that is not a whole batch), which changes with every microbatch",
            "use torch.arange(x.size(0)) to index samples, or sizes of non-batch dims")



def value_arg(index: int | None, name: str | None = None, *, like_self: bool = True) -> Rule:
    """Creation ops: shaped by the batch at most; the fill value must not be a batch size.

    ``like_self=False``: ``x.new_zeros(size)`` and kin take only dtype and device from
    ``x``, so a batched ``x`` does not make them batched; their size arguments do.
    """

    @handles_positions
    def rule(ctx: RuleContext) -> Fact:
        if index is not None:
            value = ctx.arg(index, name)
            vfact = ctx.fact(value)
            if isinstance(vfact, BatchSize) or (
                    isinstance(vfact, Batched) and vfact.positions):
                ctx.mix("it fills a tensor with the batch size or sample positions, which "
                        "are the microbatch's inside the loop",
                        "use the batch size only for shapes")
        facts = ctx.arg_facts() if like_self else _facts_after_self(ctx)
        out = join_facts(facts, ctx)  # reductions pass through (linear)
        if isinstance(out, Batched) and out.positions:
            out = dataclasses.replace(out, positions=False)
        return out

    return rule


def _facts_after_self(ctx: RuleContext) -> list[Fact]:
    """Facts of every argument but ``self`` (a method's tensor, ATen's ``self``)."""
    out: list[Fact] = []
    rest = (ctx._args[1:], {k: v for k, v in ctx._kwargs.items() if k not in ("self", "input")})
    fx.node.map_arg(rest, lambda n: out.append(ctx.facts[n]))
    return out


size_like_rule = value_arg(None)
new_like_rule = value_arg(None, like_self=False)
new_full_rule = value_arg(2, "fill_value", like_self=False)
new_tensor_rule = value_arg(1, "data", like_self=False)
