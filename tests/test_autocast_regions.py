"""Forward's own autocast regions under a call's outer autocast (``passes/autocast_regions.py``).

Found by a hunt: a float32 loss region (``with torch.autocast("cpu", enabled=False)``, or a
method decorated with it) or a float16 block, called under an outer bfloat16 autocast,
ran in bfloat16: loss 1.538868 against eager's 1.538704, gradients 9e-3 apart, float32
logits returned as bfloat16, silently. Such a call is now refused before anything runs,
naming the region and the fix; the fix it names (the outer autocast inside forward, a
wrapper compiled in the model's place) runs as eager does under the autocast.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

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


class AsksFirst(Float32Loss):
    """transformers' ``maybe_autocast``: a region entered only when an autocast is on."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.l1(x))
        region = torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") \
            else contextlib.nullcontext()
        with region:
            logits = self.l2(h.float())
        return F.cross_entropy(logits, y), logits


class InEvalOnly(Float32Loss):
    """A float32 head in eval mode only: the region is met by the eval mode's capture."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.l1(x))
        with torch.autocast("cpu", enabled=self.training):
            logits = self.l2(h.float())
        return F.cross_entropy(logits, y), logits


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


def _compiled(model: nn.Module) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_data(),
                                 cost_model=False)


@pytest.mark.parametrize("cls", [Float32Loss, Decorated, Float16Block, AsksFirst])
def test_a_call_under_an_outer_autocast_is_refused_naming_the_region(cls: type) -> None:
    model, eager = _pair(cls)
    cm = _compiled(model)
    with pytest.raises(mbcompile.MbcompileError, match="forward (enters|asks)") as err:
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


def test_a_region_met_in_another_mode_is_refused_there() -> None:
    model, eager = _pair(InEvalOnly)
    cm = _compiled(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = cm(*_data()), eager(*_data())  # training: the region is the outer's
            assert torch.equal(got[1], want[1])
            cm.eval()
            eager.eval()
            with torch.no_grad(), pytest.raises(mbcompile.MbcompileError, match="enabled=False"):
                cm(*_data())


class OwnBfloat16(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(self.layer(x).float(), y)


def test_a_region_that_sets_what_the_outer_autocast_sets_runs_as_eager() -> None:
    """A model that autocasts itself, called under the same autocast (the HF Trainer's
    ``bf16=True``): the region changes nothing there, in eager and in the step alike."""
    model, eager = _pair(OwnBfloat16)
    cm = _compiled(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = cm(*_data()), eager(*_data())
    assert got.dtype == want.dtype and torch.allclose(got, want, rtol=1e-6)
