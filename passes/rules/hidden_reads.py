"""Rules of ops whose output's shape hides what they read: each output element reads a
whole argument (``isin``, ``bucketize``), the flattened input (``take_along_dim``
without a dim), another layout (``kron``; ``as_strided``, ``along(every_dim)`` in the
table) or a dim chosen by size (``cross`` without a dim). The shapes at two batch sizes
look per-sample for all of them, so ``per_sample`` alone would split them; each rule
here says when they are.
"""

from __future__ import annotations

from ..facts import Batched, Fact, ValueInfo
from .context import Rule, RuleContext
from .dims import all_dims
from .families import along, check_batch_not_in, per_sample
from .spellings import node_name

__all__ = ["cross_rule", "kron_rule", "whole_argument"]


def whole_argument(index: int, name: str, what: str) -> Rule:
    """``f(x, y)`` where every output element reads all of ``y`` (``isin``'s test
    elements, ``bucketize``'s boundaries): a batched ``y`` mixes the samples."""
    return along(lambda ctx: all_dims(ctx, ctx.arg(index, name)), f"{what} {name}",
                 f"pass a batch-free {name} (a parameter, buffer or constant), or compare "
                 "within each sample", inputs=((index, name),))


def kron_rule(ctx: RuleContext) -> Fact:
    """kron(a, b): row ``i_a * len(b) + i_b``. A batched ``a`` gives each sample a block of
    rows; a batched ``b`` interleaves the samples unless ``a`` has one row there."""
    a, b = ctx.arg(0, "input"), ctx.arg(1, "other")
    fa, fb = ctx.fact(a), ctx.fact(b)
    if isinstance(fa, Batched) and isinstance(fb, Batched):
        ctx.mix("it multiplies every sample of one operand with every sample of the other",
                "take the product within each sample (torch.vmap(torch.kron))")
    if isinstance(fb, Batched):
        ia, ib = ctx.info(a), ctx.info(b)
        if isinstance(ia, ValueInfo) and ia.is_tensor and isinstance(ib, ValueInfo):
            k = fb.dim - ib.ndim + ia.ndim  # b's batch dim, aligned to a's dims
            if 0 <= k < ia.ndim and ia.shape_a[k] != 1:
                ctx.mix("its second operand is batched, so the result's rows interleave the "
                        "samples (row i_a * B + i, for each row i_a of the first)",
                        "put the batched operand first: torch.kron(x, a) and reorder the "
                        "batch-free operand to match")
    return per_sample(ctx)


def cross_rule(ctx: RuleContext) -> Fact:
    """cross(a, b, dim): along a non-batch dim of size 3. ``torch.cross`` without a dim
    takes the first dim of size 3, which for a microbatch of 3 may be the batch dim: the
    node is specialised to the dim the full batch uses."""
    a, b = ctx.arg(0, "input"), ctx.arg(1, "other")
    dim = ctx.arg(2, "dim", -1 if "linalg" in node_name(ctx.node) else None)
    if dim is None:
        info = ctx.info(a)
        sizes = info.shape_a if isinstance(info, ValueInfo) and info.is_tensor else ()
        dim = next((d for d, n in enumerate(sizes) if n == 3), None)
        if dim is not None:
            ctx.specialise((a, b, dim))
    if dim is not None:
        for value in (a, b):
            check_batch_not_in(ctx, value, [dim], "takes the cross product",
                               "take the cross product along a non-batch dim of size 3")
    return per_sample(ctx)
