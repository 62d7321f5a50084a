"""The affine fit: every per-op figure of a probe as ``a + b*m``, checked against exact probes.

For the models this project targets the op sequence does not change with the batch
size, only the batch dim of the shapes, so each figure is affine in ``m``. A fit made
from two probes is kept only when it reproduces a third exact probe to
``FIT_TOLERANCE`` (``CostModel.build_fit`` says which sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mbcompile.planning.probe import Probe
from mbcompile.planning.tolerance import FIT_TOLERANCE, close

__all__ = ["FIT_TOLERANCE", "Fit", "fit", "reproduces", "scaled"]


@dataclass
class Fit:
    base: Probe  # non-batch-dependent arrays (fp32, kernel, backward) come from here
    a: dict[str, np.ndarray]
    b: dict[str, np.ndarray]
    saved: tuple[float, float]
    outputs: tuple[float, float]

    def at(self, m: int) -> Probe:
        arrays = {k: self.a[k] + self.b[k] * m for k in self.a}
        return Probe(m=m, ops=self.base.ops, fp32=self.base.fp32, kernel=self.base.kernel,
                      backward=self.base.backward, saved=self.saved[0] + self.saved[1] * m,
                      outputs=self.outputs[0] + self.outputs[1] * m, casts=self.base.casts,
                      **arrays)


def fit(p: Probe, q: Probe) -> Fit | None:
    if p.ops != q.ops or len(p.live) != len(q.live):
        return None
    dm = q.m - p.m
    a, b = {}, {}
    for k, x in p.arrays().items():
        y = q.arrays()[k]
        b[k] = (y - x) / dm
        a[k] = x - b[k] * p.m
    saved_b = (q.saved - p.saved) / dm
    out_b = (q.outputs - p.outputs) / dm
    return Fit(p, a, b, (p.saved - saved_b * p.m, saved_b), (p.outputs - out_b * p.m, out_b))


def reproduces(fit: Fit, exact: Probe) -> bool:
    got = fit.at(exact.m)
    if got.ops != exact.ops or len(got.live) != len(exact.live):
        return False
    return (all(close(got.arrays()[k], exact.arrays()[k]) for k in exact.arrays())
            and close(got.saved, exact.saved) and close(got.outputs, exact.outputs))


def scaled(p: Probe, m: int) -> Probe:
    """``p``'s figures at ``m`` samples, in proportion (the weights read stay as they are):
    the time of a pinned plan's smaller microbatch, without probing it."""
    k = m / p.m
    arrays = p.arrays()
    return replace(p, m=m, flops=p.flops * k, act_bytes=p.act_bytes * k, live=p.live * k,
                   saved=p.saved * k, outputs=p.outputs * k,
                   transcendental=arrays["transcendental"] * k,
                   allocated=arrays["allocated"] * k)
