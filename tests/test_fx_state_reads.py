"""What forward computes from the model's state or draws from nothing traced, under torch.fx.

fx runs a call that takes no traced value at trace time, and keeps its result as a
constant of the graph. For the model's buffers that froze them: a class-balanced loss whose
weights the loop re-estimates each epoch (``self.class_w / self.class_w.mean()``) kept the
weights of compile time (gradient relative error 1.17 at the second epoch), and a memory
bank read as ``self.bank.clone()`` before forward wrote it read the bank of compile time.
A draw that reads no traced value (mixup's ``lam`` from ``Beta(a, b).sample()``,
``torch.bernoulli(p)`` of a constant) was drawn once, at compile, and every step reused
it; under export ``torch._standard_gamma`` and ``torch.binomial`` were drawn once per
microbatch. Now each is a node of the graph (drawn once per step, before the loop, as eager
draws it); a draw into a tensor forward made (``torch.empty(()).uniform_()``) is refused
under fx, and ``"auto"`` takes it with export. A buffer's or parameter's value read into
Python (``if self.flag:``, ``self.scale.item()``) is refused by name: fx would keep the
value of compile time. Compared with eager on a deep copy made before compile, float64,
gbs 7 over 2 systems at mbs 2, over three steps with the state changed between them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributions as D
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, plan_free, step_errors

import mbcompile

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py

GBS, SYSTEMS, MBS = 7, 2, 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GBS, 5, generator=g), torch.randint(0, 3, (GBS,), generator=g)


class ClassBalanced(nn.Module):
    """Cross-entropy weighted by class weights the training loop re-estimates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 3)
        self.register_buffer("class_w", torch.ones(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w = self.class_w / self.class_w.mean()  # reads the buffer alone
        return F.cross_entropy(self.net(x), y, weight=w)


class Centroids(nn.Module):
    """Distances to normalised centroids the loop moves (k-means style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 4)
        self.register_buffer("centroids", torch.randn(3, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(self.net(x), dim=1) @ F.normalize(self.centroids, dim=1).T
        return F.cross_entropy(logits * 5, y)


class MemoryBank(nn.Module):
    """Reads a copy of its bank, then writes the batch's mean into it (MoCo's queue)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(5, 4)
        self.register_buffer("bank", torch.randn(6, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q = self.net(x)
        negatives = self.bank.clone().detach()
        loss = F.cross_entropy(torch.cat([q[:, :3], q @ negatives.T], 1), y)
        with torch.no_grad():
            self.bank.copy_(torch.roll(self.bank, 1, 0))
            self.bank.index_copy_(0, torch.zeros(1, dtype=torch.long), q.mean(0, keepdim=True))
        return loss


def _moved(model: nn.Module, step: int) -> None:
    """What the loop changes between steps, in place (the same on both copies)."""
    with torch.no_grad():
        if isinstance(model, ClassBalanced):
            model.class_w.copy_(torch.tensor([1.0, 2.0 + step, 0.5]))
        elif isinstance(model, Centroids):
            model.centroids.mul_(0.5).add_(step)


def _compare(make: Callable[[], nn.Module], capture: str, steps: int = 3
             ) -> mbcompile.CompiledModule:
    """``steps`` steps of ``make()`` compiled against eager (``step_errors``, from
    ``torch.manual_seed(10 + step)``), the global generator where eager's leaves it, and
    the state moved by the loop between them (``_moved``)."""
    torch.manual_seed(0)
    model = make()
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(),
                           **plan_free(MBS, capture=capture))
    for step in range(steps):
        after: list[torch.Tensor] = []
        assert_close_errors(step_errors(model, cm, _batch(), seed=10 + step, after=after), TOL)
        assert torch.equal(*after), step  # the step drew as eager's did
        _moved(model, step)
    return cm


@pytest.mark.parametrize("capture", ["fx", "auto"])
@pytest.mark.parametrize("make", [ClassBalanced, Centroids, MemoryBank],
                         ids=["class_weights", "centroids", "memory_bank"])
def test_a_buffer_read_alone_follows_its_changes_between_and_within_steps(make, capture):
    _compare(make, capture)


class Mixup(nn.Module):
    """Mixes the batch with a partner row by a weight ``draw()`` makes from nothing traced."""

    def __init__(self, draw: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.net = nn.Linear(5, 3)
        self.draw = draw

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lam = self.draw().to(x.dtype)
        perm = torch.randperm(x.size(0))
        logits = self.net(lam * x + (1 - lam) * x[perm])
        loss = lam * F.cross_entropy(logits, y) + (1 - lam) * F.cross_entropy(logits, y[perm])
        return loss, lam * torch.ones_like(x[:, 0])  # the weight as each row saw it


DRAWS: dict[str, Callable[[], torch.Tensor]] = {
    "beta": lambda: D.Beta(torch.tensor(0.4), torch.tensor(0.4)).sample(),
    "gamma": lambda: D.Gamma(torch.tensor(2.0), torch.tensor(4.0)).sample(),
    "bernoulli": lambda: torch.bernoulli(torch.tensor(0.5)),
    "binomial": lambda: torch.binomial(torch.tensor(10.0), torch.tensor(0.3)) / 10,
    "poisson": lambda: torch.poisson(torch.tensor(0.5)) / 4,
    "categorical": lambda: D.Categorical(probs=torch.ones(4) / 4).sample() / 4,
    "uniform_": lambda: torch.empty(()).uniform_(0.0, 1.0),
}


@pytest.mark.parametrize("capture", ["fx", "export", "auto"])
@pytest.mark.parametrize("name", list(DRAWS))
def test_a_draw_from_nothing_traced_is_eagers_draw_at_each_step(name, capture):
    """The weight differs from step to step as eager's, every row of a step sees the same
    one (one draw per step, not per microbatch), and the global generator ends where
    eager's does. What one capture cannot take is refused by it, and ``auto`` takes it
    (torch.export takes a Beta or a Categorical draw in some processes and refuses it as
    data-dependent in others: either is allowed there, never a difference)."""
    if (name, capture) in {("gamma", "fx"), ("uniform_", "fx")}:
        with pytest.raises(mbcompile.CaptureError):
            _compare(lambda: Mixup(DRAWS[name]), capture)
        return
    try:
        _compare(lambda: Mixup(DRAWS[name]), capture)
    except mbcompile.CaptureError:
        assert (name, capture) in {("beta", "export"), ("categorical", "export")}


def test_a_draw_into_a_tensor_forward_made_is_refused_under_fx_by_name():
    with pytest.raises(mbcompile.CaptureError, match=r"(?s)draws random numbers with "
                       r"uniform_ into a tensor it made at .*torch\.empty.*Fix: draw it with a "
                       r"factory"):
        _compare(lambda: Mixup(DRAWS["uniform_"]), "fx")


class ValueRead(nn.Module):
    """Reads a buffer's or a parameter's value into Python (``body``)."""

    def __init__(self, body: Callable[[ValueRead, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.net = nn.Linear(5, 3)
        self.register_buffer("flag", torch.tensor(False))
        self.register_buffer("scale", torch.tensor(2.0))
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(self, self.net(x)), y)


READS: dict[str, tuple[Callable[[Any, torch.Tensor], torch.Tensor], str]] = {
    "bool": (lambda s, o: o * 3 if s.flag else o, r"'flag' as a Python value \(Tensor\.bool\)"
             r" at .*if s\.flag"),
    "item": (lambda s, o: o * s.scale.item(), r"'scale' as a Python value \(Tensor\.item\)"),
    "float": (lambda s, o: o * float(s.scale), r"'scale' as a Python value \(Tensor\.float\)"),
    "parameter": (lambda s, o: o / dict(s.named_parameters())["temperature"].item(),
                  r"'temperature' as a Python value \(Tensor\.item\)"),
}


@pytest.mark.parametrize("name", list(READS))
def test_a_value_of_the_state_read_into_python_is_refused_under_fx(name):
    """fx kept ``bool(self.flag)`` as compile's False: after ``flag.fill_(True)`` the step
    still ran the other branch (loss 0.30 against eager's 2.73)."""
    body, match = READS[name]
    torch.manual_seed(0)
    model = ValueRead(body)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(mbcompile.CaptureError, match=r"(?s)forward reads the value of "
                       f"{match}.*Fix: keep it a tensor"):
        mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(),
                          **plan_free(MBS, capture="fx"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_shape_of_a_buffer_is_still_read_at_compile():
    """A buffer's shape is no value: ``self.class_w.numel()`` stays a constant."""
    class Counted(ClassBalanced):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return super().forward(x, y) * self.class_w.numel() / 3

    _compare(Counted, "fx")


class Distilled(nn.Module):
    """A student distilled from a teacher with BatchNorm, called in a no-grad region."""

    def __init__(self, teacher_training: bool, frozen: bool) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
        self.teacher = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(),
                                     nn.Linear(6, 3))
        self.teacher.train(teacher_training).requires_grad_(not frozen)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        kd = F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1), reduction="batchmean",
                      log_target=True)
        return kd + F.cross_entropy(s, y), t


@pytest.mark.parametrize("teacher_training", [False, True], ids=["eval", "train"])
def test_a_frozen_teacher_with_batchnorm_in_a_no_grad_region_compiles_under_fx(
        teacher_training):
    """fx traced every layer of a no-grad region, and BatchNorm's own dim check branched on
    the traced input: refused as 'Python control flow on tensor values'. A frozen layer
    stays whole (its running statistics updated as eager's in train mode)."""
    _compare(lambda: Distilled(teacher_training, frozen=True), "fx", steps=2)


def test_a_trainable_layer_in_a_no_grad_region_that_fx_cannot_trace_says_so():
    with pytest.raises(mbcompile.CaptureError, match=r"(?s)traced into the torch layers "
                       r"'teacher\.0', 'teacher\.1'.*no-grad region.*Fix: freeze them"):
        _compare(lambda: Distilled(False, frozen=False), "fx", steps=1)
    _compare(lambda: Distilled(False, frozen=False), "auto", steps=2)


class DtypeBranch(nn.Module):
    """Scales its input by how it was passed (``test``: the check of its dtype)."""

    def __init__(self, test: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.net = nn.Linear(5, 3)
        self.test = test

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x * (10 if self.test(x) else 1)), y)


@pytest.mark.parametrize("test", [lambda x: x.dtype is torch.float64,
                                  lambda x: x.dtype in {torch.float64}], ids=["is", "in_set"])
def test_a_dtype_tested_in_python_is_refused_under_fx_and_exact_under_auto(test):
    """fx's stand-in for ``x.dtype`` is no dtype, so ``is`` was False whatever the call's:
    the branch took eager's other side at the example's own dtype (loss 0.99 against
    36.5), silently."""
    with pytest.raises(mbcompile.CaptureError, match=r"(?s)reads a tensor's dtype at "
                       r".*test_fx_state_reads\.py.*in Python.*Fix: compile with "
                       r"capture='auto'"):
        mbcompile.compile(DtypeBranch(test), GBS, SYSTEMS, MBS, example_inputs=_batch(),
                          **plan_free(MBS, capture="fx"))
    _compare(lambda: DtypeBranch(test), "auto", steps=2)


def test_a_buffers_value_read_under_export_is_refused_without_a_path_from_the_batch():
    """The refusal named 'path from the batched input: item' for ``self.scale.item()``,
    which reads no batched input."""
    body, _ = READS["item"]
    with pytest.raises(mbcompile.MixingError, match=r"(?s)at .*test_fx_state_reads.*path "
                       r"from the batched input: none \(it reads no batched input"):
        mbcompile.compile(ValueRead(body), GBS, SYSTEMS, MBS, example_inputs=_batch(),
                          **plan_free(MBS, capture="export"))
