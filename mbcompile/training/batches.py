"""What the Trainer reads: a batch as call arguments, and the loss in a model's output.

A batch is a tuple or list (positional inputs of the model), a dict (keyword inputs)
or a tensor. The model computes its own loss (so that backward can run per
microbatch) and returns it as a scalar tensor, first in a tuple, under ``"loss"`` in
a dict, or as ``.loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbcompile.errors import MbcompileError

__all__ = ["TrainerError", "batch_args", "batch_layout", "same_layout"]


class TrainerError(MbcompileError):
    """The training loop cannot go on: no data, no loss in the output, bad arguments."""


def batch_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as ``(args, kwargs)`` for ``model(*args, **kwargs)``."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise TrainerError(
        f"a batch must be a tuple or list (positional inputs of the model), a dict (keyword "
        f"inputs) or a tensor, got {type(batch).__name__}")


def batch_layout(batch: Any) -> tuple[Any, ...]:
    """What a module compiled from ``batch`` fixes about later ones: the nesting, each
    tensor's shape, dtype and device, and every other leaf's value. Two batches with
    equal layouts can run through the same compiled module."""
    leaves, spec = pytree.tree_flatten(batch)
    return spec, tuple((t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor)
                       else (type(t), t) for t in leaves)


def same_layout(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    """Whether two ``batch_layout`` results are equal (a leaf whose ``==`` is no bool,
    such as a numpy array, counts as different)."""
    try:
        return a is not None and b is not None and bool(a == b)
    except Exception:
        return False
