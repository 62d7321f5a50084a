"""The gradient noise scale from the microbatches themselves (McCandlish et al. 2018).

Every microbatched step gives gradients at two batch sizes for free: each
microbatch's (``B_small`` samples or tokens) and the whole step's (``B_big``). For
a mean loss, ``E|G_B|^2 = |G|^2 + tr(Σ)/B``, so the two measured squared norms
give unbiased estimates of both terms (appendix A of the paper)::

    S_small = mean over microbatches of |g_m / n_m|^2      (a = mean of 1/n_m)
    S_big   = |Σ_m g_m / N|^2                              (b = 1/N)
    tr(Σ)   ≈ (S_small - S_big) / (a - b)
    |G|^2   ≈ (a S_big - b S_small) / (a - b)
    B_simple = tr(Σ) / |G|^2

With uneven microbatches ``a`` is the mean of ``1/n_m``, which keeps the
estimator unbiased. Single-step estimates are noisy, so numerator and
denominator are smoothed separately with exponential moving averages, as the
paper advises, before taking their ratio.

The cost: one squared-norm reduction of each parameter's gradient per
microbatch, taken by a tensor hook as autograd hands the gradient over (before
it is accumulated), and one over the step's gradient: no extra gradient buffers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NoiseScale", "NoiseScaleEstimate", "estimate_noise_scale"]


@dataclass(frozen=True)
class NoiseScaleEstimate:
    """One step's unbiased estimates."""

    trace_sigma: float  # tr(Σ): per-sample gradient variance, summed over parameters
    grad_norm_sq: float  # |G|^2: squared norm of the true gradient
    b_small: float  # the effective microbatch size, 1 / mean(1/n_m)
    b_big: float  # the step's batch size N

    @property
    def b_simple(self) -> float:
        return self.trace_sigma / self.grad_norm_sq if self.grad_norm_sq > 0 else math.inf


def estimate_noise_scale(small_sq_norms: Sequence[float], small_sizes: Sequence[float],
                         big_sq_norm: float, big_size: float) -> NoiseScaleEstimate | None:
    """Estimates from per-microbatch ``|g_m|^2`` (of the *summed* loss) and ``|Σ g_m|^2``.

    ``small_sizes`` are the microbatches' counts ``n_m`` (samples, or tokens for a
    token-level loss) and ``big_size`` their total. Returns None with fewer than
    two microbatches (no second batch size to compare with).
    """
    pairs = [(sq, n) for sq, n in zip(small_sq_norms, small_sizes) if n > 0]
    if len(pairs) < 2 or big_size <= 0:
        return None
    s_small = sum(sq / n**2 for sq, n in pairs) / len(pairs)
    a = sum(1 / n for _, n in pairs) / len(pairs)
    b = 1 / big_size
    s_big = big_sq_norm / big_size**2
    if a <= b:
        return None
    trace = (s_small - s_big) / (a - b)
    norm_sq = (a * s_big - b * s_small) / (a - b)
    return NoiseScaleEstimate(trace, norm_sq, 1 / a, big_size)


@dataclass
class NoiseScale:
    """Exponential moving averages of tr(Σ) and |G|^2, smoothed separately.

    ``decay`` is the EMA weight of the past (0.9 ~ the last ten steps);
    ``b_simple`` is the ratio of the bias-corrected averages. An update may carry
    its units as a device tensor (``scale``): it is read when the averages are,
    never inside a training step.
    """

    decay: float = 0.9
    _steps: int = 0
    _trace: float = 0.0
    _norm: float = 0.0
    _history: list[NoiseScaleEstimate] = field(default_factory=list)
    _pending: list[tuple[NoiseScaleEstimate, Any]] = field(default_factory=list, repr=False)

    def update(self, estimate: NoiseScaleEstimate | None, scale: Any = 1.0) -> None:
        """Add one step's estimate, in units multiplied by ``scale`` (a float or 0-dim tensor)."""
        if estimate is not None:
            self._pending.append((estimate, scale))

    def _settle(self) -> None:
        for estimate, scale in self._pending:
            k = float(scale)
            estimate = NoiseScaleEstimate(estimate.trace_sigma * k, estimate.grad_norm_sq * k,
                                          estimate.b_small, estimate.b_big)
            self._steps += 1
            self._trace = self.decay * self._trace + (1 - self.decay) * estimate.trace_sigma
            self._norm = self.decay * self._norm + (1 - self.decay) * estimate.grad_norm_sq
            self._history.append(estimate)
        self._pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """The averages and every step's estimate as plain Python values (for checkpoints)."""
        self._settle()
        return {"decay": self.decay, "steps": self._steps, "trace": self._trace,
                "norm": self._norm,
                "history": [[e.trace_sigma, e.grad_norm_sq, e.b_small, e.b_big]
                            for e in self._history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from what ``state_dict`` returned (pending updates are dropped)."""
        self.decay = float(state["decay"])
        self._steps = int(state["steps"])
        self._trace, self._norm = float(state["trace"]), float(state["norm"])
        self._history = [NoiseScaleEstimate(*map(float, e)) for e in state["history"]]
        self._pending.clear()

    @property
    def steps(self) -> int:
        """Training steps that gave an estimate."""
        return self._steps + len(self._pending)

    @property
    def history(self) -> list[NoiseScaleEstimate]:
        """Every step's estimate, in the loss's units."""
        self._settle()
        return self._history

    @property
    def trace_sigma(self) -> float:
        self._settle()
        return self._trace / (1 - self.decay**self._steps) if self._steps else math.nan

    @property
    def grad_norm_sq(self) -> float:
        self._settle()
        return self._norm / (1 - self.decay**self._steps) if self._steps else math.nan

    @property
    def b_simple(self) -> float:
        """The smoothed simple noise scale, in the units of the counts (samples or tokens)."""
        if not self.steps:
            return math.nan
        return self.trace_sigma / self.grad_norm_sq if self.grad_norm_sq > 0 else math.inf

    def spread(self) -> tuple[float, float]:
        """(low, high) quartiles of the per-step B_simple estimates (finite, positive ones)."""
        values = sorted(e.b_simple for e in self.history
                        if math.isfinite(e.b_simple) and e.b_simple > 0)
        if not values:
            return (math.nan, math.nan)
        return values[len(values) // 4], values[(3 * len(values)) // 4]


def advice(noise: NoiseScale, unit: str = "samples") -> str:
    """Plain-language batch-size advice from a measured noise scale.

    McCandlish et al.: training steps grow as ``1 + B_noise / B`` and compute as
    ``1 + B / B_noise``, with ``B_simple`` as the estimate of ``B_noise`` (the
    critical batch size). ``unit`` names what the loss counts (samples or tokens).
    """
    if not noise.steps or not math.isfinite(noise.b_simple) or noise.b_simple <= 0:
        return ("no usable noise-scale estimate yet (needs training steps with at least two "
                "microbatches, and a positive estimate)")
    crit = noise.b_simple
    batch = sum(e.b_big for e in noise.history) / len(noise.history)
    low, high = noise.spread()

    def steps(b: float) -> float:
        return 1 + crit / b

    cut = 1 - steps(2 * batch) / steps(batch)
    head = (f"critical batch size (B_simple) ~ {crit:.4g} {unit} (per-step estimates "
            f"{low:.3g} to {high:.3g}, {noise.steps} steps); the batch in use is "
            f"{batch:.4g} {unit}. ")
    if batch < 0.5 * crit:
        tail = (f"It is well below the critical size: doubling the GBS would cut the number of "
                f"steps by about {cut:.0%} for little extra compute.")
    elif batch > 2 * crit:
        tail = (f"It is above the critical size: a larger GBS would mostly waste compute "
                f"(doubling it cuts the steps by only {cut:.0%}).")
    else:
        tail = (f"It is near the critical size, the usual sweet spot: doubling the GBS would cut "
                f"the steps by about {cut:.0%} at about {1 - cut:.0%} more compute per step's "
                "worth of progress.")
    return head + tail
