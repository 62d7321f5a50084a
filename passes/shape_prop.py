"""Shape pass: run the graph on fake tensors at two batch sizes.

Writes ``node.meta[SHAPES]``: a ``ValueInfo`` (or a tuple/list of them, for ops
that return several values) holding each value's shape at batch ``gbs`` and at
batch ``gbs + 1``. A dim whose size differs between the two runs scales with the
batch; that is what lets the analysis follow the batch dim through ``view``,
indexing and every other shape op without guessing. Fake tensors carry no data,
so this costs no real compute whatever the model size.

Example: ``h = x.view(x.size(0), -1)`` with x of shape (B, 4, 8) at gbs 6 gives
``ValueInfo(shape_a=(6, 32), shape_b=(7, 32))``: dim 0 is the batch dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from .facts import SHAPES, ValueInfo

__all__ = ["ShapePropagationError", "propagate_shapes", "resize_batch"]


class ShapePropagationError(Exception):
    """Raised with the failing node when the graph cannot run on fake tensors."""

    def __init__(self, node: fx.Node, exc: BaseException) -> None:
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.node = node
        self.original = exc


def resize_batch(value: Any, dim: Any, batch: int) -> Any:
    """A fresh tensor like ``value`` whose ``dim`` has size ``batch`` (inside a fake mode)."""
    if dim is None or not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    shape[dim] = batch
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _info(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ValueInfo(True, tuple(value.shape), (), value.dtype)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return ValueInfo(False, int_a=value, value_a=value)
    if isinstance(value, (tuple, list)):  # torch.Size and namedtuples too
        return tuple(_info(v) for v in value)
    return None


def _merge(a: Any, b: Any) -> Any:
    """Combine the infos of the two runs into one ``ValueInfo`` per value."""
    if isinstance(a, ValueInfo) and isinstance(b, ValueInfo):
        if a.is_tensor:
            return ValueInfo(True, a.shape_a, b.shape_a, a.dtype)
        return ValueInfo(False, int_a=a.int_a, int_b=b.int_a, value_a=a.value_a)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return tuple(_merge(x, y) for x, y in zip(a, b))
    return None


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.infos: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:  # reported with the node by the caller
            raise ShapePropagationError(n, exc) from exc
        self.infos[n] = _info(result)
        return result


def propagate_shapes(
    gm: fx.GraphModule, inputs: Sequence[Any], in_dims: Sequence[Any], gbs: int
) -> fx.GraphModule:
    """Annotate ``gm`` in place with ``ValueInfo``s at batch ``gbs`` and ``gbs + 1``.

    ``inputs`` are example values in placeholder order; ``in_dims`` their batch
    dims (an int, or None for unbatched inputs).
    """
    runs = []
    for batch in (gbs, gbs + 1):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            args = []
            for value, dims in zip(inputs, in_dims):
                # one batch dim per input, shared by every tensor inside a nested input
                args.append(pytree.tree_map(lambda v, d=dims: resize_batch(v, d, batch), value))
            recorder = _Recorder(gm)
            recorder.run(*args)
        runs.append(recorder.infos)
    for node in gm.graph.nodes:
        node.meta[SHAPES] = _merge(runs[0].get(node), runs[1].get(node))
    return gm
