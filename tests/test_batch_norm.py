"""BatchNorm in training: a two-phase step by default, per-microbatch statistics on request.

The default keeps the product's promise (a split never changes the result): a
BatchNorm in training mode runs as a two-phase step, normalised by the whole batch's
statistics, exactly as eager; ``coupling="reject"`` makes it a ``MixingError``.
``batch_norm="per_microbatch"``
is the explicit opt-in to what a hand-written loop computes: each microbatch
normalised by its own statistics, running statistics updated once per microbatch,
in order. It warns, and says so in ``plan.warnings``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_close_errors, step_errors

import mbcompile

DTYPE = torch.float64


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return F.cross_entropy(self.fc(h), y, reduction="sum")


def _case(n: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return ConvBN().to(DTYPE), (torch.randn(n, 3, 6, 6, generator=g, dtype=DTYPE),
                                torch.randint(0, 5, (n,), generator=g))


def _hand_loop(model: nn.Module, batch: tuple[torch.Tensor, ...],
               plan: mbcompile.MicrobatchPlan) -> nn.Module:
    """What users write: one forward and backward per microbatch, in the plan's order."""
    ref = copy.deepcopy(model)
    x, y = batch
    start = 0
    for size in (s for system in plan.microbatch_sizes for s in system):
        if size:
            ref(x[start:start + size], y[start:start + size]).backward()
        start += size
    return ref


def test_strict_coupling_rejects_batch_norm_in_training():
    model, batch = _case(7)
    with pytest.raises(mbcompile.MixingError, match="BatchNorm2d"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, coupling="reject")


def test_the_default_runs_batch_norm_in_training_as_a_two_phase_step():
    """Microbatches 2, 2 | 2, 1: the loss, every gradient and the running statistics (one
    update, from the whole batch: num_batches_tracked 1) equal one eager full-batch step."""
    model, batch = _case(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # C's share of memory
        warnings.simplefilter("error", mbcompile.PerMicrobatchStatisticsWarning)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
        assert "two-phase step" in cm.plan.reason
        errors = step_errors(model, cm, batch, floor=1e-4)  # conv.bias: zero up to rounding
    assert_close_errors(errors, 1e-10)
    assert int(model.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("plan_args", [(7, 2, 2), (9, 3, 2), (6, 1, 4)])
def test_per_microbatch_equals_a_hand_written_loop(plan_args):
    model, batch = _case(plan_args[0])
    with pytest.warns(mbcompile.PerMicrobatchStatisticsWarning):
        cm = mbcompile.compile(model, *plan_args, example_inputs=batch,
                               batch_norm="per_microbatch")
    assert any("per_microbatch" in w for w in cm.plan.warnings)
    ref = _hand_loop(model, batch, cm.plan)
    cm(*batch).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.allclose(b.double(), c.double(), rtol=1e-12, atol=1e-14), name
    assert int(model.bn.num_batches_tracked) == cm.plan.num_nonempty_microbatches


def test_per_microbatch_leaves_the_rule_table_and_eval_mode_alone():
    model, batch = _case(7)
    model.eval()  # running statistics: per-sample anyway, nothing to warn about
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.PerMicrobatchStatisticsWarning)
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch,
                               batch_norm="per_microbatch")
    assert not any("per_microbatch" in w for w in cm.plan.warnings)
    model.train()  # the opt-in holds when the module recompiles for training...
    ref = _hand_loop(model, batch, cm.plan)
    cm(*batch).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), name
    with pytest.raises(mbcompile.MixingError):  # ...and only for modules compiled with it
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, coupling="reject")


def test_bad_batch_norm_value_is_an_input_error():
    model, batch = _case(7)
    with pytest.raises(mbcompile.InputError, match="per_microbatch"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=batch, batch_norm="micro")
