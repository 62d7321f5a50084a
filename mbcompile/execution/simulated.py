"""The simulated backend: every system in this process, one after the other.

It binds ``passes.ops.microbatch_loop`` to the training loop (backward per
microbatch, one device read per step) and ``two_phase_step`` to the three phases
of ``two_phase.py``; ``all_reduce_sums`` keeps its reference meaning, since
``accumulate_sum`` already added every system of this process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mbcompile.execution.runtime import StepChannels, make_loop
from mbcompile.execution.two_phase import make_two_phase
from mbcompile.passes import ops

__all__ = ["bindings"]


def bindings(channels: StepChannels) -> dict[Callable[..., Any], Callable[..., Any]]:
    """What this backend binds the rewritten graph's loop ops to."""
    return {ops.microbatch_loop: make_loop(channels), ops.two_phase_step: make_two_phase(channels)}
