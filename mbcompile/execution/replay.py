"""What phase 3 of a two-phase step replays of phase 1 (``two_phase.py``).

Phase 3 runs each microbatch's per-sample part again, with grad, and must compute the
values phase 1 computed: the same random draws (``RngStates``: torch's generators, the
devices' and the model's own), running statistics updated once (``RunningStatistics``),
and a check on the device that it did (``fingerprint``, ``same_values``)::

    states = RngStates(mb, generators)   # phase 1, before the microbatch
    states.restore()                     # phase 3: the same draws again
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint

from mbcompile.passes.generators import GeneratorStates

__all__ = ["RngStates", "RunningStatistics", "fingerprint", "same_values"]


class RngStates:
    """The CPU generator's state, those of the devices the inputs live on, and those of the
    model's own generators the body draws from (``passes/generators.py``)."""

    def __init__(self, tensors: Sequence[Any], generators: Sequence[torch.Generator]) -> None:
        self.cpu = torch.get_rng_state()
        self.devices, self.states = checkpoint.get_device_states(*tensors)
        self.own = GeneratorStates(generators)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.devices:
            checkpoint.set_device_states(self.devices, self.states)
        self.own.restore()


def fingerprint(value: torch.Tensor) -> torch.Tensor:
    """Two numbers that change when a frontier piece's values change (on the device)."""
    v = value.detach().double()
    return torch.stack([v.sum(), v.abs().sum()])


def same_values(again: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Whether phase 3 recomputed a piece phase 1 computed (rounding allowed, for kernels
    that are not bitwise deterministic), as a device bool: no host read."""
    close = (again - before).abs() <= 1e-6 * before[1] + 1e-300
    return (close | (again == before) | (again.isnan() & before.isnan())).all()  # inf, NaN


class RunningStatistics:
    """The running statistics of the norm layers a body updates in place (BatchNorm with
    ``batch_norm="per_microbatch"``), as phase 1 left them: phase 3 runs each microbatch
    again and would update them a second time."""

    def __init__(self, body: torch.nn.Module) -> None:
        self.saved = [(b, b.clone()) for m in body.modules()
                      if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                      and m.training and m.track_running_stats
                      for b in m.buffers(recurse=False)]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
