"""Static memory checked before any tracing: what does not fit fails in milliseconds.

Parameters, gradients and optimizer state do not depend on the MBS; when they alone exceed
a system's usable memory no plan can fit, and counting them needs no trace. The figures
are the cost model's own (``cost.static_figures``, which counts tied weights once), so the
check never refuses a model that the cost model would accept: it is a lower bound of the
peak the cost model computes (the activations, inputs and outputs come on top).

Example, a 70B-shaped model on 80 GB systems (Adam's two fp32 moments)::

    params 141 GB + gradients 141 GB + optimizer state 564 GB = 846 GB per system
    -> FSDP2 over 12 ranks holds 70.5 GB of it per rank: the smallest world that fits

``num_csx`` alone never helps a replicated model (every system holds all of it), so
the error names only what does: sharding, and an optimizer with less state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from mbcompile.planning.estimates import DoesNotFitError, ShardSpec, format_bytes
from mbcompile.planning.systems import SystemSpec

__all__ = ["StaticMemory", "check_static_memory", "static_memory"]


@dataclass(frozen=True)
class StaticMemory:
    """One system's static bytes: the model's parameters, buffers, gradients and
    optimizer state, each over the FSDP2 world that shards it (1: replicated)."""

    params: float
    buffers: float
    grads: float
    optimizer: float
    world: int = 1

    @property
    def sharded(self) -> float:
        """What sharding divides: parameters, gradients and optimizer state, whole."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Bytes per system over ``world`` ranks (buffers are replicated)."""
        return self.sharded / self.world + self.buffers

    def smallest_world(self, usable: float) -> int | None:
        """The smallest FSDP2 world whose per-rank static bytes fit ``usable`` (None:
        the buffers alone do not fit, or nothing is sharded)."""
        room = usable - self.buffers
        if room <= 0 or self.sharded <= 0:
            return None
        return max(2, math.ceil(self.sharded / room))


def static_memory(model: nn.Module, system: SystemSpec, shard: ShardSpec | None = None
                  ) -> StaticMemory:
    """``model``'s static bytes per system on ``system`` (none of the parameters', gradients'
    or optimizer state's for a weight-streaming system, which keeps them off-chip)."""
    from mbcompile.planning.cost import static_figures  # cost imports the probes: lazily

    s = static_figures(model, (), (), fused=True)
    on_device = system.weight_bandwidth is None
    trained = on_device and s.training
    return StaticMemory(
        params=s.param_bytes if on_device else 0.0, buffers=s.buffer_bytes,
        grads=s.trainable_bytes if trained else 0.0,
        optimizer=system.optimizer_bytes_per_param * s.num_trainable if trained else 0.0,
        world=shard.world if shard is not None else 1)


def check_static_memory(model: nn.Module, system: SystemSpec, num_csx: int,
                        shard: ShardSpec | None = None) -> None:
    """Raise ``DoesNotFitError`` when ``model``'s static memory alone exceeds ``system``'s
    usable memory (``num_csx`` systems, ``shard``: its FSDP2 sharding, None: replicated);
    its text names the fixes that would fit the static memory, and only those."""
    need = static_memory(model, system, shard)
    usable = system.usable_bytes
    if need.total <= usable:
        return
    name = type(model).__name__
    where = (f"sharded over {need.world} ranks" if need.world > 1
             else f"replicated on each of {num_csx} systems" if num_csx > 1 else "on one system")
    message = (f"{name} cannot fit on {system.name!r}: its static memory alone, {where}, is "
               f"{format_bytes(need.total)} per system (parameters "
               f"{format_bytes(need.params / need.world)}, gradients "
               f"{format_bytes(need.grads / need.world)}, optimizer state "
               f"{format_bytes(need.optimizer / need.world)} at "
               f"{system.optimizer_bytes_per_param:g} B per parameter"
               f"{_source(system)}, buffers {format_bytes(need.buffers)}), more than the "
               f"{format_bytes(usable)} a step may use; no microbatch size changes that, "
               "so nothing was traced")
    fixes = _fixes(need, usable, num_csx)
    message += "\n  fix: " + ("; or ".join(fixes) if fixes else
                              "a system with more memory via system=SystemSpec(...)")
    raise DoesNotFitError(message, mbs=1, needed=need.total, available=usable)


def _source(system: SystemSpec) -> str:
    source = getattr(system, "optimizer_source", "")
    return f" ({source})" if source else ""


def _fixes(need: StaticMemory, usable: float, num_csx: int) -> list[str]:
    """What would make the static memory fit, each checked: a large enough FSDP2 world, an
    optimizer with less state. More replicated systems never help, so they are not named."""
    fixes = []
    world = need.smallest_world(usable)
    if world is not None and world > need.world:
        ranks = max(world, num_csx)  # the FSDP2 world is the systems the batch runs on
        per_rank = need.sharded / ranks + need.buffers
        over = (f"over num_csx={world} ranks or more" if num_csx < world
                else f"over its {num_csx} systems (at least {world} are needed)")
        fixes.append(f"shard it with FSDP2 (fully_shard each block) {over}: "
                     f"{format_bytes(per_rank)} of static memory per rank, before activations "
                     "and the gathered units")
    without = StaticMemory(need.params, need.buffers, need.grads, 0.0, need.world)
    if need.optimizer > 0 and without.total <= usable:
        fixes.append("an optimizer with less state: compile(..., optimizer='sgd') keeps none "
                     f"({format_bytes(without.total)} per system)")
    fixes.append("a system with more memory via system=SystemSpec(...)")
    return fixes
