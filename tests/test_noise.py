"""Gradient noise scale from the microbatches: closed-form truth, MBS-independence, cost-free."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.check import compare_to_eager
from mbcompile.execution.noise import NoiseScale, estimate_noise_scale
from mbcompile.models import make_tiny_gpt

D, SIGMA, GBS = 8, 0.5, 256


class LinearRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(D, 1, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((self.w(x).squeeze(-1) - y) ** 2).mean()


def _problem(seed: int = 0):
    """y = x·w* + N(0, σ²), x ~ N(0, I), at weights w = w* + δ.

    Per-sample gradient g = x (x·δ - ε): G = E[g] = δ, and
    tr(Σ) = E|g|² - |G|² = (D + 2)|δ|² + Dσ² - |δ|² = (D + 1)|δ|² + Dσ².
    """
    g = torch.Generator().manual_seed(seed)
    model = LinearRegression().double()
    w_star = torch.randn(D, generator=g, dtype=torch.float64)
    delta = 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    with torch.no_grad():
        model.w.weight.copy_(w_star + delta)
    trace = (D + 1) * delta.dot(delta).item() + D * SIGMA**2
    return model, w_star, trace, delta.dot(delta).item()


def _measure(mbs: int, steps: int = 150, seed: int = 1) -> NoiseScale:
    model, w_star, _, _ = _problem()
    g = torch.Generator().manual_seed(seed)
    example = (torch.zeros(GBS, D, dtype=torch.float64), torch.zeros(GBS, dtype=torch.float64))
    cm = mbcompile.compile(model, GBS, 2, mbs, example_inputs=example,
                           measure_noise_scale=NoiseScale(decay=0.98))
    for _ in range(steps):
        x = torch.randn(GBS, D, generator=g, dtype=torch.float64)
        y = x @ w_star + SIGMA * torch.randn(GBS, generator=g, dtype=torch.float64)
        cm(x, y).backward()
        model.zero_grad()  # no optimizer step: the true values stay fixed
    return cm.noise_scale


def test_estimate_matches_closed_form():
    _, _, trace, norm_sq = _problem()
    ns = _measure(mbs=16)
    assert ns.steps == 150
    assert ns.trace_sigma == pytest.approx(trace, rel=0.10)
    assert ns.grad_norm_sq == pytest.approx(norm_sq, rel=0.10)
    assert ns.b_simple == pytest.approx(trace / norm_sq, rel=0.10)
    low, high = ns.spread()
    assert low <= trace / norm_sq * 1.1 and high >= trace / norm_sq * 0.9


def test_estimate_does_not_depend_on_mbs():
    small, large = _measure(mbs=4), _measure(mbs=32)
    assert small.b_simple == pytest.approx(large.b_simple, rel=0.10)


def test_estimator_algebra_on_exact_expectations():
    # E|G_B|² = |G|² + tr/B exactly: the estimator must return tr and |G|² back.
    trace, norm_sq, sizes = 5.0, 2.0, [3, 4, 4, 5]
    n = sum(sizes)
    small = [(norm_sq + trace / b) * b**2 for b in sizes]  # |g_m|² of summed losses
    big = (norm_sq + trace * sum(1 / b for b in sizes) / len(sizes)
           - trace * (sum(1 / b for b in sizes) / len(sizes) - 1 / n)) * n**2
    est = estimate_noise_scale(small, sizes, big, n)
    assert est.trace_sigma == pytest.approx(trace)
    assert est.grad_norm_sq == pytest.approx(norm_sq)
    assert estimate_noise_scale(small[:1], sizes[:1], big, n) is None  # one microbatch


def test_measuring_keeps_the_step_exact_and_logs_a_positive_scale_on_tiny_gpt():
    model, batch = make_tiny_gpt(12, dtype=torch.float64)
    cm = mbcompile.compile(model, 12, 2, 2, example_inputs=batch, measure_noise_scale=True)
    report = compare_to_eager(model, cm, batch)
    assert report.max_relative_error <= 1e-10
    for _ in range(3):
        loss, _ = cm(*batch)
        loss.backward()
    assert cm.noise_scale.steps == 4
    assert math.isfinite(cm.noise_scale.b_simple) and cm.noise_scale.b_simple > 0


def test_trainer_monitor_logs_a_positive_scale_and_advice(capsys):
    from mbcompile.training.monitors import NoiseScaleMonitor

    model, batch = make_tiny_gpt(16)
    monitor = NoiseScaleMonitor(unit="tokens")
    trainer = mbcompile.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), gbs=16,
                                num_csx=2, callbacks=[mbcompile.GlobalFlags(micro_batch_size=2),
                                                      monitor], progress=False)
    trainer.fit([batch], max_steps=3)
    values = [row["b_simple"] for row in trainer.history if row["phase"] == "train"]
    assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values)
    out = capsys.readouterr().out
    assert "critical batch size (B_simple)" in out and "tokens" in out


def test_report_gives_tokens_and_the_critical_batch_size():
    model, batch = make_tiny_gpt(16)
    cm = mbcompile.compile(model, 16, 2, 2, example_inputs=batch, measure_noise_scale=True)
    for _ in range(2):
        loss, _ = cm(*batch)
        loss.backward()
    text = str(cm.report())
    assert "critical batch size (B_simple)" in text and "tokens: 16 per sample" in text
    data = cm.report().to_dict()
    assert data["noise_scale"]["steps"] == 2
    assert data["tokens"]["counted_last_step"]["global"] == (batch[1] != -100).sum().item()
