"""What would fit: the fixes a ``DoesNotFitError`` names, each one computed, none that
cannot help.

One place computes them for both checks that can fail on memory: the static check run
before any tracing (``static_memory.py``: parameters, gradients and optimizer state alone
exceed the system) and the MBS selection (``explore.py``: the smallest microbatch does not
fit). Each fix is a number that was worked out, not a hint:

- the smallest FSDP2 world that holds static memory (sharding divides parameters,
  gradients and optimizer state by the ranks; gradients accumulated over several
  microbatches stay unsharded, ``ShardSpec.held``, so that world is given for one
  microbatch per rank and, when one exists, for accumulation too);
- a smaller optimizer state (``compile(optimizer="sgd-momentum")``: one buffer in the
  parameter's dtype; ``"sgd"``: none), named only when static memory then fits;
- a system with more memory, with the figure it needs.

More systems (``num_csx``) are never named for static memory: each system holds a
replica, so they shrink the per-system batch, not the model. ``explore.py`` adds the
fixes that depend on the batch (a smaller MBS, ``outputs="loss"``, more systems when the
per-system batch is what does not fit), each checked with the cost model.

>>> s = StaticMemory(params=40e9, buffers=0.0, grads=40e9, optimizer=80e9)
>>> smallest_fsdp_world(s, capacity=79e9)
3
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import torch.nn as nn

from mbcompile.errors import CostModelError, DoesNotFitError
from mbcompile.planning.bisection import first_true
from mbcompile.planning.cost import CostModel
from mbcompile.planning.cost_analysis import static_figures
from mbcompile.planning.estimates import MemoryEstimate, format_bytes
from mbcompile.planning.plan import per_system_batch_sizes
from mbcompile.planning.systems import SystemSpec

__all__ = ["StaticMemory", "describe_capacity", "describe_memory", "describe_static",
           "optimizer_source", "smallest_fsdp_world", "static_does_not_fit", "static_fixes",
           "static_memory_of", "step_fixes", "with_recompute_fix", "with_recompute_tried"]

#: The largest FSDP world a fix names: beyond it, say that sharding does not help.
MAX_WORLD = 4096


@dataclass(frozen=True)
class StaticMemory:
    """What one replica holds whatever the MBS; bytes. ``grads`` are the trainable
    parameters' bytes (one gradient each); ``optimizer`` the optimizer's state."""

    params: float
    buffers: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.buffers + self.grads + self.optimizer

    def sharded(self, world: int, accumulating: bool = False) -> float:
        """One FSDP2 rank's share over ``world`` ranks; ``accumulating``: several
        microbatches with ``gradient_sync="step"``, so FSDP2 holds every gradient
        unsharded until the last backward (``"microbatch"`` keeps them sharded)."""
        grads = self.grads if accumulating else self.grads / world
        return (self.params + self.optimizer) / world + grads + self.buffers


def static_memory_of(model: nn.Module, spec: SystemSpec) -> StaticMemory:
    """``model``'s static memory on ``spec`` (its ``optimizer_bytes_per_param``), counted
    from shapes and dtypes only: a meta or fake model costs nothing. Tied parameters count
    once; a weight-streaming system holds only the buffers."""
    s = static_figures(model, (), (), fused=False)  # the cost model's count, inputs apart
    if spec.weight_streaming:
        return StaticMemory(0.0, s.buffer_bytes, 0.0, 0.0)
    return StaticMemory(s.param_bytes, s.buffer_bytes, s.trainable_bytes,
                        spec.optimizer_bytes_per_param * s.num_trainable)


def smallest_fsdp_world(static: StaticMemory, capacity: float, *, other: float = 0.0,
                        accumulating: bool = False) -> int | None:
    """The fewest FSDP2 ranks whose share of ``static`` plus ``other`` (what sharding does
    not shrink: activations, inputs, gathered units) fits ``capacity``; None when no world
    up to ``MAX_WORLD`` does."""
    fixed = static.buffers + other + (static.grads if accumulating else 0.0)
    shardable = static.params + static.optimizer + (0.0 if accumulating else static.grads)
    room = capacity - fixed
    if room <= 0:
        return None
    world = max(1, math.ceil(shardable / room))
    while world <= MAX_WORLD and static.sharded(world, accumulating) + other > capacity:
        world += 1  # rounding: the share at the ceiling may still be a hair too large
    return world if world <= MAX_WORLD else None


def static_fixes(static: StaticMemory, spec: SystemSpec, *, world: int = 1,
                 other: float = 0.0, alternatives: dict[str, float] | None = None
                 ) -> list[str]:
    """The fixes for static memory that does not fit ``spec`` (``world``: the FSDP2 ranks
    it is already sharded over, 1 for a replica; ``other``: bytes besides static memory
    that must fit too), in the order a user would try them.

    ``alternatives``: optimizer state bytes by ``compile(optimizer=...)`` name, when the
    caller knows them exactly (``optimizer_state.alternatives``); otherwise the exact
    figures of torch's SGD are used (a momentum buffer in each parameter's dtype, or none).
    """
    capacity = spec.usable_bytes
    fixes: list[str] = []
    one = smallest_fsdp_world(static, capacity, other=other)
    if one is not None and one > world:
        many = smallest_fsdp_world(static, capacity, other=other, accumulating=True)
        share = static.sharded(one)
        how = ("shard parameters, gradients and optimizer state with FSDP2" if world == 1
               else f"shard over more ranks than the present {world}:")
        text = (f"{how} over at least "
                f"{one} ranks (fully_shard each block, then compile with "
                f"backend='torch.distributed' on {one} ranks, num_csx={one}): "
                f"{format_bytes(share)} of static memory per rank with one microbatch per rank")
        if many != one:  # FSDP2 holds the gradients unsharded unless it syncs each time
            text += (" (to accumulate over several microbatches on these ranks: "
                     "gradient_sync='microbatch', which 'auto' picks when it must, "
                     "reduce-scatters every microbatch's gradients so they stay sharded; "
                     f"gradient_sync='step' holds them unsharded, {format_bytes(static.grads)}, "
                     + ("which no world fits" if many is None else f"needing {many} ranks")
                     + ")")
        fixes.append(text)
    fixes += _optimizer_fixes(static, capacity, world, other, alternatives)
    need = static.sharded(world) + other if world > 1 else static.total + other
    fixes.append(f"a system with at least {format_bytes(need + spec.reserved_bytes)} of "
                 f"memory ({format_bytes(need)} usable), via system=SystemSpec(...)")
    return fixes


def _optimizer_fixes(static: StaticMemory, capacity: float, world: int, other: float,
                     alternatives: dict[str, float] | None) -> list[str]:
    """The largest optimizer state that fits instead of the present one (never one that
    does not fit, nor one no smaller than the present)."""
    if static.optimizer <= 0:
        return []
    options = alternatives if alternatives is not None else {
        "sgd-momentum": static.grads, "sgd": 0.0}
    fitting = []
    for name, size in sorted(options.items(), key=lambda kv: -kv[1]):
        if size >= static.optimizer:
            continue
        with_it = StaticMemory(static.params, static.buffers, static.grads, size)
        total = with_it.sharded(world) if world > 1 else with_it.total
        if total + other <= capacity:
            fitting.append(f"optimizer={name!r} ({format_bytes(size)} of state, static "
                           f"memory {format_bytes(total)})")
    if not fitting:
        return []
    return [f"an optimizer with less state than the present {format_bytes(static.optimizer)}: "
            + " or ".join(fitting[:2])]


def describe_static(static: StaticMemory, spec: SystemSpec, world: int = 1) -> str:
    """``static memory X = parameters ... + gradients ... + optimizer state ...``, with
    where the optimizer figure came from."""
    shard = f" (one of {world} FSDP2 ranks' shares)" if world > 1 else ""
    total = static.sharded(world) if world > 1 else static.total
    return (f"static memory{shard} {format_bytes(total)} = parameters "
            f"{format_bytes(static.params / world)} + gradients "
            f"{format_bytes(static.grads / world)} + optimizer state "
            f"{format_bytes(static.optimizer / world)} ({optimizer_source(spec)})"
            + (f" + buffers {format_bytes(static.buffers)}" if static.buffers else ""))


def optimizer_source(spec: SystemSpec) -> str:
    """Where ``spec``'s optimizer figure comes from, in a few words."""
    return spec.optimizer_source or (
        f"{spec.optimizer_bytes_per_param:g} B per parameter, the system's assumption; "
        "compile(optimizer=...) sizes it from the optimizer")


def static_does_not_fit(model: nn.Module, spec: SystemSpec, *, world: int = 1
                        ) -> DoesNotFitError | None:
    """The error for ``model`` whose static memory alone exceeds ``spec`` (one replica, or
    one of ``world`` FSDP2 ranks' shares), with the fixes that work; None when it fits.
    Counts shapes only (meta models included); the alternatives to the optimizer are sized
    only on failure."""
    static = static_memory_of(model, spec)
    total = static.sharded(world) if world > 1 else static.total
    if total <= spec.usable_bytes:
        return None
    from mbcompile.planning.optimizer_state import alternatives

    where = (f"one of {world} FSDP2 ranks" if world > 1 else "each system (a replica: more "
             "systems, num_csx, do not shrink it)")
    fixes = static_fixes(static, spec, world=world, alternatives=alternatives(model, spec))
    message = (f"{type(model).__name__} does not fit system {spec.name!r} whatever the "
               f"MBS: static memory alone needs {format_bytes(total)} on {where}, and the "
               f"system has {describe_capacity(spec)}\n"
               f"  {describe_static(static, spec, world)}\n"
               "  fix: " + "; or ".join(fixes))
    return DoesNotFitError(message, mbs=0, needed=total, available=spec.usable_bytes,
                           fixes=tuple(fixes))


def describe_memory(m: MemoryEstimate) -> str:
    """``peak = static ... + inputs ... + ...`` on one line."""
    parts = [f"parameters {format_bytes(m.params)}", f"gradients {format_bytes(m.grads)}",
             f"optimizer state {format_bytes(m.optimizer)}"]
    if m.buffers:
        parts.append(f"buffers {format_bytes(m.buffers)}")
    if m.casts:  # autocast's low-precision copies of the weights, cached through a step
        parts.append(f"autocast weight copies {format_bytes(m.casts)}")
    parts += [f"inputs {format_bytes(m.inputs)}", f"outputs {format_bytes(m.outputs)}",
              f"activations {format_bytes(m.activations)} (saved for backward "
              f"{format_bytes(m.saved)} + largest transient {format_bytes(m.transient)})"]
    if m.update:
        parts.append(f"optimizer update temporaries {format_bytes(m.update)}")
    if m.gathered:  # FSDP2: the units alive unsharded at the peak
        parts.append(f"gathered parameters and FSDP buffers {format_bytes(m.gathered)}")
    if m.frontier or m.coupled:  # a two-phase step's whole-batch terms
        parts += [f"frontier and its gradient {format_bytes(m.frontier)}",
                  f"coupled part at the whole batch {format_bytes(m.coupled)}"]
    return f"peak {format_bytes(m.peak)} ({m.phase}) = " + " + ".join(parts)


def describe_capacity(spec: SystemSpec) -> str:
    """``79.63 GB usable (85.52 GB less 5.89 GB reserved: ...)``."""
    if not spec.reserved_bytes:
        return f"{format_bytes(spec.usable_bytes)}"
    note = spec.reserved_note or "reserved_bytes"
    return (f"{format_bytes(spec.usable_bytes)} usable ({format_bytes(spec.memory_bytes)} less "
            f"{format_bytes(spec.reserved_bytes)} reserved: {note})")


# --------------------------------------------------------------------------- #
# The step: what the batch adds to static memory
# --------------------------------------------------------------------------- #


def step_fixes(cost: CostModel, spec: SystemSpec, sizes: tuple[int, ...],
               smaller_mbs: int | None) -> list[str]:
    """The fixes when no MBS (or the one asked for) fits, each checked with ``cost``:
    ``smaller_mbs`` (the largest that fits, found by the caller), ``outputs="loss"``, more
    systems (only when a smaller per-system batch fits: its inputs and kept outputs
    shrink, a replica's static memory does not), sharding and a lighter optimizer (when
    static memory is the problem), and the memory a system would need at mbs 1."""
    pbs, gbs, num_csx = sizes[0], sum(sizes), len(sizes)  # the plan's per-system sizes
    try:
        least = cost.memory(pbs, 1, pbs, spec)
    except CostModelError:  # a graph run unsplit is probed at its one size only
        least = cost.memory(pbs, pbs, 1, spec)
    fixes: list[str] = []
    if smaller_mbs is not None:
        fixes.append(f"use mbs={smaller_mbs} (the largest that fits) or mbs='auto'")
    if cost.static.output_bytes_per_sample > 0:
        bare = copy.copy(cost)
        bare.static = replace(cost.static, output_bytes_per_sample=0.0)
        without = bare.memory(pbs, 1, pbs, spec)
        if without.fits:
            fixes.append(
                f"outputs='loss' (a training step then keeps no per-sample outputs: "
                f"{format_bytes(cost.static.output_bytes_per_sample)} per sample, "
                f"{format_bytes(least.peak - without.peak)} at the peak now; mbs=1 then needs "
                f"{format_bytes(without.peak)})")
    systems = _fewest_systems(cost, spec, gbs, num_csx)
    if systems is not None:
        fixes.append(f"num_csx={systems} systems (a per-system batch of "
                     f"{per_system_batch_sizes(gbs, systems)[0]}: its inputs and kept outputs "
                     "shrink with it)")
    world = cost.shard.world if cost.shard is not None else 1
    static = StaticMemory(least.params * world, least.buffers,
                          cost.static.trainable_bytes if least.grads else 0.0,
                          least.optimizer * world)
    # sharding (or sharding wider) and a lighter optimizer, each only where it fits
    fixes += [f for f in static_fixes(static, spec, world=world,
                                      other=least.peak - least.static)
              if not f.startswith("a system")]
    fixes.append(f"a system with at least {format_bytes(least.peak + spec.reserved_bytes)} "
                 f"of memory ({format_bytes(least.peak)} usable: what mbs=1 needs), via "
                 "system=SystemSpec(...)")
    return fixes


def _fewest_systems(cost: CostModel, spec: SystemSpec, gbs: int, num_csx: int) -> int | None:
    """The fewest systems (more than ``num_csx``, at most ``gbs``) whose per-system batch
    fits at mbs 1; None when none does (static memory, or one sample, is the problem)."""
    def fits(n: int) -> bool:
        pbs = per_system_batch_sizes(gbs, n)[0]
        return cost.memory(pbs, 1, pbs, spec).fits

    if num_csx >= gbs or not fits(gbs):
        return None
    return first_true(fits, num_csx, gbs)  # fits(num_csx) is False (the caller's plan)


def with_recompute_tried(plain: DoesNotFitError, checkpointed: DoesNotFitError
                         ) -> DoesNotFitError:
    """The error of a plan that fits neither without activation checkpointing (``plain``)
    nor with it (``checkpointed``): the checkpointed figures and fixes (the least memory
    tried, so the fixes that then fit), and a line that says checkpointing was tried."""
    message = (f"{checkpointed}\n  activation checkpointing per block (recompute) was "
               f"tried: the figures and fixes above are with it; without it mbs "
               f"{plain.mbs} needs {format_bytes(plain.needed)}")
    return DoesNotFitError(message, mbs=checkpointed.mbs, needed=checkpointed.needed,
                           available=checkpointed.available, fixes=checkpointed.fixes)


def with_recompute_fix(plain: DoesNotFitError, mbs: int, peak: float) -> DoesNotFitError:
    """``plain``'s error (recompute=False: checkpointing not tried), with the fix it would
    have been: with activation checkpointing per block ``mbs`` fits at ``peak`` bytes."""
    fix = (f"recompute=True (activation checkpointing per block): mbs={mbs} then fits, "
           f"modelled peak {format_bytes(peak)}")
    head, sep, fixes = str(plain).rpartition("  fix: ")
    message = f"{head}{sep}{fix}; or {fixes}" if sep else f"{plain}\n  fix: {fix}"
    return DoesNotFitError(message, mbs=plain.mbs, needed=plain.needed,
                           available=plain.available, fixes=(fix, *plain.fixes))
