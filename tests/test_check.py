"""mbcompile.check: relative_error by hand, and compare_to_eager against broken "compiled" modules.

The contract under test: an error is a float in ``[0, inf]``, never NaN, so
``error <= tol`` fails for every NaN, infinity, shape mismatch or missing gradient
that eager does not share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MODELS, assert_close_errors, grad_errors

import mbcompile
from mbcompile.check import EquivalenceReport, compare_to_eager, relative_error

NAN, INF = math.nan, math.inf


def t(*values: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------- #
# relative_error, against values worked out by hand
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("got, want, expected", [
    (t(1.0, -3.0), t(1.0, -2.0), 0.5),             # |-3 - -2| / max(1, 2) = 1/2
    (t(-1.0, -5.0), t(-2.0, -4.0), 0.25),          # max(1, 1) / max(2, 4)
    (t(2.0, 4.0), t(2.0, 4.0), 0.0),               # equal
    (t(-0.0), t(0.0), 0.0),                        # signed zeros are equal
    (t(0.0, 0.5), t(0.0, 0.0), 0.5),               # want all zero: the absolute error
    (t(0.0, 0.0), t(0.0, 0.0), 0.0),               # both zero
    (torch.tensor(3.0), torch.tensor(2.0), 0.5),   # 0-dim: 1/2
    (t(1e-300, 0.0), t(0.0, 1e-300), 1.0),         # tiny but relative: 1e-300 / 1e-300
    (t(3, 5, dtype=torch.int64), t(2, 4, dtype=torch.int64), 0.25),  # 1/4, in float64
    (t(1, 2, dtype=torch.int32), t(1.0, 4.0), 0.5),                  # mixed dtypes: 2/4
    (t(True, True, dtype=torch.bool), t(True, False, dtype=torch.bool), 1.0),  # 1/1
    (t(1.0 + 1.0j, dtype=torch.complex128), t(1.0 + 0.0j, dtype=torch.complex128), 1.0),
    (t(1.5, dtype=torch.float32), t(1.0, dtype=torch.float32), 0.5),
])
def test_relative_error_by_hand(got: torch.Tensor, want: torch.Tensor, expected: float) -> None:
    assert relative_error(got, want) == pytest.approx(expected, rel=1e-15, abs=0.0)


@pytest.mark.parametrize("got, want, expected", [
    (t(NAN, 1.0), t(1.0, 1.0), INF),               # NaN in got
    (t(1.0, 1.0), t(1.0, NAN), INF),               # NaN in want only
    (t(1.0, NAN), t(NAN, 1.0), INF),               # NaNs at different places
    (t(NAN, NAN), t(1.0, 2.0), INF),               # all NaN (was reported as 0.00e+00)
    (t(INF, 1.0), t(1.0, 1.0), INF),               # inf in got
    (t(1.0, 1.0), t(1.0, -INF), INF),              # inf in want only
    (t(INF), t(-INF), INF),                        # infinities of opposite sign
    (t(NAN), t(INF), INF),                         # NaN is not inf
    (t(1e308), t(-1e308), INF),                    # finite, but the difference overflows
    (t(NAN, 2.0), t(NAN, 2.0), 0.0),               # the same NaN at the same place
    (t(NAN, 1.5), t(NAN, 1.0), 0.5),               # ... then the finite entries: 0.5 / 1
    (t(INF, -INF, 3.0), t(INF, -INF, 4.0), 0.25),  # the same infinities, then 1 / 4
    (t(NAN, NAN), t(NAN, NAN), 0.0),               # identical, if useless
])
def test_relative_error_non_finite(got: torch.Tensor, want: torch.Tensor, expected: float
                                   ) -> None:
    assert relative_error(got, want) == expected


@pytest.mark.parametrize("got, want, expected", [
    (torch.empty(0), torch.empty(0), 0.0),
    (torch.empty(0, 3), torch.empty(0, 3), 0.0),
    (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), 0.0),
    (torch.empty(0), torch.zeros(1), INF),          # empty against one zero: not the same
    (t(1.0, 1.0), t(1.0), INF),                     # broadcasting would hide this
    (torch.ones(2, 1), torch.ones(2), INF),
    (torch.ones(2, 3), torch.ones(3, 2), INF),      # same numel, other shape
])
def test_relative_error_empty_and_shapes(got: torch.Tensor, want: torch.Tensor,
                                         expected: float) -> None:
    assert relative_error(got, want) == expected


@pytest.mark.parametrize("got, want, floor, expected", [
    (t(0.002), t(0.001), 0.1, 0.01),               # 0.001 / max(0.001, 0.1)
    (t(0.002), t(0.001), 1e-6, 1.0),               # a floor below the scale changes nothing
    (t(0.5), t(0.0), 2.0, 0.25),                   # want all zero: the floor still divides
    (t(NAN), t(0.0), 1.0, INF),                    # the floor does not hide a NaN
])
def test_relative_error_floor(got: torch.Tensor, want: torch.Tensor, floor: float,
                              expected: float) -> None:
    assert relative_error(got, want, floor) == pytest.approx(expected, rel=1e-15, abs=0.0)


def test_relative_error_is_never_nan() -> None:
    specials = [0.0, -0.0, 1.0, -2.5, 1e-320, 1e308, -1e308, INF, -INF, NAN]
    for a in specials:
        for b in specials:
            for floor in (0.0, 1e-4):
                err = relative_error(t(a, 1.0), t(b, 1.0), floor)
                assert not math.isnan(err) and err >= 0.0, (a, b, floor, err)


def test_relative_error_ignores_autograd_and_leaves_inputs_alone() -> None:
    got = torch.tensor([1.0, 3.0], dtype=torch.float32, requires_grad=True)
    want = torch.tensor([1.0, 2.0], dtype=torch.float32)
    assert relative_error(got, want) == 0.5
    assert got.dtype == torch.float32 and got.requires_grad and got.grad is None


# --------------------------------------------------------------------------- #
# EquivalenceReport
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("outputs, gradients, expected", [
    (1e-12, 3e-11, 3e-11),
    (3e-11, 1e-12, 3e-11),
    (NAN, 0.0, INF),        # max(nan, 0.0) is nan, max(0.0, nan) is 0.0: neither is used
    (0.0, NAN, INF),
    (INF, 0.0, INF),
    (0.0, INF, INF),
])
def test_report_max_never_loses_a_nan_or_inf(outputs: float, gradients: float,
                                             expected: float) -> None:
    assert EquivalenceReport(outputs, gradients, "w").max_relative_error == expected


# --------------------------------------------------------------------------- #
# compare_to_eager against deliberately broken "compiled" modules
# --------------------------------------------------------------------------- #


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 8)
        self.lin2 = nn.Linear(8, 3)
        self.spare = nn.Parameter(torch.ones(2))  # unused by the eager forward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.lin2(torch.tanh(self.lin1(x)))
        return F.cross_entropy(logits, y), logits


class NanGrad(torch.autograd.Function):
    """The identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, NAN)


class Fake(nn.Module):
    """A stand-in for a compiled module: ``forward(model, x, y)`` on the model's parameters."""

    def __init__(self, model: Net, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.model, self.fn = model, forward

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.fn(self.model, x, y)


def _logits(m: Net, x: torch.Tensor, w2: torch.Tensor | None = None,
            w1: torch.Tensor | None = None) -> torch.Tensor:
    h = torch.tanh(F.linear(x, m.lin1.weight if w1 is None else w1, m.lin1.bias))
    return F.linear(h, m.lin2.weight if w2 is None else w2, m.lin2.bias)


def _with_loss(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(logits, y), logits


def _nan_in_second_row(m: Net, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss, logits = m(x, y)
    return loss, logits.detach().index_fill(0, torch.tensor([1]), NAN)


BROKEN: dict[str, tuple[Callable[..., Any], str, str]] = {
    # name: (compiled forward, worst output, worst gradient); "" where that side is exact
    "nan_loss": (lambda m, x, y: (m(x, y)[0] * NAN, m(x, y)[1]), "[0]", "lin1.weight"),
    "nan_in_second_output": (_nan_in_second_row, "[1]", ""),
    "nan_grad_in_later_param": (
        lambda m, x, y: _with_loss(_logits(m, x, w2=NanGrad.apply(m.lin2.weight)), y),
        "", "lin2.weight"),
    "nan_grad_everywhere": (lambda m, x, y: (NanGrad.apply(m(x, y)[0]), m(x, y)[1]),
                            "", "lin1.weight"),
    "inf_output": (lambda m, x, y: (m(x, y)[0], m(x, y)[1] / 0.0), "[1]", ""),
    "grad_missing_in_compiled": (
        lambda m, x, y: _with_loss(_logits(m, x, w1=m.lin1.weight.detach()), y),
        "", "lin1.weight"),
    "grad_only_in_compiled": (lambda m, x, y: (m(x, y)[0] + 0 * m.spare.sum(), m(x, y)[1]),
                              "", "spare"),
    "output_shape": (lambda m, x, y: (m(x, y)[0], m(x, y)[1][:-1]), "[1]", ""),
    "output_missing": (lambda m, x, y: (m(x, y)[0],), "[1]", ""),
    "extra_output": (lambda m, x, y: (*m(x, y), x), "[2]", ""),
}


def _net_and_batch() -> tuple[Net, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net().double(), (torch.randn(6, 5, generator=g, dtype=torch.float64),
                            torch.randint(0, 3, (6,), generator=g))


def test_compare_to_eager_on_itself_is_exact() -> None:
    model, batch = _net_and_batch()
    report = compare_to_eager(model, model, batch)
    assert report.max_relative_error == 0.0 and report.outputs == report.gradients == 0.0


@pytest.mark.parametrize("name", BROKEN)
def test_compare_to_eager_reports_a_broken_compiled_module(name: str) -> None:
    forward, worst_output, worst_gradient = BROKEN[name]
    model, batch = _net_and_batch()
    report = compare_to_eager(model, Fake(model, forward), batch)
    assert not report.max_relative_error <= 1e-10, report
    assert report.max_relative_error == INF
    assert (report.outputs == INF) == bool(worst_output), report
    assert (report.gradients == INF) == bool(worst_gradient), report
    if worst_output:
        assert report.worst_output == worst_output and worst_output in str(report)
    if worst_gradient:
        assert report.worst_gradient == worst_gradient and worst_gradient in str(report)
    assert "inf" in str(report)


def test_compare_to_eager_restores_the_users_grads() -> None:
    model, batch = _net_and_batch()
    before = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = before[n].clone()
    compare_to_eager(model, Fake(model, BROKEN["nan_loss"][0]), batch)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n


def test_compare_to_eager_passes_a_real_compiled_module() -> None:
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    report = compare_to_eager(model, cm, batch)
    assert report.max_relative_error <= 1e-10, report


# --------------------------------------------------------------------------- #
# The tests' own helpers (models.py) fail on the same things
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("errors", [
    {"a": 0.0, "b": NAN},           # NaN after the first: max() would keep 0.0
    {"a": NAN, "b": 0.0},
    {"a": 0.0, "b": 1e-12, "c": INF},
    {"a": 0.0, "b": 1e-3},
])
def test_assert_close_errors_fails_and_names_the_offender(errors: dict[str, float]) -> None:
    bad = [k for k, v in errors.items() if not v <= 1e-10]
    with pytest.raises(AssertionError) as info:
        assert_close_errors(errors, 1e-10)
    assert all(f"'{k}'" in str(info.value) for k in bad)
    assert all(f"'{k}'" not in str(info.value) for k in errors if k not in bad)


def test_assert_close_errors_passes_and_refuses_nothing_compared() -> None:
    assert_close_errors({"a": 0.0, "b": 1e-10}, 1e-10)
    with pytest.raises(AssertionError, match="nothing"):
        assert_close_errors({}, 1e-10)


def test_grad_errors_missing_nan_and_floor() -> None:
    w = t(1.0, 2.0)
    want = {"w": w, "frozen": None, "tiny": t(1e-9), "lost": t(1.0), "new": None}
    got = {"w": t(NAN, 2.0), "frozen": None, "tiny": t(2e-9), "lost": None, "new": t(0.0)}
    assert grad_errors(got, want) == pytest.approx({"w": INF, "tiny": 1.0, "lost": INF, "new": INF})
    floored = grad_errors(got, want, floor=1e-4)  # 1e-9 / max(1e-9, 1e-4 * 2)
    assert floored["tiny"] == pytest.approx(1e-9 / 2e-4, rel=1e-12)
