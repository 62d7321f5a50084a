"""What the cost model answers: per-MBS figures, memory and time estimates.

The vocabulary shared by the probe (``probe.py``), the fit (``fit.py``), the model
(``cost.py``) and the MBS search (``search.py``); see ``cost.py`` for the formulas; its
errors are ``mbcompile.errors``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Estimate", "MemoryEstimate", "MicrobatchFigures", "ShardSpec", "StaticFigures",
           "TimeEstimate", "format_bytes", "format_seconds"]


@dataclass(frozen=True)
class ShardSpec:
    """A model sharded with FSDP2 over ``world`` ranks: each unit's full parameter bytes
    (its own, not its sharded children's; the root's first)."""

    world: int
    unit_bytes: tuple[float, ...]
    #: FSDP2's ``reshard_after_forward`` for every unit but the root (which FSDP keeps
    #: gathered from its forward to its backward either way).
    reshard_after_forward: bool = True
    #: Gradients reduce-scattered in every microbatch's backward (``"microbatch"``: they
    #: stay sharded while they accumulate) or only in the step's last (``"step"``: one
    #: round per step, every gradient held unsharded until then).
    gradient_sync: str = "step"

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

        With ``gradient_sync="microbatch"`` every backward reduce-scatters, so what the
        earlier microbatches accumulated is one shard of every gradient (``grads /
        world``) at either peak, plus, resharding after forward, the unit's new shard
        being added to it.
        """
        root, *others = self.unit_bytes
        largest = max(others, default=0.0)
        shard = largest / self.world
        if microbatches > 1 and self.gradient_sync == "microbatch":
            sharded = grads / self.world
            if self.reshard_after_forward:
                return sharded + shard, self.gathered + 3 * largest
            return sharded, self.gathered + 2 * largest
        if self.reshard_after_forward:
            held = min(grads, shard) if microbatches == 1 else max(grads - largest, 0.0) + shard
            return held, self.gathered + 3 * largest
        return (0.0 if microbatches == 1 else grads), self.gathered + 2 * largest

    def reduce_scatters(self, microbatches: int) -> int:
        """Rounds of gradient reduce-scatters per step: one, or one per microbatch."""
        return microbatches if self.gradient_sync == "microbatch" else 1

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
    #: the step's first microbatch (its gradients start as None): live activations at its
    #: peak, and the gradient bytes not made yet at that moment (Probe.first_live)
    first_peak_bytes: float = 0.0
    first_grads_pending: float = 0.0

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
    update + frontier + coupled + gathered + casts == peak``: what is alive at the peak
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
    casts: float = 0.0  # autocast's low-precision copies of the weights, alive through a step
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
    allreduce: float  # the gradient all-reduce on the links it crosses, whole
    optimizer: float
    step: float
    samples_per_second: float
    bound: str  # what dominates: "compute", "memory", "overhead", "weight streaming"
    extra_forward: float = 0.0  # two-phase: the per-sample part's forward without grad
    allgather: float = 0.0  # FSDP2: units all-gathered in every microbatch (ShardSpec)
    coupled: float = 0.0  # two-phase: the coupled part, once, on the whole batch
    allreduce_hidden: float = 0.0  # of ``allreduce``, what overlaps the last backward
    join: float = 0.0  # joining the microbatches' kept outputs into the step's

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
