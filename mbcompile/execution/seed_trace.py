"""A seed's replay traced into the aten ops it runs (``seeding.Seed.seed``).

Replaying the loss's tail (its forward, then autograd's backward) costs the autograd
engine at every step; after ``TRACE_AFTER`` replays of one kind of input the replay is
traced with ``make_fx`` and later steps call those few ops: the same kernels on the same
values, the same seed bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = ["TRACED", "TRACE_AFTER", "kind_of", "trace"]

#: Kinds of input whose replays are counted and traced (``Seed.seed``): a count that is a
#: Python int and changes every step would make a kind per step; past these, replayed.
TRACED = 4
#: Replays of one kind of input before it is traced: a trace costs about a hundred
#: replays (17 ms against 0.12 ms saved per step on bench_dynamic's GPT-2, CPU).
TRACE_AFTER = 32


def kind_of(values: Sequence[Any]) -> tuple[Any, ...] | None:
    """What a traced replay depends on besides the tensors' values: each tensor's shape,
    dtype and device, each Python number's value (traced as a constant); None where a value
    is neither, or under an autocast."""
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        return None  # its casts would be traced, and then cast again: replayed instead
    key: list[Any] = []
    for v in values:
        if type(v) is torch.Tensor:  # not a subclass: a fake or distributed tensor replays
            key.append((tuple(v.shape), v.dtype, v.device, v.layout))
        elif v is None or type(v) in (bool, int, float):
            key.append((type(v), v))
        else:
            return None
    return tuple(key)


def trace(replay: Any, args: Sequence[Any]) -> Any:
    """``replay`` traced into the aten ops it runs on ``args`` (False where it cannot be,
    or where the trace holds a tensor of its own: the key would not say when it changes)."""
    try:
        traced = make_fx(replay)(*args)
    except Exception:  # noqa: BLE001  (replayed instead, as before)
        return False
    if any(n.op == "get_attr" for n in traced.graph.nodes):
        return False
    for n in traced.graph.nodes:  # autograd's expand of a gradient to its own shape: a no-op
        if n.target is torch.ops.aten.expand.default and _same_shape(n, n.args[0]):
            n.replace_all_uses_with(n.args[0])
    traced.graph.eliminate_dead_code()  # the tail's own forward: only its gradient is kept
    traced.recompile()
    return traced


def _same_shape(a: fx.Node, b: Any) -> bool:
    """Whether the traced values of ``a`` and ``b`` have one shape (False where unknown)."""
    va, vb = a.meta.get("val"), b.meta.get("val") if isinstance(b, fx.Node) else None
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
        and va.shape == vb.shape
