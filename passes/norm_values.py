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

import torch
import torch.fx as fx

from .errors import InputError
from .sources import source_line

__all__ = ["one_value_refused"]


def one_value_refused(gm: fx.GraphModule, batch: int) -> None:
    """Raise eager's error where a batch norm of ``gm`` that trains would see one value per
    channel in a batch of ``batch`` samples (each sample's values per channel: the product
    of its input's dims after the channel dim, where they are fixed)."""
    for node in gm.graph.nodes:
        value = node.args[0].meta.get("val") if _trains(node) else None
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            continue
        rest = list(value.shape[2:])
        if all(isinstance(d, int) for d in rest) and batch * math.prod(rest) == 1:
            size = torch.Size([batch, *value.shape[1:]])
            raise InputError(
                f"Expected more than 1 value per channel when training, got input size {size} "
                f"(the batch norm at {source_line(node)}: eager raises this ValueError for a "
                "batch of one sample in training). Fix: drop the short last batch "
                "(DataLoader(..., drop_last=True)), or call in eval mode; nothing ran")


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
