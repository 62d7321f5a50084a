"""The rule families: the shapes of rule most ops share, each a function or a rule maker.

- ``pointwise``, ``per_sample``, ``linear``, ``free``: the families ``register_batch_rule``
  names (elementwise; never mixes samples; linear in its inputs; batch-free values);
- ``linear_arith``: ``+ - * /``, where a reduction over the batch may meet batch-free
  values linearly (``loss.sum() / count``);
- ``along(dims, what)``: an op that couples elements along some dims (softmax, sort,
  cumsum, flip): fine unless the batch dim is one of them (``dims`` reads them off the
  call, see ``dims.py``);
- ``channels_first``: (N, C, *spatial) ops (conv, pooling, GroupNorm): the batch must be N;
- ``reduction``: sum and mean over the batch become partial sums; max, var, norm over it mix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..facts import PARAMS, REDUCTION, Batched, BatchSize, Fact, Reduced, ReductionSpec
from .context import Rule, RuleContext, batched_facts, join_facts
from .dims import dim_arg, spatial_of
from .spellings import node_name

__all__ = [
    "along",
    "channels_first",
    "check_batch_not_in",
    "free",
    "linear",
    "linear_arith",
    "no_batch_size_values",
    "per_sample",
    "pointwise",
    "reduction",
]


def free(ctx: RuleContext) -> Fact:
    """Creation ops (``torch.zeros(3)``): batch-free unless shaped by the batch."""
    return join_facts(ctx.arg_facts(), ctx)


def no_batch_size_values(ctx: RuleContext, facts: Sequence[Fact]) -> None:
    if any(isinstance(f, BatchSize) for f in facts) and ctx.is_tensor(ctx.node) and not any(
            isinstance(f, Reduced) for f in facts):
        ctx.mix("it uses the batch size (x.size(0), len(x)) as a value in per-sample work: "
                "inside the microbatch loop it is the microbatch's size, not the batch's",
                "use the batch size only for shapes (view, expand, zeros), or divide a "
                "reduction by it (loss.sum() / x.size(0)), which mbcompile keeps global")


def pointwise(ctx: RuleContext) -> Fact:
    """Elementwise / broadcasting op: samples stay independent."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts) and not batched_facts(facts):
        ctx.mix("it applies a non-linear function to a reduction over the batch (such as "
                "loss.sqrt() or acc ** 2); mbcompile combines reductions across microbatches "
                "linearly and only divides sums by counts",
                "apply the non-linear function per sample before reducing, or return the "
                "reduction and transform it outside the model")
    no_batch_size_values(ctx, facts)
    return join_facts(facts, ctx)


def linear(ctx: RuleContext) -> Fact:
    """Ops linear in each argument (negation, casts, reshapes): reductions pass through."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return join_facts(facts, ctx)
    return per_sample(ctx)


def linear_arith(op: str) -> Rule:
    """+, -: linear in both. *: linear if one side is batch-free. /: if the divisor is."""

    def rule(ctx: RuleContext) -> Fact:
        a, b = ctx.fact(ctx.arg(0)), ctx.fact(ctx.arg(1))
        if op == "div" and ctx.arg(2, "rounding_mode") is not None:
            return pointwise(ctx)  # floor / trunc division is not linear
        reduced = [f for f in (a, b) if isinstance(f, Reduced)]
        if not reduced:
            no_batch_size_values(ctx, (a, b))
            return join_facts((a, b), ctx)
        if op in ("add", "sub"):
            return join_facts((a, b), ctx)
        if isinstance(a, Reduced) and isinstance(b, Reduced):
            if op == "div" and b.count:
                return Reduced(count=a.count)  # sum / count: a mean, exact on the totals
            ctx.mix("it multiplies or divides two reductions over the batch, which is not "
                    "linear in the samples",
                    "divide only by counts computed from the inputs (mask.sum(), "
                    "(labels != -100).sum()), which mbcompile adds up before dividing")
        if op == "div" and isinstance(b, Reduced):
            ctx.mix("it divides by a reduction over the batch that depends on the parameters, "
                    "which is not linear in the samples",
                    "divide by counts computed from the inputs only")
        other = b if isinstance(a, Reduced) else a
        if isinstance(other, BatchSize):
            return Reduced(count=a.count if isinstance(a, Reduced) else False)  # sum / B
        return join_facts((a, b), ctx)

    return rule


def per_sample(ctx: RuleContext) -> Fact:
    """The op never mixes samples (its batch dim is found from the output's shape)."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return pointwise(ctx)
    return join_facts(facts, ctx)


def check_batch_not_in(ctx: RuleContext, value: Any, dims: Sequence[int], what: str,
                       *fixes: str) -> None:
    fact = ctx.fact(value)
    if not isinstance(fact, Batched):
        return
    ndim = ctx.ndim(value)
    if ndim and fact.dim in {d % ndim for d in dims}:
        ctx.mix(f"it {what} along dim {fact.dim}, which is the batch dim",
                *(fixes or (f"change the call so that it {what} along a non-batch dim",)))


def along(get_dims: Callable[[RuleContext], Sequence[int]], what: str, *fixes: str,
          inputs: Sequence[tuple[int, str]] = ((0, "input"),)) -> Rule:
    """The op couples elements along some dims of its inputs: fine unless the batch dim."""

    def rule(ctx: RuleContext) -> Fact:
        dims = get_dims(ctx)
        for index, name in inputs:
            check_batch_not_in(ctx, ctx.arg(index, name), dims, what, *fixes)
        return per_sample(ctx)

    return rule



def channels_first(spatial: int | None, what: str, *, input_index: int = 0,
                   input_name: str = "input", extra: Sequence[tuple[int, str]] = ()) -> Rule:
    """(N, C, *spatial) ops (conv, pooling, upsampling, GroupNorm): the batch must be N.

    ``spatial`` is the number of spatial dims when the op fixes it (``Conv2d``: 2;
    ``None``: read it off the op's name, ``max_pool2d``; 0: any): a 3-d input to a
    2-d conv is unbatched (C, H, W), so its dim 0 is channels, not samples.
    """

    def rule(ctx: RuleContext) -> Fact:
        for index, name in ((input_index, input_name), *extra):
            value = ctx.arg(index, name)
            fact = ctx.fact(value)
            if not isinstance(fact, Batched):
                continue
            ndim = ctx.ndim(value)
            n = spatial if spatial is not None else spatial_of(ctx)
            n = None if n == 0 else n
            if fact.dim != 0 or (n is not None and ndim != n + 2):
                expected = f"{n + 2}-d (N, C, ...)" if n is not None else "(N, C, ...)"
                ctx.mix(f"it {what} a {ndim}-d input whose batch dim is {fact.dim}; it treats "
                        f"only dim 0 of a {expected} input as samples, so here the batch is "
                        "mixed in as channels or space",
                        "move the batch dim first (x.movedim(d, 0)) and pass a batched "
                        f"{expected} input")
        return per_sample(ctx)

    return rule



def reduction(kind: str = "sum", partial: Callable[..., Any] | None = None, *,
              nonlinear: bool | str = False,
              dims: Callable[[RuleContext], Sequence[int]] | None = None) -> Rule:
    """Sum/mean-style reductions: over the batch dim they become a ``ReductionSpec``.

    ``nonlinear`` marks a reduction (max, var, ...) that is rejected over the batch
    dim, named in the message by the op's own name (``True``) or by the string given.
    ``torch.max(a, b)`` (two tensors) is elementwise.
    """
    get_dims = dims or dim_arg(1, "dim")

    def rule(ctx: RuleContext) -> Fact:
        other = (node_name(ctx.node) if nonlinear is True else nonlinear) or ""
        x = ctx.arg(0, "input")
        second = ctx.arg(1, "other")
        if other in ("max", "min") and ctx.is_tensor(second):
            return pointwise(ctx)  # torch.max(a, b): elementwise maximum
        fact = ctx.fact(x)
        if isinstance(fact, Reduced):
            if other:
                ctx.mix(f"it takes the {other} of a reduction over the batch, which is not "
                        "linear in the samples", "reduce each sample first")
            return fact  # summing / averaging the remaining dims is linear
        if not isinstance(fact, Batched):
            return per_sample(ctx)
        ndim = ctx.ndim(x)
        if fact.dim not in {d % ndim for d in get_dims(ctx)}:
            return per_sample(ctx)
        if other:
            ctx.mix(f"it takes the {other} over the batch dim, which couples samples "
                    "non-linearly (the result of a microbatch is not a part of the batch's)",
                    f"take the {other} over the non-batch dims only")
        ctx.node.meta[REDUCTION] = ReductionSpec(kind, partial)
        return Reduced(count=not ctx.node.meta.get(PARAMS, True))

    return rule

