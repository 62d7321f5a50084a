"""What a training step checks on the device, read once per step (``StepChecks``).

>>> checks = StepChecks(n=4, device=torch.device("cpu"), noise=False)
>>> checks.finite(0, partial)          # per microbatch: kept, never read here
>>> values = read_host(checks.packed())  # the step's one device-to-host read

The loop (``runtime.py``) and the two-phase step fill them; ``read_host`` is the one
read, which the tests count (they patch ``runtime.read_host``, the name the loop calls).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StepChecks", "read_host", "take_refused"]


def take_refused(channels: Any) -> BaseException | None:
    """The refusal a rank left for its step (``StepChannels.refused``: a call that is not
    its share, a length no split fits), taken once and marked as a refusal, so that the
    step's status (``distributed.step_status``) names it to the other ranks as that."""
    refused, channels.refused = channels.refused, None
    if refused is not None:
        refused.call_refused = True  # type: ignore[attr-defined]
    return refused


class StepChecks:
    """What a training step checks, kept on the device and read once per step.

    Per microbatch: the loss partial (is it finite?) and, when measuring the noise
    scale, ``|g_m|^2`` and the count; for the step: ``|Σ g_m|^2``. ``packed()`` is
    one vector ``[loss partials..., |g_m|^2..., counts..., |G|^2]``, so the whole step
    costs one device-to-host read, not one ``.item()`` per microbatch. The partials
    are kept as they come (detached) and stacked once, in ``packed()``, rather than
    copied one by one into a device vector (three dispatched ops per microbatch).
    """

    def __init__(self, n: int, device: torch.device, noise: bool) -> None:
        self.n, self.noise, self.current, self.device = n, noise, 0, device
        self.partials: list[torch.Tensor | None] = [None] * n
        self._losses: torch.Tensor | None = None
        if noise:
            self.squares = torch.zeros(n, dtype=torch.float64, device=device)
            self.counts = torch.zeros(n, dtype=torch.float64, device=device)
            self.big = torch.zeros(1, dtype=torch.float64, device=device)

    def finite(self, i: int, partial: torch.Tensor) -> None:
        self.partials[i] = partial.detach()  # read once, at the end of the step

    def add_square(self, g: torch.Tensor) -> None:  # a tensor hook: the gradient is unchanged
        self.squares[self.current].add_(torch.linalg.vector_norm(g.detach()).double().square())

    def count(self, i: int, count: Any) -> None:
        self.counts[i] = count.detach() if isinstance(count, torch.Tensor) else float(count)

    def step_square(self, grads: Sequence[torch.Tensor | None]) -> None:
        for g in grads:
            if g is not None:
                self.big.add_(torch.linalg.vector_norm(g.detach()).double().square())

    def losses(self) -> torch.Tensor:
        """Every microbatch's loss partial, in float64 (one stack; a partial that is not
        0-dim is summed: a scalar loss's partial only needs its shape fixed)."""
        if self._losses is None and not self.n:
            self._losses = torch.zeros(0, dtype=torch.float64, device=self.device)
        elif self._losses is None:
            parts = [p if p.dim() == 0 else p.sum() for p in self.partials]
            self._losses = torch.stack(parts).double()
        return self._losses

    def packed(self) -> torch.Tensor:
        if not self.noise:
            return self.losses()
        return torch.cat([self.losses(), self.squares, self.counts, self.big])

    def failed(self) -> torch.Tensor:
        """A device bool: some microbatch's loss is not finite."""
        return ~torch.isfinite(self.losses()).all()

    def first_nonfinite(self, values: Sequence[float]) -> int | None:
        return next((i for i, v in enumerate(values[:self.n]) if not math.isfinite(v)), None)

    def noise_figures(self, values: Sequence[float]) -> tuple[list[float], list[float], float]:
        n = self.n
        return list(values[n:2 * n]), list(values[2 * n:3 * n]), values[3 * n]


def read_host(t: torch.Tensor) -> list[float]:
    """The step's one device-to-host read (every check of the step, packed in ``t``)."""
    return t.detach().cpu().tolist()
