"""Forward's own autocast regions under a call's outer autocast (``passes/autocast_regions.py``).

Found by a hunt: a float32 loss region (``with torch.autocast("cpu", enabled=False)``, or a
method decorated with it) or a float16 block, called under an outer bfloat16 autocast,
ran in bfloat16: loss 1.538868 against eager's 1.538704, gradients 9e-3 apart, float32
logits returned as bfloat16, silently. Such a call is now refused before anything runs,
naming the region and the fix; the fix it names (the outer autocast inside forward, a
wrapper compiled in the model's place) runs as eager does under the autocast.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.models import make_tiny_gpt

GBS, NUM_CSX, MBS = 8, 2, 2


class Float32Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.l1(x))
        with torch.autocast("cpu", enabled=False):
            logits = self.l2(h.float())
            return F.cross_entropy(logits, y), logits


class Decorated(Float32Loss):
    @torch.autocast("cpu", enabled=False)
    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.l2(h.float())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.l1(x)))
        return F.cross_entropy(logits, y), logits


class Float16Block(Float32Loss):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.float16):
            logits = self.l2(torch.relu(self.l1(x)))
        return F.cross_entropy(logits.float(), y), logits


class UnderAutocast(nn.Module):
    """The fix the refusal names: the outer autocast inside forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x, y)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GBS, 16, generator=g), torch.randint(0, 5, (GBS,), generator=g)


def _pair(cls: type) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = cls()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("cls", [Float32Loss, Decorated, Float16Block])
def test_a_call_under_an_outer_autocast_is_refused_naming_the_region(cls: type) -> None:
    model, eager = _pair(cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_data(),
                               cost_model=False)
    with pytest.raises(mbcompile.MbcompileError, match="autocast regions of its own") as err:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(*_data())
    assert "test_autocast_regions.py" in str(err.value) and "Fix:" in str(err.value)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    got, want = cm(*_data()), eager(*_data())  # without the outer autocast: eager's
    assert got[1].dtype == want[1].dtype
    assert torch.allclose(got[0], want[0], rtol=1e-6) and torch.allclose(got[1], want[1],
                                                                          atol=1e-6)


@pytest.mark.parametrize("cls", [Float32Loss, Float16Block])
def test_the_fix_it_names_runs_as_eager_under_the_autocast(cls: type) -> None:
    model, eager = _pair(cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(UnderAutocast(model), GBS, NUM_CSX, MBS, example_inputs=_data(),
                               cost_model=False)
        loss, logits = cm(*_data())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_logits = eager(*_data())
    assert logits.dtype == want_logits.dtype and torch.equal(logits, want_logits)
    assert torch.allclose(loss, want_loss, rtol=1e-6)
    loss.backward()
    want_loss.backward()
    for p, q in zip(model.parameters(), eager.parameters()):  # microbatches' rounding alone
        assert torch.allclose(p.grad, q.grad, rtol=0.05, atol=2e-3)


def test_a_model_without_regions_of_its_own_runs_under_an_outer_autocast() -> None:
    model, (ids, labels) = make_tiny_gpt(batch=6)
    eager = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 6, 2, 2, example_inputs=(ids, labels), cost_model=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = cm(ids, labels), eager(ids, labels)
    assert torch.equal(got[0], want[0]) and got[1].dtype == want[1].dtype == torch.bfloat16
