"""The cost model as a function of (samples, length): one fit over the symbolic dims.

>>> lengths = length_cost(cost, gm, names, symbolic, example, pbs)   # 7 or 11 fake probes
>>> lengths.at(+16).memory(pbs, mbs, k, system).peak        # 16 tokens longer per sample

A step whose sequence length is symbolic (``dynamic_shapes.py``) runs at every length, and
its figures change with it. Every per-op figure of a probe is affine in the microbatch
size ``m`` (``fit.py``: ``a + b*m``); in the length, for the ops a transformer runs, the
shapes hold the length at most twice (``m*L*d`` activations, ``m*L*L`` attention scores),
so ``a`` and ``b`` are each a quadratic in the length. Three lengths fit it exactly
(Lagrange's form: every figure at a length is a weighted sum of the three fits' figures)
and a fourth, probed exactly, verifies it; where it does not reproduce that probe (a
length padded to a multiple inside the model, an op sequence that changes) there is no
length model, and the plan stays the one made at the example's length.

The length is a step ``delta`` that every symbolic dim moves by together, as the proof of
the symbolic step moves them (``Request.at_other_lengths``): ``delta`` 0 is the example,
and a call's ``delta`` is the largest of its dims' (for a model whose dims vary apart, the
encoder's and the decoder's, the figure of the longer: an upper bound).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from mbcompile.dynamic_shapes import Bounds, resized
from mbcompile.errors import CostModelError
from mbcompile.planning.cost import CostModel
from mbcompile.planning.fit import Fit, fit, reproduces
from mbcompile.planning.precision import probe_precision
from mbcompile.planning.probe import Probe, Prober, nbytes
from mbcompile.planning.tolerance import close
from mbcompile.planning.two_phase_cost import TwoPhaseCostModel

__all__ = ["LengthCost", "length_cost", "probe_steps", "scaled_in_length"]


class LengthCost:
    """The figures of one graph at any length ``delta`` (see the module docstring); ``at``
    answers a ``CostModel`` for one length, from the fit alone (cached per length).

    ``fits``: the affine fit in ``m`` at each of the three ``steps`` (from ``m = 2`` where
    ``m = 1`` differs: a size-1 dim broadcasts); ``ones``: then the exact probe at ``m = 1``
    at each step, whose figures are quadratic in the length too."""

    def __init__(self, base: CostModel, steps: tuple[int, int, int], fits: Sequence[Fit],
                 ones: Sequence[Probe], inputs: Sequence[float], checked: int,
                 sizes: dict[tuple[str, int], int] | None = None) -> None:
        self.base = base
        #: the example's size of each symbolic (input, dim), the frame ``delta`` counts
        #: from: a variant whose example has other lengths (a short batch at a long length)
        #: reads the same model in this frame (``length_plans``)
        self.sizes = dict(sizes or {})
        self.length = next(iter(self.sizes.values()), 0)  # the first dim's: ``at_length``'s
        self.steps = steps  # the three deltas the fits were probed at (0 among them)
        self._fits = list(fits)
        self._ones = list(ones)
        self._inputs = list(inputs)  # input bytes per sample at each of the three
        self.checked = checked  # the delta the exact probes verified
        self._at: dict[int, CostModel] = {}

    @property
    def note(self) -> str:
        return (f"quadratic in the length: fitted at length steps {', '.join(map(str, self.steps))}"
                f" from the example{', m=1 apart' if self._ones else ''}, reproduces the exact "
                f"probes at {self.checked:+d}")

    def weights(self, delta: int) -> list[float]:
        """Lagrange's weights of the three fits at ``delta``."""
        x = self.steps
        return [float(np.prod([(delta - x[j]) / (x[i] - x[j]) for j in range(3) if j != i]))
                for i in range(3)]

    def fit_at(self, delta: int) -> Fit:
        """The affine fit in ``m`` at length step ``delta``."""
        w = self.weights(delta)
        f0 = self._fits[0]

        def mix(pick: Any) -> Any:
            return sum(wi * pick(f) for wi, f in zip(w, self._fits))

        return Fit(f0.base, {k: mix(lambda f, k=k: f.a[k]) for k in f0.a},
                   {k: mix(lambda f, k=k: f.b[k]) for k in f0.b},
                   (mix(lambda f: f.saved[0]), mix(lambda f: f.saved[1])),
                   (mix(lambda f: f.outputs[0]), mix(lambda f: f.outputs[1])))

    def one_at(self, delta: int) -> Probe | None:
        """The probe at ``m = 1`` at length step ``delta`` where the fit starts at 2."""
        if not self._ones:
            return None
        w, first = self.weights(delta), self._ones[0]
        arrays = {k: sum(wi * p.arrays()[k] for wi, p in zip(w, self._ones))
                  for k in first.arrays()}
        return replace(first, saved=sum(wi * p.saved for wi, p in zip(w, self._ones)),
                       outputs=sum(wi * p.outputs for wi, p in zip(w, self._ones)), **arrays)

    def at_length(self, length: int) -> CostModel:
        """The cost model at ``length`` (of the first symbolic dim, as the example's)."""
        return self.at(length - self.length)

    def at(self, delta: int) -> CostModel:
        """The cost model at length step ``delta``: every size from the fit."""
        if delta not in self._at:
            if len(self._at) > 256:  # lengths seen are few; a sweep should not keep them all
                self._at.clear()
            fitted = self.fit_at(delta)
            kind = _TwoPhaseAtLength if isinstance(self.base, TwoPhaseCostModel) else _AtLength
            model = kind(fitted, self.base, self.one_at(delta))
            per_sample = sum(w * b for w, b in zip(self.weights(delta), self._inputs))
            model.static = replace(self.base.static, input_bytes_per_sample=max(0.0, per_sample),
                                   output_bytes_per_sample=max(0.0, fitted.outputs[1]))
            self._at[delta] = model
        return self._at[delta]


class _AtLength(CostModel):
    """A ``CostModel`` at one length: its figures from the length fit alone (no probe runs;
    the base model's exact probes hold the weights' autocast copies, which do not depend
    on the length); ``one``: the figures at ``m = 1`` where the fit starts at 2."""

    def __init__(self, fitted: Fit, base: CostModel, one: Probe | None = None) -> None:
        self.__dict__.update(copy.copy(base.__dict__))
        self._prober = None
        self._fit, self._fit_from, self._pinned = fitted, 1 if one is None else 2, None
        self._one = one

    def _at(self, m: int) -> tuple[Probe, bool]:
        assert self._fit is not None
        if m < self._fit_from and self._one is not None:
            return self._one, False
        return self._fit.at(m), False


class _TwoPhaseAtLength(TwoPhaseCostModel, _AtLength):
    """A two-phase step's model at one length: P's figures from the length fit, the frontier
    F and the coupled part C as probed at the example (``length_cost`` checked that F's
    size does not follow the length, so neither does C's input)."""

    def __init__(self, fitted: Fit, base: CostModel, one: Probe | None = None) -> None:
        _AtLength.__init__(self, fitted, base, one)  # base's F and C terms come with it


def scaled_in_length(base: CostModel, ratio: float) -> CostModel:
    """``base`` (fitted at the example) with every per-sample figure scaled by ``ratio``,
    the length over the example's: the model of a graph linear in the length, which
    attention's ``L * L`` scores are not (``benchmarks/bench_token_split.py`` sets it beside
    the quadratic fit and the measured peak). Sizes from ``m = 2``."""
    assert base._fit is not None
    f = base._fit
    scaled = Fit(f.base, dict(f.a), {k: v * ratio for k, v in f.b.items()},
                 (f.saved[0], f.saved[1] * ratio), (f.outputs[0], f.outputs[1] * ratio))
    model = _AtLength(scaled, base)
    model.static = replace(base.static,
                           input_bytes_per_sample=base.static.input_bytes_per_sample * ratio,
                           output_bytes_per_sample=base.static.output_bytes_per_sample * ratio)
    return model


def probe_steps(sizes: Sequence[tuple[int, Bounds]]) -> tuple[int, ...] | None:
    """Four length steps (the first 0, the example) that every symbolic dim (``(example
    size, bounds)`` each) can move by and stay at 2 or more within its bounds: the three
    the fit is made at and the one that checks it; None where the bounds leave fewer."""
    low = max(max(low or 2, 2) - size for size, (low, _) in sizes)
    high = min((h - size for size, (_, h) in sizes if h is not None), default=None)
    base = min(size for size, _ in sizes)
    wanted = [base, -(base // 2), 2 * base, 1, -1, 2, -2, 3, -3]
    steps = [0]
    for step in wanted:
        if step not in steps and step >= low and (high is None or step <= high):
            steps.append(step)
        if len(steps) == 4:
            return tuple(steps)
    return None


def length_cost(base: CostModel, gm: Any, names: Sequence[str], symbolic: Mapping[str, Any],
                example: Mapping[str, Any], pbs: int) -> LengthCost:
    """The length model of ``base`` (the cost model at the example, with an affine fit in
    ``m``): ``gm`` (the graph with the symbolic dims) probed at ``m = 1, 2`` (``1, 2, 3``
    where ``base``'s fit starts at 2) at three steps of ``probe_steps`` and checked at the
    fourth; raises ``CostModelError`` with the reason where none holds. For a two-phase
    step ``gm`` is its per-sample part P (the body), whose outputs are the frontier: it
    holds where they keep one size at every length (a loss's partial sums), F and C then
    a fixed cost at every length."""
    prober = base._prober
    if prober is None or base._fit is None:
        raise CostModelError("the cost model at the example's length has no affine fit in m "
                             f"to extend over lengths ({base.fit_note})")
    apart = base._fit_from > 1  # m = 1 differs from the fit: probed on its own
    sizes = [(t.shape[d], bounds) for n, dims in symbolic.items()
             for t in pytree.tree_leaves(example[n]) if isinstance(t, torch.Tensor)
             for d, bounds in dims.items() if d < t.dim()]
    steps = probe_steps(sizes)
    if steps is None:
        raise CostModelError("the symbolic dims' bounds leave too few lengths to fit")
    fits: list[Fit] = []
    ones: list[Probe] = []
    inputs: list[float] = []
    exact: list[Probe] = []
    for step in steps:
        values = [resized(example[n], symbolic[n], step) if n in symbolic else example[n]
                  for n in names]
        at = Prober(gm, values, prober.in_dims, prober.loss_leaves, prober.kept)
        with probe_precision(base.precision, at):
            if step == steps[3]:  # the check: a larger microbatch, and m = 1 apart
                exact = [at(max(2 + apart, min(pbs, 4)))] + ([at(1)] if apart else [])
                break
            fitted = fit(at(1 + apart), at(2 + apart))
            ones += [at(1)] if apart else []
        if fitted is None or (fits and fitted.base.ops != fits[0].base.ops) or (
                apart and ones[-1].ops != ones[0].ops):
            raise CostModelError(f"the op sequence changes with the length (step {step:+d})")
        if isinstance(base, TwoPhaseCostModel) and fits and not close(
                np.array(fitted.outputs), np.array(fits[0].outputs)):
            raise CostModelError("the two-phase step's frontier (what its coupled part reads "
                                 "of the whole batch) grows with the length, and the coupled "
                                 "part has no model over lengths yet")
        fits.append(fitted)
        inputs.append(_input_bytes_per_sample(values, prober.in_dims))
    model = LengthCost(base, steps[:3], fits, ones, inputs, steps[3], dim_sizes(example, symbolic))
    one = model.one_at(steps[3])
    if not reproduces(model.fit_at(steps[3]), exact[0]) or (
            one is not None and not _same(one, exact[1])):
        raise CostModelError(f"the figures are not quadratic in the length: the fit does not "
                             f"reproduce the exact probes at length step {steps[3]:+d}")
    return model


def size_along(value: Any, dim: int) -> int:
    """``value``'s size along ``dim``: a tensor's, or the largest of the tensors it holds
    (read on every call whose split follows its length: a tensor without a walk)."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[dim])
    return max(int(t.shape[dim]) for t in pytree.tree_leaves(value)
               if isinstance(t, torch.Tensor) and t.dim() > dim)


def dim_sizes(example: Mapping[str, Any], symbolic: Mapping[str, Any]
              ) -> dict[tuple[str, int], int]:
    """The size of each symbolic (input, dim) in ``example`` (``size_along``), in the
    symbolic dims' order."""
    return {(name, d): size_along(example[name], d) for name, dims in symbolic.items()
            for d in dims}


def _same(p: Probe, q: Probe) -> bool:
    """Two probes' figures equal to the fit's tolerance."""
    return (p.ops == q.ops and all(close(p.arrays()[k], q.arrays()[k]) for k in p.arrays())
            and close(p.saved, q.saved) and close(p.outputs, q.outputs))


def _input_bytes_per_sample(values: Sequence[Any], in_dims: Sequence[int | None]) -> float:
    total = 0.0
    for value, d in zip(values, in_dims):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and d is not None and t.shape[d] > 0:
                total += nbytes(t) / t.shape[d]
    return total
