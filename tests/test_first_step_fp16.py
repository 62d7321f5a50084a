"""The first training step in float16 rounds as eager's (``execution/deferred.py``).

Every later step seeds each microbatch's backward with the gradient the caller sent into
the loss at the previous step (``execution/seeding.py``). At the first there is none:
seeded with 1 where eager's backward is seeded with a GradScaler's scale, a float16
gradient too small for float16 at scale 1 underflowed (a loss of order 1e-5: 8% from
eager's where a hand-written accumulation loop is 0.02%), and eager's first step could
overflow (and be skipped) where the compiled one did not. The first float16 step now
waits for the real gradient: the forwards run in the call, each microbatch runs again
in ``loss.backward()`` from the same RNG state with its backward seeded as eager's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mbcompile

GBS, MBS = 7, 3
SIZES = (3, 2, 2)  # the plan's microbatches (mbs 3 balanced over 7 samples)
STARTS = (0, 3, 5)


class _SmallLoss(torch.nn.Module):
    """A loss near 1e-5 (``small``): its fp16 gradients underflow unless scaled."""

    def __init__(self, small: float = 1e-5, dropout: float = 0.0) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 4)
        self.drop = torch.nn.Dropout(dropout)
        self.small = small

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.b(self.drop(torch.tanh(self.a(x))))
        return torch.nn.functional.mse_loss(out, y) * self.small


def _model(small: float = 1e-5, dropout: float = 0.0, dtype: torch.dtype = torch.float32
           ) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = _SmallLoss(small, dropout).to(dtype)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(GBS, 5, 6, generator=g).to(dtype),
                   torch.randn(GBS, 5, 4, generator=g).to(dtype))


def _compile(model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             precision: str = "fp16-mixed") -> Any:
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=batch, cost_model=False,
                           precision=precision)
    assert cm.plan.microbatch_sizes == (SIZES,)
    return cm


def _grad(model: torch.nn.Module) -> torch.Tensor:
    g = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _step(call: Callable[..., Any], batch: tuple[torch.Tensor, ...],
          scaler: torch.amp.GradScaler | None, hand: bool = False) -> None:
    """One fp16 autocast forward and backward: the full batch, or (``hand``) gradient
    accumulation as people write it, each microbatch's mean weighted by its share."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.float16):
        parts = [(x[s:s + n], y[s:s + n], n / GBS)
                 for s, n in zip(STARTS, SIZES)] if hand else [(x, y, 1.0)]
        for xs, ys, share in parts:
            loss = call(xs, ys) * share if hand else call(xs, ys)
            (scaler.scale(loss) if scaler is not None else loss).backward()


def _three(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    return copy.deepcopy(model), copy.deepcopy(model)


@pytest.mark.parametrize("scaled", [True, False], ids=["grad_scaler", "no_scaler"])
def test_the_first_fp16_step_is_as_close_to_eager_as_a_hand_loop(scaled):
    """Measured: with a GradScaler (65536) the compiled first step was 27% from eager's
    gradients (seeded with 1: underflow); now 0.027%, as the hand loop (0.027%). Without
    a scaler the seed 1 was already eager's: both stay as close as the hand loop."""
    model, batch = _model(1e-5 if scaled else 1.0)  # unscaled, 1e-5 underflows in eager too
    ref, hand = _three(model)
    cm = _compile(model, batch)
    scalers = [torch.amp.GradScaler("cpu") if scaled else None for _ in range(3)]
    _step(cm, batch, scalers[0])
    _step(ref, batch, scalers[1])
    _step(hand, batch, scalers[2], hand=True)
    want = _grad(ref)
    ours, theirs = _distance(_grad(model), want), _distance(_grad(hand), want)
    assert 0 < theirs < 1e-2, theirs
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_the_first_fp16_step_overflows_where_eager_does_and_is_skipped_too():
    """Errors near 100: at the scale 65536 eager's fp16 output gradients overflow and the
    GradScaler skips the step; seeded with 1 the compiled step did not overflow, was
    taken, and kept the scale eager halved."""
    model, (x, y) = _model(small=1.0)
    batch = (x, y + 100.0)
    ref = copy.deepcopy(model)
    cm = _compile(model, batch)
    results = []
    for m, call in ((model, cm), (ref, ref)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        _step(call, batch, scaler)
        finite = bool(torch.cat([p.grad.flatten() for p in m.parameters()]).isfinite().all())
        scaler.step(opt)
        scaler.update()
        results.append((finite, scaler.get_scale()))
    assert results[1] == (False, 32768.0)  # eager overflowed: skipped, the scale halved
    assert results[0] == results[1]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_several_fp16_steps_follow_eagers_scales_and_parameters():
    model, batch = _model()
    ref, hand = _three(model)
    cm = _compile(model, batch)
    runs = []
    for m, call, by_hand in ((model, cm, False), (ref, ref, False), (hand, hand, True)):
        opt = torch.optim.SGD(m.parameters(), lr=1e4)  # the loss is 1e-5: the steps move
        scaler = torch.amp.GradScaler("cpu", growth_interval=2)
        scales = []
        for step in range(6):
            xs = (batch[0], batch[1] * (1e7 if step == 3 else 1.0))  # step 3 overflows
            _step(call, xs, scaler, hand=by_hand)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        runs.append((scales, torch.cat([p.detach().double().flatten()
                                        for p in m.parameters()])))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert runs[1][0][3] < runs[1][0][2]  # the forced overflow was skipped
    ours, theirs = _distance(runs[0][1], runs[1][1]), _distance(runs[2][1], runs[1][1])
    assert ours <= 1.1 * theirs + 1e-7, (ours, theirs)


def _counted(model: torch.nn.Module, batch: tuple[torch.Tensor, ...],
             precision: str = "fp16-mixed") -> tuple[Any, list[int]]:
    """The compiled module and a list each of ``b``'s microbatch forwards appends to (a
    hook marked per-microbatch runs as written, once per forward of ``b``)."""
    cm = _compile(model, batch, precision)
    seen: list[int] = []
    model.b.register_forward_hook(mbcompile.per_microbatch(
        lambda module, args, out: seen.append(out.shape[0])))
    return cm, seen


def test_only_the_first_fp16_step_runs_each_microbatch_again_in_backward():
    model, batch = _model()
    cm, seen = _counted(model, batch)
    scaler = torch.amp.GradScaler("cpu")
    _step(cm, batch, scaler)
    assert seen == [*SIZES, *SIZES]  # in the call, then again in loss.backward()
    seen.clear()
    _step(cm, batch, scaler)
    assert seen == list(SIZES)  # seeded with the last step's gradient: no second forward


def test_a_float32_first_step_runs_each_microbatch_once():
    model, batch = _model()
    ref = copy.deepcopy(model)
    cm, seen = _counted(model, batch, "32")
    cm(*batch).backward()
    ref(*batch).backward()
    assert seen == list(SIZES)
    assert _distance(_grad(model), _grad(ref)) < 1e-6


def test_a_half_model_without_autocast_waits_for_the_real_gradient_too():
    model, batch = _model(dtype=torch.float16)
    ref = copy.deepcopy(model)
    cm, seen = _counted(model, batch, "32")
    for call in (cm, ref):
        (call(*batch) * 1024.0).backward()  # scaled by hand (65536 overflows in eager)
    assert seen == [*SIZES, *SIZES]
    assert _distance(_grad(model), _grad(ref)) < 1e-2  # seeded with 1: 25% (underflow)


def test_dropout_in_the_first_fp16_step_draws_the_hand_loops_masks():
    """The forwards in the call and again in backward draw the same masks, those a hand
    loop draws from the same seed, and the generator ends where the hand loop's does."""
    model, batch = _model(dropout=0.5)
    hand = copy.deepcopy(model)
    cm = _compile(model, batch)
    states = []
    for call, by_hand in ((cm, False), (hand, True)):
        torch.manual_seed(123)
        _step(call, batch, torch.amp.GradScaler("cpu"), hand=by_hand)
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])
    assert _distance(_grad(model), _grad(hand)) < 1e-2  # seeded with 1: 25%
