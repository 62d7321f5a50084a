"""Execution: the backends that bind the rewritten graph's loop and collective ops.

``runtime`` is the training loop (backward per microbatch, one device read per
step), ``simulated`` runs every system in this process, ``ranks`` one rank per
system on torch.distributed (its collectives in ``distributed``); ``noise`` is the
noise-scale estimate the loop measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mbcompile.execution.runtime import StepChannels

__all__ = ["BACKENDS", "StepChannels", "bindings"]

BACKENDS = ("simulated", "torch.distributed")


def bindings(backend: str, channels: StepChannels, shares: Sequence[int] = ()
             ) -> dict[Callable[..., Any], Callable[..., Any]]:
    """The loop-op bindings of ``backend`` (one of ``BACKENDS``); ``shares`` are the
    ranks' samples per step (a two-phase step gathers its frontier over them)."""
    if backend == "torch.distributed":
        from mbcompile.execution import ranks

        return ranks.bindings(channels, shares)
    from mbcompile.execution import simulated

    return simulated.bindings(channels)
