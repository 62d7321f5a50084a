"""Shape pass: run the graph on fake tensors at two batch sizes.

Writes ``node.meta[SHAPES]``: a ``ValueInfo`` (or a tuple/list of them, for ops
that return several values) holding each value's shape at batch ``gbs`` and at
batch ``gbs + 1``. A dim whose size differs between the two runs scales with the
batch; that is what lets the analysis follow the batch dim through ``view``,
indexing and every other shape op without guessing. Both runs are the fake probe
(``fake_probe``, shared with the cost model): fake tensors carry no data, so this
costs no real compute whatever the model size.

A graph with a chain of repeated blocks runs cut to two of them, and the cut is handed on
(``shapes_and_cut``'s ``BlockRun``): the cost model probes the same cut, in the same fake
mode with the same fake parameters, instead of finding, cutting and copying them again.

Example: ``h = x.view(x.size(0), -1)`` with x of shape (B, 4, 8) at gbs 6 gives
``ValueInfo(shape_a=(6, 32), shape_b=(7, 32))``: dim 0 is the batch dim.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from .facts import SHAPES, InfoTuple, ValueInfo
from .fake_probe import FakeProbe
from .repeated_blocks import Blocks, find_blocks, truncate

__all__ = ["FAILED_ON_FAKES", "BlockRun", "ShapePropagationError", "propagate_shapes",
           "shapes_and_cut"]


class ShapePropagationError(Exception):
    """Raised with the failing node when the graph cannot run on fake tensors.

    ``reason`` says why in words a ``MixingError`` can quote (a data-dependent
    shape, a batch size baked into a constant), ``fix`` what to do about it.
    """

    def __init__(self, node: fx.Node, exc: BaseException, batch: int | None = None,
                 gbs: int | None = None) -> None:
        detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        super().__init__(detail)
        self.node = node
        self.original = exc
        self.batch = batch
        if "vmap" in str(exc):  # torch.func.vmap's levels do not reach fake tensors
            self.reason = (f"it calls torch.func.vmap inside forward ({detail}), which "
                           "mbcompile cannot run on shape-only tensors to follow the batch")
            self.fix = ("write the batched form instead of vmap (torch.einsum or torch.bmm "
                        "over the stacked weights of an ensemble; a per-sample layer applied "
                        "to the whole batch), or vmap over cm's outputs outside the model")
        elif isinstance(exc, _DATA_DEPENDENT):
            self.reason = ("its output shape (or a Python value it produces) depends on the "
                           "values in the tensors, not only on their shapes (nonzero, "
                           "boolean-mask indexing, .item(), .tolist()), so mbcompile cannot "
                           f"prove the batch splits cleanly ({detail})")
            self.fix = ("keep shapes independent of tensor values: use torch.where(mask, x, 0) "
                        "or a multiplication by the mask instead of x[mask]")
        elif gbs is not None and batch == gbs + 1:
            self.reason = (f"it runs at batch {gbs} but fails at batch {gbs + 1} ({detail}): a "
                           "batch size is baked in as a constant (such as x.view(32, -1)), so "
                           "it cannot run on a microbatch of any other size")
            self.fix = ("derive the batch size from the input: x.view(x.size(0), -1), "
                        "x.flatten(1) or -1 instead of a constant")
        else:
            self.reason = (f"{FAILED_ON_FAKES} at batch {batch} ({detail}), so mbcompile "
                           "cannot follow the batch dim through it")
            self.fix = ("check the model runs eagerly on a batch of that size, and keep shapes "
                        "independent of tensor values")


#: How an op the shapes cannot run on is refused (``capture="auto"`` then tries export:
#: fx traced a value it could not see, a dict input's ``None`` entry as a proxy)
FAILED_ON_FAKES = "it fails on shape-only (fake) tensors"

_DATA_DEPENDENT: tuple[type[BaseException], ...] = (
    DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def _info(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ValueInfo(True, tuple(value.shape), (), value.dtype)
    if isinstance(value, (int, float)):  # sizes, numbers computed from them (1 / B, B > 4)
        return ValueInfo(False, int_a=value, value_a=value)
    if isinstance(value, (tuple, list)):  # torch.Size and namedtuples too
        kind = type(value)  # namedtuples name their fields; torch.return_types (structseq) too
        fields = getattr(kind, "_fields", None) or getattr(kind, "__match_args__", None)
        return _tuple((_info(v) for v in value), fields)
    return None


def _tuple(items: Any, fields: tuple[str, ...] | None) -> InfoTuple:
    out = InfoTuple(items)
    out.fields = fields
    return out


def _merge(a: Any, b: Any) -> Any:
    """Combine the infos of the two runs into one ``ValueInfo`` per value."""
    if isinstance(a, ValueInfo) and isinstance(b, ValueInfo):
        if a.is_tensor:
            return ValueInfo(True, a.shape_a, b.shape_a, a.dtype)
        return ValueInfo(False, int_a=a.int_a, int_b=b.int_a, value_a=a.value_a)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return _tuple((_merge(x, y) for x, y in zip(a, b)), getattr(a, "fields", None))
    return None


class _Recorder(FakeProbe):
    """The fake probe at one batch size, keeping each node's ``ValueInfo``."""

    def __init__(self, gm: fx.GraphModule, batch: int, gbs: int) -> None:
        super().__init__(gm, allow_non_fake_inputs=True)
        self.infos: dict[fx.Node, Any] = {}
        self.batch, self.gbs = batch, gbs

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:  # reported with the node by the caller
            if not self._trusted(n):
                raise ShapePropagationError(n, exc, self.batch, self.gbs) from exc
            result = self._run_for_real(n)
        self.infos[n] = _info(result)
        return result

    def _trusted(self, n: fx.Node) -> bool:
        from .rules import TRUSTED_MODULES

        return n.op == "call_module" and isinstance(self.module.get_submodule(n.target),
                                                    tuple(TRUSTED_MODULES))

    def _run_for_real(self, n: fx.Node) -> Any:
        """A trusted layer fake tensors cannot run (Python branches on values): run it on
        real zeros of the right shapes, then go back to fake tensors."""
        mode = self.mode
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        module = self.module.get_submodule(n.target)
        with unset_fake_temporarily():
            real = pytree.tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype)
                                   if isinstance(v, torch.Tensor) else v, (args, kwargs))
            state = {k: v.detach().clone() for k, v in (*module.named_parameters(),
                                                         *module.named_buffers())}
            with torch.no_grad():
                out = torch.func.functional_call(module, state, tuple(real[0]), real[1])
        return pytree.tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor)
                               else v, out)


@dataclass(frozen=True, eq=False)
class BlockRun:
    """The shape pass's run of a graph cut to two repeated blocks, handed to the cost model.

    ``whole``: the graph; ``blocks``: its chain, as ``find_blocks`` finds it once the shapes
    are written (the pass took the cut because block 1's shapes are block 0's, and it copies
    them to the later blocks); ``cut``: ``whole`` cut to two blocks, its nodes sharing
    ``whole``'s meta; ``probe``: the fake probe that ran it, whose fake mode and fake
    parameters the cost model's probe of the cut shares (``FakeProbe.share``).
    ``holds(gm)`` is the sure sign that the cut is still ``gm``'s: the same graph module,
    node for node the same ops, arguments and modules as when it was cut.
    """

    whole: fx.GraphModule
    blocks: Blocks
    cut: fx.GraphModule
    probe: FakeProbe
    calls: tuple[Any, ...]

    def holds(self, gm: Any) -> bool:
        return gm is self.whole and _same_calls(self.calls, _calls(gm))


def _calls(gm: fx.GraphModule) -> tuple[Any, ...]:
    """What a run of ``gm`` does, node by node, as objects to compare by identity: a node's
    arguments are immutable tuples that a pass replaces, never edits, and the modules and
    attributes it reads are looked up in ``gm`` now."""
    look = operator.attrgetter
    return tuple((n, n.op, n.target, n.args, n.kwargs,
                  look(n.target)(gm) if n.op in ("call_module", "get_attr") else None)
                 for n in gm.graph.nodes)


def _same_calls(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for p, q in zip(a, b) for x, y in zip(p, q))


def propagate_shapes(
    gm: fx.GraphModule, inputs: Sequence[Any], in_dims: Sequence[Any], gbs: int
) -> fx.GraphModule:
    """Annotate ``gm`` in place with ``ValueInfo``s at batch ``gbs`` and ``gbs + 1``.

    ``inputs`` are example values in placeholder order; ``in_dims`` their batch
    dims (an int, or None for unbatched inputs). A graph with a chain of at least
    ``MIN_BLOCKS`` repeated blocks runs cut to two of them (``repeated_blocks``): when the
    second block's values have the first's shapes, every later block's are the same, and
    are copied from the second.
    """
    shapes_and_cut(gm, inputs, in_dims, gbs)
    return gm


def shapes_and_cut(gm: fx.GraphModule, inputs: Sequence[Any], in_dims: Sequence[Any],
                   gbs: int) -> BlockRun | None:
    """``propagate_shapes``, returning the run of ``gm`` cut to two blocks that it made
    (None: it ran ``gm`` whole)."""
    blocks = find_blocks(gm, MIN_BLOCKS)
    if blocks is not None:
        calls = _calls(gm)
        cut = truncate(gm, blocks, 2, share_meta=True)
        infos, probe = _run(cut, inputs, in_dims, gbs, gm)
        first, second = blocks.nodes[0], blocks.nodes[1]
        if all(infos.get(a.name) == infos.get(b.name) for a, b in zip(first, second)):
            for block in blocks.nodes[2:]:
                infos.update({n.name: infos.get(b.name) for n, b in zip(block, second)})
            for node in gm.graph.nodes:
                node.meta[SHAPES] = infos.get(node.name)
            return BlockRun(gm, blocks, cut, probe, calls)
    infos, _ = _run(gm, inputs, in_dims, gbs, gm)
    for node in gm.graph.nodes:
        node.meta[SHAPES] = infos.get(node.name)
    return None


#: Fewer repeated blocks than this are run whole: the cut graph would cost about as much.
MIN_BLOCKS = 4


def _run(gm: fx.GraphModule, inputs: Sequence[Any], in_dims: Sequence[Any], gbs: int,
         whole: fx.GraphModule) -> tuple[dict[str, Any], FakeProbe]:
    """Each node's merged ``ValueInfo`` by name, from fake runs at ``gbs`` and ``gbs + 1``;
    a failure names ``whole``'s node (``gm`` may be its cut). Both runs are one recorder's:
    one fake mode and one fake copy of the parameters (the recorder is returned with them)."""
    runs = []
    recorder = _Recorder(gm, gbs, gbs)
    for batch in (gbs, gbs + 1):
        recorder.batch, recorder.infos = batch, {}
        try:
            recorder.run(*recorder.inputs(inputs, in_dims, batch))
        except ShapePropagationError as exc:
            if gm is not whole:
                exc.node = next(n for n in whole.graph.nodes if n.name == exc.node.name)
            raise
        runs.append({n.name: info for n, info in recorder.infos.items()})
    recorder.infos = {}
    return ({n.name: _merge(runs[0].get(n.name), runs[1].get(n.name)) for n in gm.graph.nodes},
            recorder)
