"""Execution: the backends that bind the rewritten graph's loop and collective ops.

``runtime`` is the training loop (backward per microbatch, one device read per
step), ``simulated`` runs every system in this process, ``distributed`` one rank
per system on torch.distributed; ``noise`` is the noise-scale estimate the loop
measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mbcompile.execution.runtime import StepChannels
from mbcompile.passes import ops

__all__ = ["BACKENDS", "StepChannels", "bindings"]

BACKENDS = ("simulated", "torch.distributed")


def bindings(backend: str, channels: StepChannels, shares: Sequence[int] = ()
             ) -> dict[Callable[..., Any], Callable[..., Any]]:
    """The loop-op bindings of ``backend`` (one of ``BACKENDS``); ``shares`` are the
    ranks' samples per step (a two-phase step gathers its frontier over them)."""
    if backend == "torch.distributed":
        import torch.distributed as dist

        from mbcompile.execution import distributed, two_phase

        rank = dist.get_rank()
        return {**distributed.bindings(channels),
                ops.two_phase_step: two_phase.make_two_phase(
                    channels, two_phase.rank_gather(shares, rank), distributed.all_reduce_sums,
                    keep_coupled_grads=rank == 0)}
    from mbcompile.execution import simulated

    return simulated.bindings(channels)
