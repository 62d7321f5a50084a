"""A torch layer's setting written inside forward (a distillation wrapper's
``self.teacher.eval()``, ``self.drop.p = 0``, ``bn.momentum = ...``).

torch.fx replays the Python writes forward makes after the step, but a torch layer kept
as one call reads its settings when it runs, inside the step: the first step ran the
teacher's BatchNorm in training mode where eager's ran it in eval (loss 1.6907 against
1.7258, gradients 0.40 off, the running statistics overwritten for good; found by a
hunt). fx refuses such a write by name; ``capture="auto"`` takes torch.export, which
traces the layer with the setting forward made: eager's, step after step.
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


class Distilled(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.teacher = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.teacher.requires_grad_(False)
        self.student = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.GroupNorm(2, 8), nn.ReLU())
        self.head, self.drop = nn.Linear(8, 5), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.how == "eval":
            self.teacher.eval()  # so that model.train() cannot switch it back
        else:
            self.drop.p = 0.0
        with torch.no_grad():
            target = self.teacher(x).mean((2, 3))
        h = self.drop(self.student(x).mean((2, 3)))
        return F.cross_entropy(self.head(h), y) + F.mse_loss(h, target)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(7, 3, 8, 8, generator=g, dtype=DTYPE), torch.randint(0, 5, (7,),
                                                                             generator=g)


@pytest.mark.parametrize("how", ["eval", "dropout_p"])
def test_fx_refuses_a_layer_setting_written_in_forward_and_changes_nothing(how):
    torch.manual_seed(0)
    model = Distilled(how).to(DTYPE)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.CaptureError, match="a layer's setting.*outside forward"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(0), capture="fx",
                          cost_model=False)
    assert model.teacher.training and model.drop.p == 0.5
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("how", ["eval", "dropout_p"])
def test_auto_takes_export_and_trains_as_eager(how):
    torch.manual_seed(0)
    model = Distilled(how).to(DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(0), cost_model=False)
        for step in range(2):
            errors = step_errors(model, cm, _batch(step), floor=1e-6)
            assert_close_errors(errors, 1e-10)
            with torch.no_grad():  # a step: the next one starts from other weights
                for p in model.parameters():
                    if p.grad is not None:
                        p -= 0.1 * p.grad
    if how == "eval":
        assert not model.teacher.training and int(model.teacher[1].num_batches_tracked) == 0
    else:
        assert model.drop.p == 0.0
