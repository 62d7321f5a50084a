"""One probe: the captured graph's forward and backward on fake tensors at one microbatch size.

A *probe* runs the graph once under ``FakeTensorMode`` (shapes and dtypes, no data);
the forward is ``passes/fake_probe.py``'s ``FakeProbe``, the interpreter the shape pass
runs too, under ``recorder.py``'s dispatch mode. It records, per ATen op: FLOPs (torch's
``FlopCounterMode`` formulas, plus the CPU flash attention kernels it lacks); bytes read
and written (parameters apart, so that weights re-read every microbatch are visible);
the live activation bytes after the op (parameter gradients apart: static memory); and,
through ``saved_tensors_hooks``, the bytes saved for backward.

A graph with a chain of repeated blocks (transformer layers) is not probed whole: the
``Prober`` probes it cut to one and two blocks, each op tagged with its block, and
``block_probe.py`` stacks them to all N, so a 70B-shaped model costs three blocks' probing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from mbcompile.errors import CostModelError, MbcompileError
from mbcompile.passes.fake_probe import FakeProbe, planned_device
from mbcompile.passes.shape_prop import BlockRun
from mbcompile.planning.recorder import TAG, Recorder, nbytes
from mbcompile.planning.timeline import Timeline

__all__ = ["EXTRA_FLOPS", "Probe", "Prober", "backward_root", "nbytes"]


# --------------------------------------------------------------------------- #
# FLOP formulas torch's counter lacks
# --------------------------------------------------------------------------- #


def _causal(flops: int, is_causal: bool) -> int:
    # Flash kernels skip the blocks above the diagonal: about half the work.
    return flops // 2 if is_causal else flops


def _cpu_flash_fwd(query: Any, key: Any, value: Any, dropout_p: float = 0.0,
                   is_causal: bool = False, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    return _causal(sdpa_flop_count(query, key, value), is_causal)


def _cpu_flash_bwd(grad_out: Any, query: Any, key: Any, value: Any, out: Any, logsumexp: Any,
                   dropout_p: float = 0.0, is_causal: bool = False, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return _causal(sdpa_backward_flop_count(grad_out, query, key, value), is_causal)


EXTRA_FLOPS: dict[Any, Callable[..., int]] = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd)):
    if hasattr(torch.ops.aten, _name):
        EXTRA_FLOPS[getattr(torch.ops.aten, _name)] = _fn


@dataclass(frozen=True)
class Probe:
    """Per-op figures of one fake forward+backward at microbatch size ``m``."""

    m: int
    ops: tuple[str, ...]
    flops: np.ndarray  # per op
    act_bytes: np.ndarray  # bytes of non-parameter tensors read and written
    weight_bytes: np.ndarray  # bytes of parameters read
    fp32: np.ndarray  # bool: charged at the fp32 rate
    kernel: np.ndarray  # bool: does work (not a view or a metadata op)
    backward: np.ndarray  # bool: ran during backward
    live: np.ndarray  # live activation bytes after the op
    saved: float  # bytes saved for backward (activations only)
    outputs: float  # bytes of the graph's non-scalar tensor outputs
    tags: np.ndarray | None = None  # per op: the repeated block it ran for (-1: none)
    #: bytes of the weights' low-precision copies autocast made (its cast cache keeps
    #: them through the step: counted once, as static memory, not as activations)
    casts: float = 0.0
    #: per op: bytes of the parameters' gradients accumulated so far (the probe runs as a
    #: later microbatch, into gradients that exist: see ``first_live``)
    grads: np.ndarray | None = None
    #: per op: transcendental values computed (exp, log, tanh, ...: ``transcendentals.py``)
    transcendental: np.ndarray | None = None
    #: per op: bytes of the first storage it creates, its main output (the allocation that
    #: may get fresh pages: ``SystemSpec.fresh_allocation_bytes``)
    allocated: np.ndarray | None = None
    #: the storages behind ``live`` and ``grads`` (``timeline.py``): a cut graph's probe
    #: keeps it, to derive the probe of fewer blocks (``block_probe.first_block``)
    timeline: Timeline | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        def given(a: np.ndarray | None) -> np.ndarray:
            return a if a is not None else np.zeros_like(self.live)

        return {"flops": self.flops, "act_bytes": self.act_bytes,
                "weight_bytes": self.weight_bytes, "live": self.live,
                "grads": given(self.grads), "transcendental": given(self.transcendental),
                "allocated": given(self.allocated)}

    def first_live(self) -> tuple[float, float]:
        """``(live activations, gradients not made yet)`` at the peak of the step's *first*
        microbatch, whose gradients start as None: autograd hands each new gradient over
        as ``.grad`` instead of adding it into one (``live`` is a later microbatch's, with
        every gradient alive and each new one a temporary until it is added)."""
        if self.grads is None or not len(self.live):
            return float(self.live.max(initial=0.0)), 0.0
        total = float(self.grads.max())  # (a stacked probe's ops are not in run order)
        first = self.live + self.grads
        i = int(np.argmax(first))
        return float(self.live[i]), total - float(self.grads[i])


class _TaggingProbe(FakeProbe):
    """The fake probe, telling the recorder which repeated block each node runs for and
    marking the autograd nodes a node creates with it, so backward ops are told too."""

    def __init__(self, gm: nn.Module, tags: dict[str, int]) -> None:
        super().__init__(gm)
        self.tags = tags
        self.recorder: Recorder | None = None

    def run_node(self, n: Any) -> Any:
        tag = self.tags.get(n.name, -1)
        if self.recorder is not None:
            self.recorder.tag = tag
        out = super().run_node(n)
        todo = [t.grad_fn for t in pytree.tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:  # the new autograd nodes: those not marked yet
            fn = todo.pop()
            if fn is None or TAG in fn.metadata:
                continue
            fn.metadata[TAG] = tag
            todo.extend(f for f, _ in fn.next_functions)
        return out


def backward_root(outputs: Sequence[Any], loss_leaves: tuple[int, ...] | None
                  ) -> torch.Tensor | None:
    """What a probe's (or a timing's) backward starts from: the trained loss the batch
    analysis found (``loss_leaves``, its ``loss_outputs``: the one rule for which output
    is the loss); without an analysis (a body, a module), its scalar outputs, else the sum
    of its trainable outputs."""
    flat = list(outputs)
    if loss_leaves:
        picked = [flat[i] for i in loss_leaves]
    else:
        picked = [o for o in flat if isinstance(o, torch.Tensor) and o.dim() == 0]
    picked = [o for o in picked if isinstance(o, torch.Tensor) and o.requires_grad
              and o.is_floating_point()]
    if not picked:
        picked = [o.sum() for o in flat if isinstance(o, torch.Tensor) and o.requires_grad
                  and o.is_floating_point()]
    if not picked:
        return None
    total = picked[0]
    for o in picked[1:]:
        total = total + o
    return total


class Prober:
    """Probes one graph: the fake probe (one FakeTensorMode, its caches and its fake
    parameters shared by every size) under this module's instrumentation."""

    #: Probe a repeated block once and count it (``block_probe``): tests set it False to
    #: compare with probing the whole graph.
    per_block = True

    def __init__(self, gm: nn.Module, values: Sequence[Any], in_dims: Sequence[int | None],
                 loss_leaves: tuple[int, ...] | None,
                 kept: frozenset[int] | None = None, tags: dict[str, int] | None = None,
                 check_blocks: bool = True, block_run: BlockRun | None = None,
                 shares: FakeProbe | None = None) -> None:
        self.gm = gm
        self.kept = kept  # the outputs a training step keeps (None: all)
        self.values = list(values)
        self.in_dims = list(in_dims)
        self.loss_leaves = loss_leaves
        self.fake_probe = FakeProbe(gm) if tags is None else _TaggingProbe(gm, tags)
        if shares is not None:  # the shape pass's mode and fake parameters (``block_run``)
            self.fake_probe.share(shares)
            self.fake_probe.mode.allow_non_fake_inputs = False  # a probe's own rule
        self.blocks: Any = None  # a BlockProber, when the graph's blocks stack
        if tags is None and self.per_block and type(self).inputs is Prober.inputs:
            from mbcompile.planning.block_probe import BlockProber  # it builds Probers

            self.blocks = BlockProber.of(gm, lambda part, tags, shares=None: Prober(
                part, values, in_dims, loss_leaves, kept, tags, shares=shares),
                check_blocks, block_run)
        self.fake_probe.extra_traceback = False  # CostModelError words the failure itself

    # Made on first use: a graph probed by its blocks never runs whole, so its own fake
    # parameters (a deep model's every layer) would be copied for nothing.
    @functools.cached_property
    def params(self) -> dict[str, torch.Tensor]:
        """The graph's parameters as fake tensors (the probe's mode), by name."""
        return {n: self.fake_probe.fake(p) for n, p in self.gm.named_parameters()}

    @functools.cached_property
    def buffers(self) -> dict[str, torch.Tensor]:
        return {n: self.fake_probe.fake(b) for n, b in self.gm.named_buffers()}

    @functools.cached_property
    def param_storages(self) -> set[int]:
        """The storages of the fake parameters and buffers (not activations)."""
        return ({id(p.untyped_storage()) for p in self.params.values()}
                | {id(b.untyped_storage()) for b in self.buffers.values()})

    def inputs(self, m: int) -> list[Any]:
        """Fake inputs at microbatch size ``m``."""
        return self.fake_probe.inputs(self.values, self.in_dims, m)

    @property
    def device_type(self) -> str:
        """Where the probed graph's tensors live: the device an autocast must name (a
        parameter's fake copy is on its ``planned_device``: read off the parameter, so
        that a graph probed by its blocks makes no fake copy of every layer to ask)."""
        first = next(iter(self.gm.parameters()), None)
        if first is not None:
            return planned_device(first).type
        tensors = [v for v in self.values if isinstance(v, torch.Tensor)]
        return tensors[0].device.type if tensors else "cpu"

    def __call__(self, m: int) -> Probe:
        """The probe of the whole graph at ``m``: one block's figures counted for every
        repeat where the blocks allow it (``block_probe``), else probed whole."""
        if self.blocks is not None:
            stacked = self.blocks(m)
            if stacked is not None:
                return stacked
            self.blocks = None  # the blocks do not stack: probe whole from now on
        return self.probe(m)

    def probe(self, m: int) -> Probe:
        """The probe of the graph at ``m``, run op by op."""
        args = self.inputs(m)
        counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS)
        # The probe runs as a later microbatch: every trainable parameter has a gradient
        # to add into, so the new gradient is a temporary until autograd adds it (the
        # first microbatch's figures follow from the same timeline: Probe.first_live)
        with self.fake_probe.mode:
            for p in self.params.values():
                # (a fake gradient holds no values: empty_like is zeros_like's one op)
                p.grad = torch.empty_like(p) if p.requires_grad else None
        grad_storages = {id(p.grad.untyped_storage()) for p in self.params.values()
                         if p.grad is not None}
        recorder = Recorder(counter, set(self.param_storages), grad_storages)
        if isinstance(self.fake_probe, _TaggingProbe):
            self.fake_probe.recorder = recorder
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            index = recorder.by_id.get(id(t.untyped_storage()))
            if index is not None:
                saved.add(index)
            return t

        try:
            with self.fake_probe.mode, recorder, torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outs = self.fake_probe.run(*args)
                flat = pytree.tree_leaves(outs)
                outputs = float(sum(nbytes(o) for i, o in enumerate(flat)
                                    if isinstance(o, torch.Tensor) and o.dim() > 0
                                    and (self.kept is None or i in self.kept)))
                loss = backward_root(flat, self.loss_leaves)
                if self.kept is not None:  # the step drops what it does not return
                    flat = [o for i, o in enumerate(flat) if i in self.kept]
                    del outs
                    outs = None
                recorder.backward = True
                if loss is not None:
                    loss.backward()
                recorder.end()
                grads = {id(p.grad.untyped_storage()) for p in self.params.values()
                         if p.grad is not None}
                timeline = recorder.timeline(saved, {recorder.by_id[g] for g in grads
                                                     if g in recorder.by_id})
                del outs, flat, loss
        except MbcompileError:
            raise
        except Exception as exc:
            raise CostModelError(
                f"the cost model could not run {type(self.gm).__name__}'s forward and backward "
                f"on fake tensors at microbatch size {m}: {type(exc).__name__}: {exc}. Pass an "
                "int mbs to compile without the cost model, and please report the model"
            ) from exc
        finally:
            for p in self.params.values():
                p.grad = None
        rows = np.array(recorder.rows, dtype=float).reshape(-1, 8)
        return Probe(
            m=m, ops=tuple(recorder.ops), flops=rows[:, 0], act_bytes=rows[:, 1],
            weight_bytes=rows[:, 2], fp32=rows[:, 3].astype(bool),
            kernel=rows[:, 4].astype(bool), backward=rows[:, 5].astype(bool),
            live=timeline.live(~timeline.gradient), saved=timeline.saved_bytes(),
            outputs=outputs, tags=np.array(recorder.tags, dtype=int), casts=recorder.casts,
            grads=timeline.grads(np.ones(len(timeline.added), dtype=bool)),
            transcendental=rows[:, 6], allocated=rows[:, 7], timeline=timeline)
