"""How a two-phase plan is chosen: its modelled memory (one microbatch of P, the frontier and
C at the whole batch) must fit the system, or the rejection says why with the numbers."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.check import relative_error
from mbcompile.errors import TwoPhaseWarning
from mbcompile.planning.systems import get_system

GBS = 64


class EarlyBatchNorm(nn.Module):
    """BatchNorm right after the input: C is nearly the whole network (wide layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 256)
        self.bn = nn.BatchNorm1d(256)
        self.body = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                  nn.Linear(512, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(self.bn(self.inp(x))), y)


class LateContrast(nn.Module):
    """A wide per-sample encoder and a small contrastive loss: C is small."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                 nn.Linear(512, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.enc(x), dim=-1)
        return F.cross_entropy(z @ z.T / 0.1, torch.arange(x.size(0)))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(GBS, 8), torch.randint(0, 3, (GBS,))


def _peaks(model: nn.Module) -> tuple[float, float]:
    """(two-phase peak at mbs 1, what F and C at the whole batch add to it) on the host."""
    cm = mbcompile.compile(model, GBS, 1, 1, example_inputs=_batch(), coupling="two_phase",
                           compile_only=True)
    mem = cm.estimate.memory
    return mem.peak, mem.frontier + mem.coupled


def test_a_fitting_two_phase_plan_says_so_in_its_reason():
    torch.manual_seed(0)
    model = LateContrast()
    cm = mbcompile.compile(model, GBS, 1, 8, example_inputs=_batch(), coupling="two_phase")
    mem = cm.estimate.memory
    assert mem.frontier > 0 and mem.coupled > 0
    assert mem.peak == pytest.approx(mem.static + mem.inputs + mem.outputs + mem.activations
                                     + mem.update + mem.frontier + mem.coupled)
    assert "two-phase" in cm.plan.reason and "frontier" in cm.plan.reason
    assert cm.estimate.time.extra_forward > 0 and cm.estimate.time.coupled > 0
    # and the step is the full batch's
    ref = copy.deepcopy(model)
    cm(*_batch()).backward()
    ref(*_batch()).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-5  # float32


def test_coupled_part_that_does_not_fit_is_rejected_with_the_numbers():
    torch.manual_seed(0)
    model = EarlyBatchNorm()
    with pytest.warns(TwoPhaseWarning, match="saves little"):
        peak, whole_batch = _peaks(model)
    host = get_system("host")
    # room for one microbatch of P and the rest, not for F and C at the whole batch
    small = replace(host, name="small", memory_bytes=peak - whole_batch / 2)
    with pytest.raises(mbcompile.MixingError) as raised:
        mbcompile.compile(model, GBS, 1, 8, example_inputs=_batch(), coupling="two_phase",
                          system=small)
    text = str(raised.value)
    assert "BatchNorm" in text and "two-phase step would run it exactly" in text
    assert "does not fit small" in text and "plain split would need" in text
    assert raised.value.two_phase_peak > raised.value.capacity == small.memory_bytes
    assert raised.value.two_phase_peak == pytest.approx(peak)
    # with the memory it needs, the same model compiles, and says C dominates
    roomy = replace(host, name="roomy", memory_bytes=peak * 1.5)
    with pytest.warns(TwoPhaseWarning):
        cm = mbcompile.compile(model, GBS, 1, 8, example_inputs=_batch(), coupling="two_phase",
                               system=roomy)
    assert any("saves little" in w for w in cm.plan.warnings)


def test_coupling_reject_keeps_the_strict_error():
    with pytest.raises(mbcompile.MixingError, match="cannot be microbatched"):
        mbcompile.compile(LateContrast(), GBS, 1, 8, example_inputs=_batch(), coupling="reject")
    with pytest.raises(mbcompile.InputError, match="coupling must be one of"):
        mbcompile.compile(LateContrast(), GBS, 1, 8, example_inputs=_batch(), coupling="yes")


@pytest.mark.parametrize("batch", [GBS // 4, 2 * GBS])
def test_a_batch_of_another_size_sizes_the_frontier_and_coupled_part_at_its_own_batch(batch):
    """A short last batch or a larger one (``batch_sizes="any"``) reuses the analysis of
    the example's batch; its two-phase memory is sized at the call's batch, as a compile for
    that batch sizes it (the frontier was the example's: a larger batch under-counted)."""
    torch.manual_seed(0)
    model = LateContrast()
    cm = mbcompile.compile(model, GBS, 1, 8, example_inputs=_batch(), coupling="two_phase")
    x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
    with pytest.warns(mbcompile.BatchSizeWarning):
        cm(x, y).backward()
    fresh = mbcompile.compile(copy.deepcopy(model), batch, 1, 8, example_inputs=(x, y),
                              coupling="two_phase")
    got, want = cm.estimate.memory, fresh.estimate.memory
    assert cm.plan.gbs == batch and got.frontier > 0
    assert got.frontier == pytest.approx(want.frontier)
    assert got.coupled == pytest.approx(want.coupled)
