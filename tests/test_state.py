"""State a call leaves behind ends as after one eager full-batch step, or is refused.

Buffers updated in place are the classic silent-wrong case of microbatching: an
EMA of the batch mean (DINO's centre) updated once per microbatch ends somewhere
else than the full batch's update. mbcompile must either apply such an update
exactly as eager does or reject the split with a ``MixingError`` that names the op;
run unsplit (``num_csx=1, mbs="none"``) the update must still happen, once.
A batch-free update (a step counter) happens once per call, not once per microbatch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

DTYPE = torch.float64


class NoGradCentre(nn.Module):
    """DINO's teacher centring: an EMA of the batch mean under torch.no_grad()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("center", torch.zeros(3))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        loss = F.mse_loss(h - self.center, y)
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * h.mean(0))
            self.steps.add_(1)
        return loss


class DetachedCentre(nn.Module):
    """The same update written with detach() instead of no_grad()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("center", torch.zeros(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        loss = F.mse_loss(h - self.center, y)
        self.center.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return loss


class Counter(nn.Module):
    """A batch-free buffer update: a step counter, once per call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return F.mse_loss(self.lin(x), y)


def _batch(n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g, dtype=DTYPE), torch.randn(n, 3, generator=g, dtype=DTYPE)


def _eager_state(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    ref(*batch).backward()
    return {k: v.clone() for k, v in ref.state_dict().items()}


def _assert_state(model: nn.Module, want: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.allclose(v, want[k], rtol=1e-12, atol=0), (k, v, want[k])


@pytest.mark.parametrize("cls", [NoGradCentre, DetachedCentre], ids=lambda c: c.__name__)
def test_an_update_from_a_batch_mean_is_never_split_silently(cls):
    torch.manual_seed(0)
    model, batch = cls().to(DTYPE), _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = _eager_state(model, batch)
    try:
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    except mbcompile.MixingError as exc:  # refused, with the op named and nothing changed
        assert "cannot be microbatched" in str(exc)
        _assert_state(model, before)
        return
    cm(*batch).backward()
    _assert_state(model, want)  # or exact


@pytest.mark.parametrize("cls", [NoGradCentre, DetachedCentre, Counter],
                         ids=lambda c: c.__name__)
def test_unsplit_runs_every_update_once(cls):
    torch.manual_seed(0)
    model, batch = cls().to(DTYPE), _batch()
    want = _eager_state(model, batch)
    cm = mbcompile.compile(model, 7, 1, "none", example_inputs=batch)
    cm(*batch).backward()
    _assert_state(model, want)


@pytest.mark.parametrize("plan", [(7, 2, 2), (7, 3, 1), (8, 1, 2)])
def test_a_batch_free_update_happens_once_per_call(plan):
    torch.manual_seed(0)
    model, batch = Counter().to(DTYPE), _batch(plan[0])
    want = _eager_state(model, batch)
    cm = mbcompile.compile(model, *plan, example_inputs=batch)
    assert cm.plan.num_nonempty_microbatches > 1
    cm(*batch).backward()
    _assert_state(model, want)
    assert int(model.steps) == 1
