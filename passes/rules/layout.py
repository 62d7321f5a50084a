"""Rules of ops that move values without computing new ones: reshapes, squeezes, repeats,
splits and joins, copies and casts, and Python-level access (sizes, attributes, tuples).

The values stay; the shapes at two batch sizes locate the batch dim afterwards. What can
go wrong is a layout that mixes rows: a reshape that merges rows of different samples, a
split or join along the batch dim, a squeeze of the batch dim on a 1-sample microbatch
(``squeeze_rule`` rewrites the node into the call it makes at the full batch).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch.fx as fx

from ..facts import Batched, Container, Fact, Free, ValueInfo
from .context import RuleContext, handles_positions, int_fact, join_facts, number_fact
from .families import check_batch_not_in, linear, per_sample
from .spellings import is_aten, node_name, rule_key

__all__ = [
    "cat_rule",
    "chunk_rule",
    "detach_rule",
    "drop_rule",
    "getattr_rule",
    "read_value_rule",
    "repeat_rule",
    "reshape_rule",
    "size_rule",
    "squeeze_rule",
    "unit_marker",
]


def reshape_rule(ctx: RuleContext) -> Fact:
    """view/reshape/flatten: the batch dim must stay a batch-major (or B-innermost) block."""
    x = ctx.arg(0, "input")
    fact = ctx.fact(x)
    if not isinstance(fact, Batched):
        return linear(ctx)
    info_in, info_out = ctx.info(x), ctx.info()
    out = ctx.batched_out(major=True)
    assert isinstance(out, Batched)
    major = True
    for shape_in, shape_out in ((info_in.shape_a, info_out.shape_a),
                                (info_in.shape_b, info_out.shape_b)):
        outer_in = math.prod(shape_in[:fact.dim]) * (1 if fact.major else fact.factor)
        outer_out = math.prod(shape_out[:out.dim])
        if outer_out == outer_in:
            major = True
        elif outer_out * out.factor == outer_in:
            major = False
        else:
            ctx.mix(f"it reshapes {tuple(info_in.shape_a)} to {tuple(info_out.shape_a)} at "
                    f"batch {ctx.gbs}, mixing rows of different samples (or baking in the "
                    "batch size)",
                    "keep the batch dim leading, e.g. x.view(x.size(0), -1), and use -1 or "
                    "x.size(0) instead of a constant batch size")
    return Batched(out.dim, out.factor, major or out.factor == 1)


def squeeze_rule(ctx: RuleContext) -> Fact:
    """squeeze() / squeeze(d): at the full batch the batch dim has B > 1 rows, so it is
    never squeezed, but a microbatch of one sample would lose it. The node is specialised
    to the dims it drops at the full batch: (B, 1, C).squeeze() -> squeeze((1,)),
    (B, C).squeeze(0) -> squeeze(()), the identity."""
    x = ctx.arg(0, "input")
    fact, info = ctx.fact(x), ctx.info(x)
    if not isinstance(fact, Batched) or not isinstance(info, ValueInfo):
        return per_sample(ctx)
    dims = ctx.arg(1, "dim")
    named = list(range(info.ndim)) if dims is None else (
        list(dims) if isinstance(dims, (tuple, list)) else [dims])
    if not all(isinstance(d, int) for d in named):
        ctx.mix("it squeezes dims computed at run time, which may include the batch dim "
                "of a 1-sample microbatch", "squeeze constant dims: x.squeeze(-1)")
    if info.shape_a[fact.dim] == 1:
        ctx.mix(f"at the full batch of {ctx.gbs} it drops the batch dim itself",
                "squeeze only size-1 non-batch dims: x.squeeze(-1)")
    named = [d % info.ndim for d in named]
    if dims is None or fact.dim in named:  # what a microbatch of one would squeeze differs
        dropped = tuple(d for d in named if info.shape_a[d] == 1)
        target = ctx.node.target
        if is_aten(target):  # aten.squeeze.default / .dim -> aten.squeeze.dims
            target = rule_key(target).dims
        ctx.specialise((x, list(dropped) if is_aten(target) else dropped), target=target)
    return per_sample(ctx)


def repeat_rule(ctx: RuleContext) -> Fact:
    """x.repeat(r0, r1, ...): copies along the batch dim are interleaved, not batch-major."""
    x = ctx.arg(0, "input")
    fact = ctx.fact(x)
    out = per_sample(ctx)
    if not isinstance(fact, Batched) or not isinstance(out, Batched) or out.factor == 1:
        return out
    return dataclasses.replace(out, major=False)  # [x0..xB, x0..xB]: sample rows are apart

def chunk_rule(ctx: RuleContext) -> Fact:
    """split/chunk/unbind along a non-batch dim: every piece keeps the batch dim."""
    x = ctx.arg(0, "input")
    name = node_name(ctx.node)
    dim = ctx.arg(1, "dim", 0) if name == "unbind" else ctx.arg(2, "dim", 0)
    check_batch_not_in(ctx, x, [dim], "splits", "split along a non-batch dim")
    fact = ctx.fact(x)
    if not isinstance(fact, Batched):
        return join_facts(ctx.arg_facts(), ctx)
    out = ctx.batched_out()
    if isinstance(out, Container):
        return Container(tuple((i, dataclasses.replace(f, factor=fact.factor, major=fact.major)
                                if isinstance(f, Batched) else f) for i, f in out.items))
    return out


def _pieces(ctx: RuleContext, tensors: Any) -> list[tuple[Fact, int]]:
    """(fact, ndim) of each tensor in a list argument, or in a node holding a tuple."""
    if isinstance(tensors, fx.Node):  # torch.stack(x.unbind(1))
        fact, info = ctx.fact(tensors), ctx.info(tensors)
        facts = [f for _, f in fact.items] if isinstance(fact, Container) else []
        ndims = [i.ndim if isinstance(i, ValueInfo) else 0 for i in info or ()]
        return list(zip(facts, ndims))
    return [(ctx.fact(t), ctx.ndim(t)) for t in tensors or ()]


def cat_rule(ctx: RuleContext) -> Fact:
    """cat/stack: per-sample tensors joined along a non-batch dim."""
    name = node_name(ctx.node)
    dim = ctx.arg(1, "dim", 0)
    for fact, ndim in _pieces(ctx, ctx.arg(0, "tensors")):
        if name in ("hstack", "column_stack"):
            dims = [1] if ndim > 1 else [0]
        elif name in ("vstack", "row_stack"):
            dims = [0]
        elif name == "dstack":
            dims = [2] if ndim > 2 else []
        elif name in ("cat", "concat", "concatenate"):
            dims = [dim]
        else:
            continue  # stack: a new dim, the shapes check the rest
        if isinstance(fact, Batched) and ndim and fact.dim in {d % ndim for d in dims}:
            ctx.mix(f"it concatenates along dim {fact.dim}, which is the batch dim",
                    "concatenate along a non-batch dim (torch.cat(xs, dim=1))")
    return per_sample(ctx)  # batch-free pieces along a feature dim are fine: shapes tell



@handles_positions
def size_rule(ctx: RuleContext) -> Fact:
    """x.size(d) / x.shape / numel: ints (or tuples) that may be multiples of the batch size."""
    info = ctx.info()
    if isinstance(info, tuple):
        return Container(tuple((i, _int_of(v, ctx)) for i, v in enumerate(info)))
    return int_fact(ctx)


def read_value_rule(ctx: RuleContext) -> Fact:
    """x.item() / x.tolist(): Python values read out of batched data."""
    ctx.mix("it reads tensor values into Python (.item(), .tolist()), so what follows depends "
            "on the data of the whole batch (or of one microbatch), not on shapes",
            "keep the computation in tensors: use torch.where or a mask instead of Python "
            "branches and numbers")


def _int_of(info: Any, ctx: RuleContext) -> Fact:
    return number_fact(info, ctx) if isinstance(info, ValueInfo) else Free()


@handles_positions
def getattr_rule(ctx: RuleContext) -> Fact:
    """getattr(x, name): ``.shape`` ints, ``.values``/``.indices`` of a namedtuple result."""
    obj, name = ctx.arg(0), ctx.arg(1)
    fact = ctx.fact(obj)
    info = ctx.info(obj)
    if isinstance(fact, Container):
        fields = getattr(info, "fields", None) or ("values", "indices")
        if name in fields:
            return fact.get(fields.index(name))
    if name in ("shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"):
        return size_rule(ctx)
    if name in ("T", "mT", "H", "mH", "real", "imag", "data"):
        return per_sample(ctx)
    return size_rule(ctx)



@handles_positions
def drop_rule(ctx: RuleContext) -> Fact:
    """Ops that produce no value the model uses (asserts, prints): batch-free."""
    return Free()


@handles_positions
def unit_marker(ctx: RuleContext) -> Fact:
    """An FSDP unit marker hands its values on unchanged: one fact per value."""
    return Container(tuple((i, ctx.fact(v)) for i, v in enumerate(ctx.node.args[1:])))


@handles_positions
def detach_rule(ctx: RuleContext) -> Fact:
    """detach/alias and the like: the same values (positions stay positions)."""
    x = ctx.arg(0, "input")
    f = ctx.fact(x)
    out = linear(ctx)
    if isinstance(f, Batched) and isinstance(out, Batched) and f.positions:
        return dataclasses.replace(out, positions=True)
    return out

