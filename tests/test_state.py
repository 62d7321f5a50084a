"""State a call leaves behind ends as after one eager full-batch step, or is refused.

Buffers updated in place are the classic silent-wrong case of microbatching: an
EMA of the batch mean (DINO's centre) updated once per microbatch ends somewhere
else than the full batch's update. The capture functionalizes the writes and the
state-updates pass returns the new values as outputs, so a batch-free update (a
step counter, an EMA teacher) is computed once, a linear function of batch means
once from the global sums, a per-sample write concatenated in order; the compiled
module writes them back once, after the step. What needs the batch in another way
is refused with a ``MixingError``; nothing is ever split silently.
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


class EmaTeacher(nn.Module):
    """A teacher updated as an EMA of the student's weights (batch-free, once per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Linear(4, 3)
        self.register_buffer("teacher_w", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.student(x) + x @ self.teacher_w.T, y)
        with torch.no_grad():
            self.teacher_w.mul_(0.99).add_(0.01 * self.student.weight)
        return loss


class InputScaledInPlace(nn.Module):
    """Mutates its (per-sample) input in place: the caller sees it as after eager."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        return F.mse_loss(self.lin(x), y)


class BatchQueue(nn.Module):
    """A MoCo-style queue: the batch's keys pushed in front of the old ones."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("queue", torch.zeros(10, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        with torch.no_grad():
            self.queue.copy_(torch.cat([h, self.queue])[: self.queue.shape[0]])
        return F.mse_loss(h, y)


PLANS = [(7, 2, 2), (7, 3, 1), (5, 1, 2)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "gbs{}-csx{}-mbs{}".format(*p))
@pytest.mark.parametrize("cls", [NoGradCentre, DetachedCentre, EmaTeacher, Counter],
                         ids=lambda c: c.__name__)
def test_state_ends_as_after_one_eager_step(cls, plan):
    torch.manual_seed(0)
    model, batch = cls().to(DTYPE), _batch(plan[0])
    want = _eager_state(model, batch)
    cm = mbcompile.compile(model, *plan, example_inputs=batch)
    assert cm.plan.num_nonempty_microbatches > 1
    assert cm.analysis.fused  # the state's batch mean is no second trained loss
    loss = cm(*batch)
    loss.backward()
    _assert_state(model, want)
    assert all(not b.requires_grad for b in model.buffers())  # state carries no gradient


def test_an_input_mutated_in_place_ends_as_after_eager():
    torch.manual_seed(0)
    model = InputScaledInPlace().to(DTYPE)
    x, y = _batch()
    want_x = x.clone()
    copy.deepcopy(model)(want_x, y)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(x.clone(), y))
    cm(x, y).backward()
    assert torch.equal(x, want_x)


def test_a_queue_of_the_batch_is_exact_or_refused_never_silent():
    torch.manual_seed(0)
    model, batch = BatchQueue().to(DTYPE), _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = _eager_state(model, batch)
    try:
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    except mbcompile.MixingError as exc:  # refused, naming why, with nothing changed
        assert "cannot be microbatched" in str(exc)
        _assert_state(model, before)
        return
    cm(*batch).backward()
    _assert_state(model, want)


@pytest.mark.parametrize("cls", [NoGradCentre, DetachedCentre, Counter, EmaTeacher],
                         ids=lambda c: c.__name__)
def test_unsplit_runs_every_update_once(cls):
    torch.manual_seed(0)
    model, batch = cls().to(DTYPE), _batch()
    want = _eager_state(model, batch)
    cm = mbcompile.compile(model, 7, 1, "none", example_inputs=batch)
    cm(*batch).backward()
    _assert_state(model, want)


class InPlaceIntermediate(nn.Module):
    """In-place ops on intermediate values (``masked_fill_``, ``+=``, ``div_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.masked_fill_(h > 1, 1.0)
        h += 0.5
        h.div_(2.0)
        return F.mse_loss(h, y)


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "gbs{}-csx{}-mbs{}".format(*p))
def test_in_place_ops_are_functionalized_not_rejected(plan):
    torch.manual_seed(0)
    model, batch = InPlaceIntermediate().to(DTYPE), _batch(plan[0])
    ref = copy.deepcopy(model)
    want = ref(*batch)
    want.backward()
    cm = mbcompile.compile(model, *plan, example_inputs=batch)
    got = cm(*batch)
    got.backward()
    assert mbcompile.check.relative_error(got, want) <= 1e-12
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert mbcompile.check.relative_error(p.grad, q.grad) <= 1e-12, name



@pytest.mark.slow  # spawns two ranks
def test_state_on_ranks_ends_as_after_one_eager_step(tmp_path):
    import dist_workers
    from test_distributed import _run

    _run(dist_workers.state_step, 2, str(tmp_path), 7, 2)
    torch.manual_seed(0)
    model = NoGradCentre().to(DTYPE)
    want = _eager_state(model, _batch(7))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for k, v in got.items():
            assert torch.allclose(v, want[k], rtol=1e-12, atol=0), (rank, k)
