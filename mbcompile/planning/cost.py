"""Cost model: memory and time of one training step, per micro batch size, from the graph.

Nothing here runs real compute.  A *probe* runs the captured graph's forward and
backward once on fake tensors (``FakeTensorMode``: shapes and dtypes, no data) at
microbatch size ``m``; the forward is ``passes/fake_probe.py``'s ``FakeProbe``, the
interpreter the shape pass runs too, under the dispatch modes here.  It records,
per ATen op:

- FLOPs, from torch's ``FlopCounterMode`` (plus formulas for the CPU flash
  attention kernels it lacks);
- bytes read and written (the op's input and output tensors; parameters apart,
  so that weights re-read every microbatch are visible);
- the live activation bytes after the op (storages created during the probe,
  freed when autograd or Python drops them; parameter gradients apart, they
  are static memory);

and, through ``torch.autograd.graph.saved_tensors_hooks``, the bytes saved for
backward.

**Affine fit.** For the models this project targets every one of those per-op
figures is affine in ``m`` (``a + b*m``): the op sequence does not change with
the batch size, only the batch dim of the shapes.  So :func:`analyse_cost`
probes ``m = 1`` and ``m = 2``, fits ``a`` and ``b`` per op, and *verifies* the fit
against an exact probe at ``m = pbs``: three fake probes, after which every MBS
costs a few vector operations (that is what makes exploring every MBS cheap).
When ``m = 1`` is special (a size-1 dim broadcasts, a reshape copies) the fit is
rebuilt from ``m = 2, pbs``, checked at ``m = 3``, and ``m = 1`` keeps its own probe;
when no fit holds every size is probed exactly.  Peak memory stays exact under
the fit: the peak is the max over ops of affine functions, evaluated at ``m``.

**Memory** (per system; DESIGN.md "Memory and time model")::

    static      = parameters + buffers + gradients + optimizer state
                  (only buffers on device for weight-streaming systems)
    inputs      = the system's share of the batch
    activations = peak live bytes of one microbatch's forward+backward
                = saved for backward + the largest transient on top of them
    outputs     = per-sample outputs (logits) kept for the caller
    peak        = static + inputs + the largest of
                    outputs of the earlier microbatches + activations  (the loop)
                    2 x outputs                  (joining the microbatches' pieces)
                    outputs + 2 x largest parameter   (an Adam-like update)

The outputs and update terms are additions to DESIGN.md's formula: a model that
returns logits keeps ``pbs * seq * vocab`` floats alive whatever the MBS (on a
GPT-sized vocabulary as much as the activations), and for a small model the
optimizer's temporaries can set the peak.

**Time** (per system, the slowest one sets the step)::

    microbatch(m) = microbatch_overhead + kernels x kernel_overhead
                    + max(sum over ops of max(flops / peak, bytes / bandwidth),
                          streamed weight bytes / weight_bandwidth)   # streaming only
                    + gradient accumulation (every microbatch but the first)
    step = max over systems of the sum of its microbatches
           + ring all-reduce: 2 (n-1)/n x gradient bytes / link + 2 (n-1) x latency
           + optimizer update (parameters, gradients and state read and written once)

The roofline is applied per op (a memory-bound LayerNorm next to a
compute-bound matmul), a refinement of DESIGN.md's whole-step roofline; the
per-op ``bytes`` include the parameters each op reads, so weights are re-read
every microbatch.  ``bandwidth`` is the cache's for an op whose inputs and
outputs fit in the system's modelled cache (the host's), else memory's: that
is what makes a too-large microbatch slower per sample on a CPU.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from mbcompile.errors import MbcompileError, PlanError
from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.fake_probe import FakeProbe
from mbcompile.planning.systems import SystemSpec

__all__ = [
    "CostModel",
    "CostModelError",
    "DoesNotFitError",
    "Estimate",
    "MemoryEstimate",
    "MicrobatchFigures",
    "ShardSpec",
    "StaticFigures",
    "TimeEstimate",
    "analyse_cost",
    "format_bytes",
]

#: Relative error under which a fitted figure counts as reproducing an exact probe.
FIT_TOLERANCE = 1e-6


class CostModelError(MbcompileError):
    """The graph could not be run on fake tensors to measure its cost."""


class DoesNotFitError(PlanError):
    """The chosen (or smallest possible) microbatch does not fit the system's memory.

    ``needed`` and ``available`` are bytes; ``mbs`` the size that was checked.
    """

    def __init__(self, message: str, *, mbs: int, needed: float, available: float) -> None:
        super().__init__(message)
        self.mbs, self.needed, self.available = mbs, needed, available


@dataclass(frozen=True)
class ShardSpec:
    """A model sharded with FSDP2 over ``world`` ranks: each unit's full parameter bytes
    (its own, not its sharded children's; the root's first)."""

    world: int
    unit_bytes: tuple[float, ...]
    #: FSDP2's ``reshard_after_forward`` for every unit but the root (which FSDP keeps
    #: gathered from its forward to its backward either way).
    reshard_after_forward: bool = True

    @property
    def gathered(self) -> float:
        """Parameters alive unsharded at the peak: the root, and the largest other unit
        when units are resharded after their forward (one is gathered at a time), or
        every unit when they stay gathered until their backward."""
        root, *others = self.unit_bytes
        return root + (max(others, default=0.0) if self.reshard_after_forward else sum(others))

    def held(self, grads: float, microbatches: int) -> tuple[float, float]:
        """Gradient bytes and gathered bytes alive at one rank's peak, measured on gloo
        ranks (``tests/test_fsdp_memory.py``) and read off FSDP2's code.

        ``grads``: the full gradient bytes. With one microbatch the peak holds one unit's
        gradient shard; with more, FSDP2 accumulates every unit's gradient unsharded
        (full size) until the last backward's reduce-scatter (gradient sync is off in the
        others), less the one unit already reduce-scattered when the peak comes. Gathered:
        the unsharded parameters (``gathered``) and FSDP's flat buffers: the largest unit's
        all-gather output and the flat copy the collective runs through (gloo; one fewer on
        NCCL), and, resharding after forward, the reduce-scatter input kept until the next
        unit's. Resharding after forward, the peak comes early in the last backward (a unit
        gathered, the next one prefetched); keeping units gathered, in the last forward at
        the last unit's all-gather, before any gradient of that microbatch exists.
        """
        root, *others = self.unit_bytes
        largest = max(others, default=0.0)
        if self.reshard_after_forward:
            shard = largest / self.world
            held = min(grads, shard) if microbatches == 1 else max(grads - largest, 0.0) + shard
            return held, self.gathered + 3 * largest
        return (0.0 if microbatches == 1 else grads), self.gathered + 2 * largest

    def gathers_per_microbatch(self) -> tuple[float, int]:
        """Bytes all-gathered and all-gathers per microbatch: every unit in its forward,
        and again in its backward when it was resharded after the forward (not the root)."""
        root, *others = self.unit_bytes
        again = 2 if self.reshard_after_forward else 1
        return root + again * sum(others), 1 + again * len(others)


def format_bytes(n: float) -> str:
    """``1.5 GB``, ``320.0 MB``, ``12.0 kB``, ``7 B`` (decimal units, like the specs)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


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


_EXTRA_FLOPS: dict[Any, Callable[..., int]] = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_fwd),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_bwd)):
    if hasattr(torch.ops.aten, _name):
        _EXTRA_FLOPS[getattr(torch.ops.aten, _name)] = _fn


# --------------------------------------------------------------------------- #
# One probe: forward + backward on fake tensors at one microbatch size
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Probe:
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

    def arrays(self) -> dict[str, np.ndarray]:
        return {"flops": self.flops, "act_bytes": self.act_bytes,
                "weight_bytes": self.weight_bytes, "live": self.live}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recorder(TorchDispatchMode):
    """Records every ATen op's FLOPs, bytes and the live-storage timeline."""

    def __init__(self, counter: FlopCounterMode, param_storages: set[int]) -> None:
        super().__init__()
        self.counter = counter
        self.param_storages = param_storages
        self.backward = False
        self.ops: list[str] = []
        self.rows: list[tuple[float, float, float, bool, bool, bool]] = []
        self.sizes: list[int] = []  # per storage created here
        self.born: list[int] = []  # op index that created it
        self.died: list[int | None] = []  # ops recorded when it was freed
        self.by_id: dict[int, int] = {}  # id(storage) -> index, while alive
        self._refs: list[weakref.ref[Any]] = []

    def _track(self, storage: Any) -> None:
        key = id(storage)
        if key in self.by_id or key in self.param_storages:
            return
        index = len(self.sizes)
        self.by_id[key] = index
        self.sizes.append(storage.nbytes())
        self.born.append(len(self.ops))
        self.died.append(None)

        def freed(_: Any, index: int = index, key: int = key) -> None:
            self.died[index] = len(self.ops)
            if self.by_id.get(key) == index:
                del self.by_id[key]

        self._refs.append(weakref.ref(storage, freed))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "namespace", "aten") != "aten":
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        # torch's FLOP formulas, called here rather than by entering FlopCounterMode: its
        # module tracker hooks every tensor for backward, which keeps activations that
        # activation checkpointing recomputes alive to the end of the step
        formula = self.counter.flop_registry.get(func._overloadpacket)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        ins = {id(t): t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = {id(t): t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        known = len(self.sizes)
        seen_before = {id(t.untyped_storage()) for t in ins.values()}
        for t in outs.values():
            st = t.untyped_storage()
            if id(st) not in seen_before:
                self._track(st)
        allocates = len(self.sizes) > known
        kernel = allocates or bool(func._schema.is_mutable)
        weight = act = 0.0
        if kernel:
            for t in ins.values():
                if id(t.untyped_storage()) in self.param_storages:
                    weight += _nbytes(t)
                else:
                    act += _nbytes(t)
            act += sum(_nbytes(t) for t in outs.values())
        dtypes = [t.dtype for t in (*outs.values(), *ins.values()) if t.is_floating_point()]
        fp32 = not dtypes or dtypes[0] in (torch.float32, torch.float64)
        self.ops.append(str(func))
        self.rows.append((float(flops), act, weight, fp32, kernel, self.backward))
        return out

    def live(self, exclude: set[int]) -> np.ndarray:
        """Live bytes after each op, leaving out the storages in ``exclude``."""
        n = len(self.ops)
        delta = np.zeros(n + 1)
        for i, (size, born, died) in enumerate(zip(self.sizes, self.born, self.died)):
            if i in exclude:
                continue
            # created by op `born` (0-based: the op appended as index born); freed
            # before op `died` ran, so it counts for ops born .. died-1.
            delta[born] += size
            if died is not None:
                delta[died] -= size
        return np.cumsum(delta)[:n]


def _loss_of(outputs: Sequence[Any], loss_leaves: tuple[int, ...] | None) -> torch.Tensor | None:
    """What backward starts from: the model's loss, or the sum of its trainable outputs."""
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


class _Prober:
    """Probes one graph: the fake probe (one FakeTensorMode, its caches and its fake
    parameters shared by every size) under this module's instrumentation."""

    def __init__(self, gm: nn.Module, values: Sequence[Any], in_dims: Sequence[int | None],
                 loss_leaves: tuple[int, ...] | None,
                 kept: frozenset[int] | None = None) -> None:
        self.gm = gm
        self.kept = kept  # the outputs a training step keeps (None: all)
        self.values = list(values)
        self.in_dims = list(in_dims)
        self.loss_leaves = loss_leaves
        self.fake_probe = FakeProbe(gm)
        self.fake_probe.extra_traceback = False  # CostModelError words the failure itself
        self.params = {n: self.fake_probe.fake(p) for n, p in gm.named_parameters()}
        self.buffers = {n: self.fake_probe.fake(b) for n, b in gm.named_buffers()}
        self.param_storages = {id(p.untyped_storage()) for p in self.params.values()}
        self.param_storages |= {id(b.untyped_storage()) for b in self.buffers.values()}

    def inputs(self, m: int) -> list[Any]:
        """Fake inputs at microbatch size ``m``."""
        return self.fake_probe.inputs(self.values, self.in_dims, m)

    def __call__(self, m: int) -> _Probe:
        args = self.inputs(m)
        counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS)
        recorder = _Recorder(counter, set(self.param_storages))
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            index = recorder.by_id.get(id(t.untyped_storage()))
            if index is not None:
                saved.add(index)
            return t

        for p in self.params.values():
            p.grad = None
        try:
            with self.fake_probe.mode, recorder, torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                outs = self.fake_probe.run(*args)
                flat = pytree.tree_leaves(outs)
                outputs = float(sum(_nbytes(o) for i, o in enumerate(flat)
                                    if isinstance(o, torch.Tensor) and o.dim() > 0
                                    and (self.kept is None or i in self.kept)))
                loss = _loss_of(flat, self.loss_leaves)
                recorder.backward = True
                if loss is not None:
                    loss.backward()
                grads = {id(p.grad.untyped_storage()) for p in self.params.values()
                         if p.grad is not None}
                exclude = {recorder.by_id[g] for g in grads if g in recorder.by_id}
                saved_bytes = float(sum(recorder.sizes[i] for i in saved))
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
        rows = np.array(recorder.rows, dtype=float).reshape(-1, 6)
        return _Probe(
            m=m, ops=tuple(recorder.ops), flops=rows[:, 0], act_bytes=rows[:, 1],
            weight_bytes=rows[:, 2], fp32=rows[:, 3].astype(bool),
            kernel=rows[:, 4].astype(bool), backward=rows[:, 5].astype(bool),
            live=recorder.live(exclude), saved=saved_bytes, outputs=outputs)


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class StaticFigures:
    """What does not depend on the microbatch size."""

    param_bytes: float
    trainable_bytes: float  # = gradient bytes
    num_params: int
    num_trainable: int
    num_param_tensors: int
    largest_param_bytes: float  # the largest trainable tensor
    buffer_bytes: float
    input_bytes_per_sample: float
    input_bytes_fixed: float  # unbatched tensor inputs
    output_bytes_per_sample: float  # per-sample outputs the caller gets back
    fused: bool  # one scalar loss: backward runs per microbatch
    training: bool  # some parameter requires grad


@dataclass(frozen=True)
class MicrobatchFigures:
    """One microbatch's forward+backward at size ``m``."""

    m: int
    flops_forward: float
    flops_backward: float
    activation_bytes_moved: float  # read + written, parameters apart
    weight_bytes_read: float
    saved_bytes: float  # activations saved for backward
    activation_peak_bytes: float  # peak live activations (saved + transient)
    kernels: int
    exact: bool  # True: a probe at this size; False: the verified affine fit

    @property
    def flops(self) -> float:
        return self.flops_forward + self.flops_backward

    @property
    def transient_bytes(self) -> float:
        """The largest excess of live activations over the saved ones."""
        return max(0.0, self.activation_peak_bytes - self.saved_bytes)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one system (the largest), broken down; bytes.

    ``params + buffers + grads + optimizer + inputs + outputs + activations +
    update + frontier + coupled + gathered == peak``: what is alive at the peak
    moment (frontier and coupled in a two-phase step only, gathered for an FSDP2 model,
    whose params, grads and optimizer are then one rank's shards), which
    ``phase`` names ("microbatch loop", "joining outputs" or "optimizer update").
    ``saved`` and ``transient`` split the microbatch's activation peak whatever
    the phase.
    """

    params: float
    buffers: float
    grads: float
    optimizer: float
    inputs: float
    outputs: float
    activations: float
    update: float
    saved: float
    transient: float
    peak: float
    capacity: float
    phase: str
    frontier: float = 0.0  # two-phase: the frontier F and dL/dF for the whole batch
    coupled: float = 0.0  # two-phase: the coupled part's activations at the whole batch
    gathered: float = 0.0  # FSDP2: parameters gathered at the peak, and FSDP's flat buffers

    @property
    def static(self) -> float:
        return self.params + self.buffers + self.grads + self.optimizer

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    @property
    def headroom(self) -> float:
        return self.capacity - self.peak

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(static=self.static, fits=self.fits, headroom=self.headroom)
        return d


@dataclass(frozen=True)
class TimeEstimate:
    """Modelled step time, broken down; seconds."""

    microbatch: float  # the largest microbatch, overheads included
    compute: float  # roofline part, summed over the slowest system's microbatches
    overhead: float  # microbatch and kernel overheads, summed
    accumulate: float  # gradient accumulation between microbatches
    allreduce: float
    optimizer: float
    step: float
    samples_per_second: float
    bound: str  # what dominates: "compute", "memory", "overhead", "weight streaming"
    extra_forward: float = 0.0  # two-phase: the per-sample part's forward without grad
    allgather: float = 0.0  # FSDP2: units all-gathered in every microbatch (ShardSpec)
    coupled: float = 0.0  # two-phase: the coupled part, once, on the whole batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one (plan, system)."""

    system: str
    mbs: int
    num_microbatches: int
    memory: MemoryEstimate
    time: TimeEstimate
    figures: MicrobatchFigures

    def to_dict(self) -> dict[str, Any]:
        return {"system": self.system, "mbs": self.mbs,
                "num_microbatches": self.num_microbatches,
                "memory": self.memory.to_dict(), "time": self.time.to_dict(),
                "figures": {**asdict(self.figures), "flops": self.figures.flops,
                            "transient_bytes": self.figures.transient_bytes}}


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #


@dataclass
class _Fit:
    base: _Probe  # non-batch-dependent arrays (fp32, kernel, backward) come from here
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    saved: tuple[float, float]
    outputs: tuple[float, float]

    def at(self, m: int) -> _Probe:
        arrays = {k: self.a[k] + self.b[k] * m for k in self.a}
        return _Probe(m=m, ops=self.base.ops, fp32=self.base.fp32, kernel=self.base.kernel,
                      backward=self.base.backward, saved=self.saved[0] + self.saved[1] * m,
                      outputs=self.outputs[0] + self.outputs[1] * m, **arrays)


def _fit(p: _Probe, q: _Probe) -> _Fit | None:
    if p.ops != q.ops or len(p.live) != len(q.live):
        return None
    dm = q.m - p.m
    a, b = {}, {}
    for k, x in p.arrays().items():
        y = q.arrays()[k]
        b[k] = (y - x) / dm
        a[k] = x - b[k] * p.m
    saved_b = (q.saved - p.saved) / dm
    out_b = (q.outputs - p.outputs) / dm
    return _Fit(p, a, b, (p.saved - saved_b * p.m, saved_b), (p.outputs - out_b * p.m, out_b))


def _close(x: float | np.ndarray, y: float | np.ndarray) -> bool:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    scale = np.maximum(np.maximum(np.abs(x), np.abs(y)), 1.0)
    return bool(np.all(np.abs(x - y) <= FIT_TOLERANCE * scale))


def _reproduces(fit: _Fit, exact: _Probe) -> bool:
    got = fit.at(exact.m)
    if got.ops != exact.ops or len(got.live) != len(exact.live):
        return False
    return (all(_close(got.arrays()[k], exact.arrays()[k]) for k in exact.arrays())
            and _close(got.saved, exact.saved) and _close(got.outputs, exact.outputs))


def _split_counts(size: int, k: int) -> list[tuple[int, int]]:
    """``(microbatch size, how many)`` for ``size`` samples over ``k`` microbatches."""
    q, r = divmod(size, k)
    return [(s, c) for s, c in ((q + 1, r), (q, k - r)) if s > 0 and c > 0]


class CostModel:
    """Per-MBS figures of one captured graph, and memory/time estimates for a system.

    Build it with :func:`analyse_cost`.  ``figures(m)`` answers from the verified
    affine fit where it holds, from an exact (cached) probe otherwise;
    ``estimate(gbs, num_csx, mbs, spec)`` applies the module docstring's formulas.
    """

    def __init__(self, prober: Callable[[int], _Probe] | None, static: StaticFigures,
                 name: str = "model") -> None:
        self._prober = prober
        self.static = static
        self.name = name
        self._exact: dict[int, _Probe] = {}
        self._fit: _Fit | None = None
        self._fit_from = 1  # smallest size the fit serves
        self.fit_note = "not built: every size is probed exactly"
        self.probes_run = 0
        self.shard: ShardSpec | None = None  # FSDP2: parameters sharded over ranks

    # ------------------------------------------------------------- probes
    def probe(self, m: int) -> _Probe:
        """The exact probe at ``m`` (run once, then cached)."""
        if m not in self._exact:
            if self._prober is None:
                raise CostModelError(
                    f"this cost model was copied or unpickled without its graph, so it cannot "
                    f"probe microbatch size {m}; its fit and earlier probes still answer. "
                    "Compile again for a new configuration")
            self._exact[m] = self._prober(m)
            self.probes_run += 1
        return self._exact[m]

    def __getstate__(self) -> dict[str, Any]:
        # Fake tensors and the graph stay behind: a copy answers from the fit and
        # the probes already run (what a compiled module's report needs).
        state = dict(self.__dict__)
        state["_prober"] = None
        return state

    def build_fit(self, pbs: int) -> bool:
        """Fit every per-op figure as ``a + b*m`` and verify it; True if a fit holds.

        Fits at ``m = 1, 2`` and checks the exact probe at ``m = pbs``.  When that
        fails (size-1 dims broadcast, or a reshape copies at one size and not at
        another) it refits at ``m = 2, pbs``, checks at ``m = 3`` and serves
        ``m = 1`` from its own exact probe.  When that fails too, every size is
        probed exactly.  Common case: 3 probes.
        """
        if pbs <= 2:
            for m in range(1, pbs + 1):
                self.probe(m)
            self._fit, self.fit_note = None, f"pbs {pbs}: every size probed exactly"
            self._set_outputs()
            return False
        fit = _fit(self.probe(1), self.probe(2))
        if fit is not None and _reproduces(fit, self.probe(pbs)):
            self._fit, self._fit_from = fit, 1
            self.fit_note = (f"affine in m: fitted at m=1,2, reproduces the exact probe at "
                             f"m={pbs} to {FIT_TOLERANCE:g}")
        else:
            fit = _fit(self.probe(2), self.probe(pbs))
            check = 3 if pbs > 3 else None
            if fit is not None and (check is None or _reproduces(fit, self.probe(check))):
                self._fit, self._fit_from = fit, 2
                self.fit_note = (f"affine in m from m=2: fitted at m=2,{pbs}"
                                 + (f", reproduces the exact probe at m={check}" if check else "")
                                 + "; m=1 differs and uses its own exact probe")
            else:
                self._fit = None
                self.fit_note = ("not affine in m (the op sequence or the figures change with "
                                 "the batch size): every size is probed exactly")
        self._set_outputs()
        return self._fit is not None

    def _set_outputs(self) -> None:
        # Per-sample outputs (logits) are the slope of the output bytes in m.
        sizes = sorted(self._exact)
        if self._fit is not None:
            slope = self._fit.outputs[1]
        elif len(sizes) >= 2:
            p, q = self._exact[sizes[-2]], self._exact[sizes[-1]]
            slope = (q.outputs - p.outputs) / (q.m - p.m)
        else:
            p = self._exact[sizes[0]]
            slope = p.outputs / p.m
        self.static = _replace_static(self.static, output_bytes_per_sample=max(0.0, slope))

    @property
    def fitted(self) -> bool:
        return self._fit is not None

    def verify_fit(self, sizes: Sequence[int]) -> dict[int, bool]:
        """Whether the fit reproduces a fresh exact probe at each size (not cached).

        For tests and benchmarks: this is the check ``build_fit`` runs at ``pbs``,
        at any sizes you like.
        """
        if self._fit is None or self._prober is None:
            return {m: False for m in sizes}
        return {m: _reproduces(self._fit, self._prober(m)) for m in sizes}

    def _at(self, m: int) -> tuple[_Probe, bool]:
        if m in self._exact:
            return self._exact[m], True
        if self._fit is not None and m >= self._fit_from:
            return self._fit.at(m), False
        return self.probe(m), True

    # ------------------------------------------------------------ figures
    def figures(self, m: int) -> MicrobatchFigures:
        p, exact = self._at(m)
        fwd = ~p.backward
        return MicrobatchFigures(
            m=m, flops_forward=float(p.flops[fwd].sum()),
            flops_backward=float(p.flops[p.backward].sum()),
            activation_bytes_moved=float(p.act_bytes.sum()),
            weight_bytes_read=float(p.weight_bytes.sum()),
            saved_bytes=float(p.saved),
            activation_peak_bytes=float(p.live.max(initial=0.0)),
            kernels=int(p.kernel.sum()), exact=exact)

    # --------------------------------------------------------------- time
    def microbatch_seconds(self, m: int, spec: SystemSpec) -> tuple[float, float, float, str]:
        """``(total, roofline, overhead, bound)`` of one microbatch of ``m`` samples."""
        return self.probe_seconds(self._at(m)[0], spec)

    def probe_seconds(self, p: _Probe, spec: SystemSpec) -> tuple[float, float, float, str]:
        """``(total, roofline, overhead, bound)`` of what probe ``p`` ran."""
        peak = np.where(p.fp32, spec.peak_flops_fp32, spec.peak_flops)
        moved = p.act_bytes if spec.weight_streaming else p.act_bytes + p.weight_bytes
        compute = p.flops / peak
        bandwidth = np.full_like(moved, spec.memory_bandwidth)
        if spec.cache_bytes > 0 and spec.cache_bandwidth:
            # an op whose inputs and outputs all fit in the cache moves them at its rate
            bandwidth[p.act_bytes + p.weight_bytes <= spec.cache_bytes] = spec.cache_bandwidth
        memory = moved / bandwidth
        roof = float(np.maximum(compute, memory).sum())
        stream = 0.0
        if spec.weight_bandwidth is not None:
            s = self.static
            # weights in for forward and again for backward, gradients out
            stream = (2 * s.param_bytes + s.trainable_bytes) / spec.weight_bandwidth
        overhead = spec.microbatch_overhead_s + int(p.kernel.sum()) * spec.kernel_overhead_s
        body = max(roof, stream)
        if stream > roof:
            bound = "weight streaming"
        elif overhead > body:
            bound = "overhead"
        else:
            bound = "compute" if compute.sum() >= memory.sum() else "memory"
        return body + overhead, body, overhead, bound

    def _accumulate_seconds(self, spec: SystemSpec) -> float:
        if spec.weight_streaming or not self.static.training:
            return 0.0
        s = self.static
        return 3 * s.trainable_bytes / spec.memory_bandwidth + \
            s.num_param_tensors * spec.kernel_overhead_s

    def allreduce_seconds(self, num_csx: int, spec: SystemSpec) -> float:
        if num_csx <= 1 or not self.static.training:
            return 0.0
        n = num_csx
        return (2 * (n - 1) / n * self.static.trainable_bytes / spec.interconnect_bandwidth
                + 2 * (n - 1) * spec.interconnect_latency_s)

    def optimizer_seconds(self, spec: SystemSpec) -> float:
        if spec.weight_streaming or not self.static.training:
            return 0.0  # streamed systems update off-chip, overlapped
        s = self.static
        state = spec.optimizer_bytes_per_param * s.num_trainable
        return (2 * s.trainable_bytes + s.trainable_bytes + 2 * state) / spec.memory_bandwidth

    # ------------------------------------------------------------- memory
    def memory(self, pbs: int, mbs: int, num_microbatches: int, spec: SystemSpec
               ) -> MemoryEstimate:
        """Peak memory of a system running ``pbs`` samples in microbatches of ``mbs``."""
        s = self.static
        f = self.figures(mbs)
        on_device = not spec.weight_streaming
        trained = on_device and s.training
        params = s.param_bytes if on_device else 0.0
        grads = s.trainable_bytes if trained else 0.0
        optimizer = spec.optimizer_bytes_per_param * s.num_trainable if trained else 0.0
        gathered = 0.0
        if self.shard is not None and on_device:  # one rank's shards, units gathered
            w = self.shard.world
            params, optimizer = params / w, optimizer / w
            grads, gathered = self.shard.held(grads, num_microbatches)
        static = params + s.buffer_bytes + grads + optimizer
        inputs = s.input_bytes_fixed + s.input_bytes_per_sample * pbs
        saved, act = f.saved_bytes, f.activation_peak_bytes
        if not s.fused and s.training and num_microbatches > 1:
            # no single loss: autograd keeps every microbatch's saved activations
            kept = self.figures(pbs).saved_bytes - saved
            saved, act = saved + kept, act + kept
        out_all = s.output_bytes_per_sample * pbs
        # (phase, outputs, activations, update temporaries) alive at each candidate peak
        phases = [("microbatch loop", s.output_bytes_per_sample * (pbs - mbs), act, 0.0)]
        if num_microbatches > 1:  # the pieces and their concatenation, briefly
            phases.append(("joining outputs", 2 * out_all, 0.0, 0.0))
        if trained and spec.optimizer_bytes_per_param > 0:
            # An Adam-like update makes two temporaries the size of the parameter it
            # updates (sqrt of the second moment, then the step); torch's for-loop
            # implementation does it one tensor at a time.  (foreach implementations
            # batch all parameters and need up to twice the gradient bytes.)
            phases.append(("optimizer update", out_all, 0.0, 2 * s.largest_param_bytes))
        phase, outputs, activations, update = max(phases, key=lambda p: p[1] + p[2] + p[3])
        return MemoryEstimate(
            params=params, buffers=s.buffer_bytes, grads=grads, optimizer=optimizer,
            inputs=inputs, outputs=outputs, activations=activations, update=update,
            saved=saved, transient=max(0.0, act - saved),
            peak=static + inputs + outputs + activations + update + gathered,
            capacity=spec.memory_bytes, phase=phase, gathered=gathered)

    # ----------------------------------------------------------- estimate
    def estimate(self, gbs: int, num_csx: int, mbs: int, spec: SystemSpec) -> Estimate:
        """Memory and step time of the plan ``(gbs, num_csx, mbs)`` on ``spec``."""
        q, r = divmod(gbs, num_csx)
        systems = [(q + 1, r), (q, num_csx - r)]
        pbs = q + (1 if r else 0)
        k = -(-pbs // mbs)
        accumulate = self._accumulate_seconds(spec)
        worst = (0.0, 0.0, 0.0, 0.0)
        bound_votes: dict[str, float] = {}
        for size, count in systems:
            if size <= 0 or count <= 0:
                continue
            total = roof = over = 0.0
            nonempty = 0
            for m, c in _split_counts(size, k):
                t, body, o, bound = self.microbatch_seconds(m, spec)
                total += c * t
                roof += c * body
                over += c * o
                nonempty += c
                bound_votes[bound] = bound_votes.get(bound, 0.0) + c * t
            acc = max(0, nonempty - 1) * accumulate
            if total + acc > worst[0]:
                worst = (total + acc, roof, over, acc)
        allreduce = self.allreduce_seconds(num_csx, spec)
        optimizer = self.optimizer_seconds(spec)
        allgather = 0.0
        if self.shard is not None and self.shard.world > 1:
            w = self.shard.world
            # gradients are reduce-scattered, half a ring all-reduce; units are gathered
            # in every microbatch (``ShardSpec.gathers_per_microbatch``)
            allreduce /= 2
            optimizer /= w
            gathered, gathers = self.shard.gathers_per_microbatch()
            allgather = k * ((w - 1) / w * gathered / spec.interconnect_bandwidth
                             + gathers * spec.interconnect_latency_s)
        step = worst[0] + allreduce + optimizer + allgather
        first = self.microbatch_seconds(mbs, spec)[0]
        bound = max(bound_votes, key=bound_votes.get) if bound_votes else "compute"
        time = TimeEstimate(
            microbatch=first, compute=worst[1], overhead=worst[2], accumulate=worst[3],
            allreduce=allreduce, optimizer=optimizer, step=step,
            samples_per_second=gbs / step if step > 0 else math.inf, bound=bound,
            allgather=allgather)
        return Estimate(spec.name, mbs, k, self.memory(pbs, mbs, k, spec), time,
                        self.figures(mbs))

    def describe(self) -> str:
        s = self.static
        return (f"{self.name}: {s.num_params:,} parameters ({format_bytes(s.param_bytes)}), "
                f"{'one loss, backward per microbatch' if s.fused else 'no single loss'}; "
                f"{self.fit_note}; {self.probes_run} fake probes")


# --------------------------------------------------------------------------- #
# Building one
# --------------------------------------------------------------------------- #


def _input_bytes(values: Sequence[Any], in_dims: Sequence[int | None]) -> tuple[float, float]:
    per_sample = fixed = 0.0
    for value, d in zip(values, in_dims):
        for t in pytree.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            if d is None:
                fixed += _nbytes(t)
            elif t.shape[d] > 0:
                per_sample += _nbytes(t) / t.shape[d]
    return per_sample, fixed


def static_figures(gm: nn.Module, values: Sequence[Any], in_dims: Sequence[int | None],
                   fused: bool) -> StaticFigures:
    """What does not depend on the microbatch size: parameters, buffers, input bytes."""
    seen: set[int] = set()
    param_bytes = trainable = largest = 0.0
    n_params = n_train = n_tensors = 0
    for p in gm.parameters():  # parameters() already skips tied duplicates
        if id(p) in seen:
            continue
        seen.add(id(p))
        n_tensors += 1
        param_bytes += _nbytes(p)
        n_params += p.numel()
        if p.requires_grad:
            trainable += _nbytes(p)
            n_train += p.numel()
            largest = max(largest, float(_nbytes(p)))
    per_sample, fixed = _input_bytes(values, in_dims)
    static = StaticFigures(
        param_bytes=param_bytes, trainable_bytes=trainable, num_params=n_params,
        num_trainable=n_train, num_param_tensors=n_tensors, largest_param_bytes=largest,
        buffer_bytes=float(sum(_nbytes(b) for b in gm.buffers())),
        input_bytes_per_sample=per_sample, input_bytes_fixed=fixed,
        output_bytes_per_sample=0.0, fused=fused, training=n_train > 0)
    return static


def analyse_cost(gm: nn.Module | BatchAnalysis, values: Sequence[Any],
                 in_dims: Sequence[int | None], *, pbs: int | None = None,
                 name: str | None = None, fit: bool = True,
                 kept_outputs: frozenset[int] | None = None) -> CostModel:
    """Build the cost model of ``gm``: best the batch analysis of the captured graph
    (it says which outputs are trained losses and whether backward runs per
    microbatch), or any module (assumed to return one scalar loss first).

    ``values`` are example inputs in ``forward``'s order (any batch size; only
    their shapes and dtypes are used) and ``in_dims`` their batch dims.  Runs the
    fake probes and the fit check for per-system batch size ``pbs`` (default 4;
    see :meth:`CostModel.build_fit`): three probes in the common case.  With
    ``fit=False`` it probes ``m = pbs`` only: for a plan that runs the whole
    per-system batch as one microbatch (a graph the batch analysis rejected,
    run unsplit), where smaller sizes may not even run. ``kept_outputs``: the output
    leaves a training step returns (``compile(outputs=...)``); the others are not counted
    as kept across microbatches.

    >>> model, batch = make_mlp(8)
    >>> cost = analyse_cost(model, batch, (0, 0), pbs=8)
    >>> cost.figures(4).flops == 4 * cost.figures(1).flops
    True
    """
    if isinstance(gm, BatchAnalysis) and gm.rejected is None:
        loss_leaves, fused = gm.loss_outputs or None, gm.fused
        gm = gm.graph_module
    else:  # a module, or a graph run unsplit: one microbatch, whatever its losses
        gm = gm.graph_module if isinstance(gm, BatchAnalysis) else gm
        loss_leaves, fused = None, True
    static = static_figures(gm, values, in_dims, fused)
    model = CostModel(_Prober(gm, values, in_dims, loss_leaves, kept_outputs), static,
                      name or getattr(gm, "_mbcompile_name", None) or type(gm).__name__)
    if fit:
        model.build_fit(4 if pbs is None else pbs)
    else:
        model.probe(4 if pbs is None else pbs)
        model.fit_note = "one microbatch of the whole per-system batch: probed at that size only"
        model._set_outputs()
    return model


def _replace_static(s: StaticFigures, **changes: Any) -> StaticFigures:
    return StaticFigures(**{**asdict(s), **changes})
