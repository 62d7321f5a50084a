"""Batch norm's check that a channel has more than one value, kept where a graph lost it.

In training, eager's ``F.batch_norm`` raises ``ValueError: Expected more than 1 value per
channel when training`` where a channel has one value: a batch of one sample of ``(N, C)``
features (the short last batch of an epoch). ``torch.export`` traces that Python check away,
so the graph's variant for a batch of 1 normalised the single sample (variance 0) and
wrote running statistics eager never writes. ``one_value_refused`` raises eager's error,
as an ``InputError`` (a ``ValueError``), before anything runs. A graph traced by torch.fx
keeps the layer whole, whose own check runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from .errors import InputError
from .sources import source_line

__all__ = ["one_value_refused"]


def one_value_refused(gm: fx.GraphModule, batch: int, in_dims: Mapping[str, int | None]
                      ) -> None:
    """Raise eager's error where a batch norm of ``gm`` that trains would see one value per
    channel in a batch of ``batch`` samples: its input's sizes but the channel dim, each
    at ``batch`` (the symbols of the inputs' batch dims, ``in_dims`` by placeholder name,
    substituted; a size that reads another symbol, a varying length, is not judged)."""
    batches = set()
    for n in gm.graph.nodes:
        d = in_dims.get(n.name) if n.op == "placeholder" else None
        shape = getattr(n.meta.get("val"), "shape", ())
        if d is not None and d < len(shape) and isinstance(shape[d], torch.SymInt):
            batches.add(shape[d].node.expr)
    for node in gm.graph.nodes:
        value = node.args[0].meta.get("val") if _trains(node) else None
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        sizes = [_at(d, batches, batch) for i, d in enumerate(value.shape) if i != 1]
        if all(size is not None for size in sizes) and math.prod(sizes) == 1:
            size = torch.Size([sizes[0], *value.shape[1:]])
            raise InputError(
                f"Expected more than 1 value per channel when training, got input size {size} "
                f"(the batch norm at {source_line(node)}: eager raises this ValueError for a "
                "batch of one sample in training). Fix: drop the short last batch "
                "(DataLoader(..., drop_last=True)), or call in eval mode; nothing ran")


def _at(size: Any, batches: set[Any], batch: int) -> int | None:
    """``size`` at ``batch`` samples (None: it reads a symbol that is not the batch's)."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not expr.free_symbols <= batches:
        return None
    return int(expr.subs({s: batch for s in expr.free_symbols}))


def _trains(node: fx.Node) -> bool:
    """Whether ``node`` is an ATen batch norm that normalises by the batch's statistics."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) \
            or "batch_norm" not in op.name() or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return False
    names = [a.name for a in op._schema.arguments]
    if "training" not in names:  # ``_batch_norm_with_update``: always; ``_no_training``: never
        return "with_update" in op.name()
    index = names.index("training")
    return bool(node.args[index] if index < len(node.args) else node.kwargs.get("training"))
