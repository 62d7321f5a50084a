"""Quantization-aware training (torch.ao's ``prepare_qat``) is exact or refused.

A QAT layer (``torch.ao.nn.qat.Linear``) runs another forward than the ``nn.Linear`` whose
batch rule it inherited: it fake-quantizes its weight, and the weight's observer moves its
moving averages in place, once per call. Kept whole under torch.fx with the plain layer's
rule, it ran per microbatch: the averages moved 4 times a step (loss 1.1934 against 1.1923
at step 4; found by a hunt). Such a layer is traced into now, and the observer's fused
kernel, whose in-place writes fx cannot see, is refused under fx by name; ``capture="auto"``
then takes torch.export, whose graph writes the observer's state once per step. An
observer of activations sees the whole batch: refused under both.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.ao.quantization as quant
import torch.nn as nn
import torch.nn.functional as F

import mbcompile


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.o(torch.tanh(self.a(x))), y)


def _prepared(weight_only: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net().train()
    weights = quant.QConfig(activation=nn.Identity, weight=quant.default_fused_wt_fake_quant)
    model.qconfig = weights if weight_only else quant.get_default_qat_qconfig("x86")
    return quant.prepare_qat(model)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(7, 6, generator=g), torch.randint(0, 3, (7,), generator=g)


def test_weight_only_qat_trains_as_eager_over_steps():
    model = _prepared(weight_only=True)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(0), cost_model=False)
    opts = [torch.optim.SGD(m.parameters(), lr=1.0) for m in (model, eager)]
    for step in range(4):  # the averages differ from step 2 on where they move per microbatch
        got, want = cm(*_batch(step)), eager(*_batch(step))
        got.backward()
        want.backward()
        assert torch.allclose(got, want, rtol=1e-6), step
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), step
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for b, c in zip(model.buffers(), eager.buffers()):
            assert torch.allclose(b.double(), c.double(), rtol=1e-6), step


@pytest.mark.parametrize("weight_only", [True, False], ids=["weights", "activations"])
def test_fx_refuses_the_observer_kernel_by_name_and_changes_nothing(weight_only):
    model = _prepared(weight_only)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.CaptureError, match="fused_moving_avg_obs_fake_quant"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(0), capture="fx",
                          cost_model=False)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_observers_of_activations_are_refused_under_auto():
    model = _prepared(weight_only=False)
    with pytest.raises(mbcompile.MbcompileError):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(0), cost_model=False)
