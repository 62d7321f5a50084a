"""The torch.distributed backend: one rank per system, in a process group of ``num_csx``.

It binds ``passes.ops.microbatch_loop`` to the training loop on the rank's share of the
batch (the gradient all-reduce launched from the last microbatch's backward, the status
and checks read once per step), ``all_reduce_sums`` to the all-reduce of the packed
partial sums, and ``two_phase_step`` to the three phases of ``two_phase.py`` with the
frontier gathered over ranks (``frontier_gather.py``). The collectives themselves are in
``distributed.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from mbcompile.execution.distributed import all_reduce_sums
from mbcompile.execution.frontier_gather import RankGather
from mbcompile.execution.runtime import StepChannels, make_loop
from mbcompile.execution.two_phase import make_two_phase
from mbcompile.passes import ops

__all__ = ["bindings"]


def bindings(channels: StepChannels, shares: Sequence[int] = ()
             ) -> dict[Callable[..., Any], Callable[..., Any]]:
    """What this backend binds the rewritten graph's loop ops to; ``shares`` are the ranks'
    samples per step (a two-phase step gathers its frontier over them, exchanging its shapes
    first where a dim is symbolic). Rank 0 alone keeps the coupled part's own gradients, so
    the gradient all-reduce counts them once. Every backward is seeded alike on every rank
    (``seeding.Seed.ranks``): the gradients are summed over ranks before the factor that
    corrects the seed is applied."""
    if channels.config.seed is not None:
        channels.config.seed.ranks = True
    rank = dist.get_rank()
    gather = RankGather(shares, rank, exchange=channels.config.lengths_vary)
    return {ops.microbatch_loop: make_loop(channels, distributed=True),
            ops.all_reduce_sums: all_reduce_sums,
            ops.two_phase_step: make_two_phase(channels, gather,
                                               all_reduce_sums, keep_coupled_grads=rank == 0)}
