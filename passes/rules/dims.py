"""Which dims an op couples, read off its call: the ``get_dims`` of ``families.along``.

Each getter takes the ``RuleContext`` and returns dims of the op's input (negative ones
count from the end): ``dim_arg(1, "dim", -1)`` reads ``softmax(x, dim)``, ``last_dims(1)``
is a contraction over features, ``pad_dims`` the dims ``F.pad`` really pads. When a dim is
not known at compile time (a symbolic ``dim``), a getter returns every dim: the batch dim
is then among them and the op is rejected, never guessed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..facts import Free, ValueInfo
from .context import RuleContext
from .spellings import node_name

__all__ = [
    "all_dims",
    "compared_dims",
    "diagonal_dims",
    "dim_arg",
    "every_dim",
    "flip_dims",
    "last_dims",
    "module_dim",
    "normalized_dims",
    "pad_dims",
    "roll_dims",
    "softmax_dims",
    "spatial_of",
    "tril_dims",
    "unfold_dims",
]


def all_dims(ctx: RuleContext, value: Any) -> list[int]:
    return list(range(ctx.ndim(value)))


def dim_arg(index: int = 1, name: str = "dim", default: Any = None,
            of: tuple[int, str] = (0, "input")) -> Callable[[RuleContext], list[int]]:
    """Dims named by an argument; ``None`` or ``[]`` mean every dim of the input."""

    def get(ctx: RuleContext) -> list[int]:
        d = ctx.arg(index, name, default)
        if d is None or (isinstance(d, (tuple, list)) and len(d) == 0):
            return all_dims(ctx, ctx.arg(*of))
        if isinstance(d, fx.Node):  # a symbolic dim: assume the worst
            return all_dims(ctx, ctx.arg(*of))
        return list(d) if isinstance(d, (tuple, list)) else [d]

    return get


def last_dims(k: int) -> Callable[[RuleContext], list[int]]:
    return lambda ctx: list(range(-k, 0))



def softmax_dims(ctx: RuleContext) -> list[int]:
    """softmax's dim (a module's ``.dim``); ``None`` is the legacy implicit dim (0 for 0-, 1-
    and 3-d inputs, else 1)."""
    d = ctx.module.dim if ctx.module is not None else ctx.arg(1, "dim")
    if d is None:
        ndim = ctx.ndim(ctx.arg(0, "input"))
        return [0 if ndim in (0, 1, 3) else 1]
    return [d]


def module_dim(ctx: RuleContext) -> list[int]:
    """The dim a module was built with (``nn.GLU(dim)``)."""
    return [ctx.module.dim]


def normalized_dims(ctx: RuleContext) -> list[int]:
    """LayerNorm/RMSNorm: the last ``len(normalized_shape)`` dims (the module's, or the
    functional's argument)."""
    shape = (ctx.module.normalized_shape if ctx.module is not None
             else ctx.arg(1, "normalized_shape"))
    return list(range(-_length(ctx, shape), 0))


def compared_dims(ctx: RuleContext) -> list[int]:
    """cosine_similarity compares vectors along its dim (default 1); pairwise_distance and
    cdist along the last dim."""
    if isinstance(ctx.module, nn.CosineSimilarity):
        return [ctx.module.dim]
    if ctx.module is None and node_name(ctx.node) == "cosine_similarity":
        return [ctx.arg(2, "dim", 1)]
    return [-1]


def every_dim(ctx: RuleContext) -> list[int]:
    return all_dims(ctx, ctx.arg(0))


def pad_dims(ctx: RuleContext) -> list[int]:
    """F.pad(x, pad) pads the last len(pad) // 2 dims, except those padded by (0, 0) (LongT5
    spells a pad of one dim as zeros for every dim, the batch dim too); a module's int
    padding pads every spatial dim."""
    pad = ctx.module.padding if ctx.module is not None else ctx.arg(1, "pad", ctx.arg(1, "padding"))
    if isinstance(pad, int):
        n = spatial_of(ctx) or 1
        return list(range(-n, 0))
    if not isinstance(pad, (tuple, list)):  # a node holding the list: assume every dim
        return all_dims(ctx, ctx.arg(0, "input"))
    return [-1 - k for k in range(len(pad) // 2)
            if not (_is_zero(ctx, pad[2 * k]) and _is_zero(ctx, pad[2 * k + 1]))]


def _is_zero(ctx: RuleContext, value: Any) -> bool:
    """A constant 0, or a batch-free number that is 0 (export's SymInt arithmetic)."""
    if isinstance(value, fx.Node):
        info = ctx.info(value)
        return isinstance(ctx.fact(value), Free) and isinstance(info, ValueInfo) and (
            not info.is_tensor and info.int_a == 0 and info.int_b == 0)
    return isinstance(value, int) and value == 0


def _length(ctx: RuleContext, value: Any) -> int:
    """len() of a shape argument: a list, or a node holding one (``x.shape[-1:]``)."""
    if isinstance(value, (tuple, list)):
        return len(value)
    if isinstance(value, int):
        return 1
    info = ctx.info(value)
    if isinstance(info, tuple):
        return len(info)
    return ctx.ndim(ctx.arg(0, "input"))  # unknown: assume every dim (rejects over the batch)


def tril_dims(ctx: RuleContext) -> list[int]:
    return [-2, -1]


def diagonal_dims(ctx: RuleContext) -> list[int]:
    if node_name(ctx.node) == "diag" or node_name(ctx.node) == "trace":
        return all_dims(ctx, ctx.arg(0, "input"))
    return [ctx.arg(2, "dim1", 0), ctx.arg(3, "dim2", 1)]


def roll_dims(ctx: RuleContext) -> list[int]:
    d = ctx.arg(2, "dims")
    if d is None or (isinstance(d, (tuple, list)) and not d):
        return all_dims(ctx, ctx.arg(0, "input"))  # roll of the flattened tensor
    return list(d) if isinstance(d, (tuple, list)) else [d]


def unfold_dims(ctx: RuleContext) -> list[int]:
    return [ctx.arg(1, "dimension")]


def flip_dims(ctx: RuleContext) -> list[int]:
    d = ctx.arg(1, "dims")
    return list(d) if isinstance(d, (tuple, list)) else [d]




def spatial_of(ctx: RuleContext) -> int | None:
    """Spatial dims of a module or functional (N, C, ...) op, when its name tells them."""
    name = type(ctx.module).__name__ if ctx.module is not None else node_name(ctx.node)
    for n in (1, 2, 3):
        if f"{n}d" in name.lower():
            return n
    return None
