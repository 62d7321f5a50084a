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
    g = torch.cat([p.grad.double().flatten() for p in model.parameters()
                   if p.requires_grad])
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


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_a_float32_or_bf16_first_step_runs_each_microbatch_once(precision):
    """A power-of-two seed is rescaled exactly in float32 and bf16: guessed, no wait."""
    model, batch = _model()
    ref = copy.deepcopy(model)
    cm, seen = _counted(model, batch, precision)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "32"):
        cm(*batch).backward()
        ref(*batch).backward()
    assert seen == list(SIZES)
    assert _distance(_grad(model), _grad(ref)) < (1e-6 if precision == "32" else 1e-2)


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


def _grads_set(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients already in ``.grad`` (a step accumulating onto them), and their copies."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    return [p.grad.clone() for p in model.parameters()]


def test_a_failure_in_the_second_forward_changes_nothing():
    """A microbatch failing in ``loss.backward()`` (an injected failure): the error names
    it, ``.grad`` and the RNG are as before the backward, the step is not handed over."""
    model, batch = _model()
    cm = _compile(model, batch)
    calls: list[int] = []

    def fail_in_backward(module: Any, args: Any, out: Any) -> None:
        calls.append(1)
        if len(calls) == len(SIZES) + 2:  # the second microbatch's second forward
            raise RuntimeError("injected")

    model.b.register_forward_hook(mbcompile.per_microbatch(fail_in_backward))
    before = _grads_set(model)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = cm(*batch)
    state = torch.get_rng_state()
    with pytest.raises(mbcompile.MicrobatchError, match="microbatch 1 failed in its forward "
                       "again in loss.backward"):
        (loss * 65536.0).backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert torch.equal(torch.get_rng_state(), state)


def test_an_input_changed_in_place_before_backward_is_refused():
    """The second forward reads the inputs again: one changed in place between the call
    and ``loss.backward()`` (eager refuses that too: its saved input changed) would give
    the gradient of another loss; refused, nothing handed over."""
    model, batch = _model()
    cm = _compile(model, batch)
    before = _grads_set(model)
    x = batch[0].clone()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = cm(x, batch[1])
    x.add_(1.0)
    with pytest.raises(mbcompile.MicrobatchError, match="computed another loss than the call"):
        (loss * 65536.0).backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_nonfinite_raise_in_the_first_fp16_step_raises_in_the_call():
    model, (x, y) = _model()
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=(x, y), cost_model=False,
                           precision="fp16-mixed", nonfinite="raise")
    before = _grads_set(model)
    bad = x.clone()
    bad[4] = float("nan")
    with pytest.raises(mbcompile.MicrobatchError, match="microbatch 1 is nan"), \
            torch.autocast("cpu", dtype=torch.float16):
        cm(bad, y)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))


def test_parameter_hooks_fire_once_on_the_steps_gradient():
    """A parameter's tensor and post-accumulate-grad hooks fire once per step, on the full
    gradient, in the first float16 step as in every other (``handover.hooks_aside``)."""
    model, batch = _model()
    ref = copy.deepcopy(model)
    cm = _compile(model, batch)
    fired: list[str] = []
    model.a.weight.register_hook(lambda g: fired.append("tensor"))
    model.a.weight.register_post_accumulate_grad_hook(lambda p: fired.append("accumulated"))
    for call in (cm, ref):
        _step(call, batch, torch.amp.GradScaler("cpu"))
    assert fired == ["tensor", "accumulated"]
    assert _distance(_grad(model), _grad(ref)) < 1e-3


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = (torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(5),
                                     torch.nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.b(self.norm(self.a(x))), y) * 1e-5


def test_running_statistics_are_updated_once_per_microbatch():
    """BatchNorm with per-microbatch statistics: the call's forwards update the running
    statistics, as a hand loop's do; the second forwards in backward do not again."""
    torch.manual_seed(0)
    model = _Normed()
    _, batch = _model()
    hand = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=batch, cost_model=False,
                           precision="fp16-mixed", batch_norm="per_microbatch")
    _step(cm, batch, torch.amp.GradScaler("cpu"))
    _step(hand, batch, torch.amp.GradScaler("cpu"), hand=True)
    for mine, theirs in zip(model.norm.buffers(), hand.norm.buffers()):
        assert torch.equal(mine, theirs)
    assert _distance(_grad(model), _grad(hand)) < 1e-2


def test_the_second_forwards_watch_hooks_as_the_call_does():
    """In ``loss.backward()`` the second forwards run the hooks as the call runs them: a
    global module hook marked per-microbatch is called on the user's layers only, never on
    mbcompile's own modules (its microbatch body), once per microbatch in each forward."""
    model, batch = _model()
    cm = _compile(model, batch)
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(mbcompile.per_microbatch(
        lambda module, args, out: seen.append(type(module).__name__)))
    try:
        _step(cm, batch, torch.amp.GradScaler("cpu"))
    finally:
        handle.remove()
    layers = [name for name in seen if name != "_SmallLoss"]  # torch's call of cm: the model
    assert layers == ["Linear", "Dropout", "Linear"] * 2 * len(SIZES), seen


class _Centred(_SmallLoss):
    """Centres its outputs by a buffer it updates each call (DINO's centre: an EMA of the
    batch mean, written back once per step, after the call)."""

    def __init__(self) -> None:
        super().__init__(small=1.0)
        self.register_buffer("center", torch.zeros(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        loss = torch.nn.functional.mse_loss(out - self.center, y)
        self.center.mul_(0.5).add_(0.5 * out.detach().mean((0, 1)))
        return loss


def test_a_graph_that_writes_state_back_keeps_the_guessed_first_step():
    """A second forward after the call would read the centre written back, and compute
    another loss (refused): such a graph's first float16 step is guessed, as before."""
    torch.manual_seed(0)
    model = _Centred()
    _, batch = _model()
    ref = copy.deepcopy(model)
    cm = _compile(model, batch)
    for call in (cm, ref):
        _step(call, batch, None)
    assert _distance(model.center, ref.center) < 1e-3
    assert _distance(_grad(model), _grad(ref)) < 1e-2


def _halve_input_grad(module: Any, grad_in: Any, grad_out: Any) -> tuple[torch.Tensor]:
    return (grad_in[0] * 0.5,)


def _twice(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2.0


def _between(model: torch.nn.Module, change: str, seen: list[str]) -> Callable[[], None]:
    """``change`` made to ``model``'s hooks between the call and ``loss.backward()``; what
    undoes it after the step."""
    if change == "backward hook added":
        handle = model.b.register_full_backward_hook(_halve_input_grad)
    elif change == "forward hook added":
        handle = model.a.register_forward_hook(lambda m, a, out: seen.append("added"))
    elif change == "global hook added":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: seen.append(type(m).__name__))
    else:  # the hook present at the call removed: eager's step still ran it
        for hooks in (model.a._forward_hooks, model.b._backward_hooks):
            hooks.clear()
        return lambda: None
    return handle.remove


@pytest.mark.parametrize("change", ["backward hook added", "forward hook added",
                                    "global hook added", "hooks removed"])
def test_the_second_forwards_run_the_hooks_the_call_ran_with(change):
    """Eager fixes a step's hooks at its forward: a hook added between the call and
    ``loss.backward()`` does not run for the step, a full backward hook removed between
    still does. Measured before: a full backward hook (grad_in * 0.5) added between halved
    ``a``'s gradient (0.500 of eager's), removed between doubled it (2.000); a forward hook
    added between ran per microbatch in backward, unchecked (eager: never); a global hook
    added between was called on mbcompile's own microbatch body; a forward hook (out * 2)
    removed between made the second forwards compute another loss (MicrobatchError)."""
    model, batch = _model(small=1.0)
    if change == "hooks removed":
        model.a.register_forward_hook(_twice)
        model.b.register_full_backward_hook(_halve_input_grad)
    ref = copy.deepcopy(model)
    cm = _compile(model, batch)
    grads, seen = [], []
    for m, call in ((model, cm), (ref, ref)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = call(*batch)
        undo = _between(m, change, seen)
        hooks = [dict(h) for h in (m.a._forward_hooks, m.b._backward_hooks)]
        try:
            torch.amp.GradScaler("cpu").scale(loss).backward()
        finally:
            after = [dict(h) for h in (m.a._forward_hooks, m.b._backward_hooks)]
            undo()
        assert after == hooks  # the user's hooks as they were before backward
        grads.append(_grad(m))
    assert seen == []
    assert _distance(grads[0], grads[1]) < 1e-3  # the hand loop's: 2.7e-4


class _FrozenHalfBase(_SmallLoss):
    """LoRA-like: a frozen float16 base layer between trainable float32 ones."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(16, 16).half().requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.base(torch.tanh(self.a(x)).half()).float()
        return torch.nn.functional.mse_loss(self.b(h), y) * self.small


class _InnerAutocast(_SmallLoss):
    """Enters a float16 autocast inside forward (export captures its casts)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = self.b(torch.tanh(self.a(x)))
        return torch.nn.functional.mse_loss(out.float(), y) * self.small


@pytest.mark.parametrize(("cls", "capture"), [(_FrozenHalfBase, "fx"),
                                              (_InnerAutocast, "export")],
                         ids=["frozen_half_base", "autocast_in_forward"])
def test_a_body_that_computes_in_float16_by_itself_waits_too(cls, capture):
    """No autocast at the call and float32 trained parameters and inputs, yet the body
    computes in float16: a frozen ``.half()`` layer (measured: the first step 32% from
    eager's gradients, now 1e-5, a hand loop 1e-7) or an autocast inside forward (27%,
    now 0.027% as a hand loop). Decided at lowering (``deferred.body_in_float16``)."""
    torch.manual_seed(0)
    model = cls()
    _, batch = _model()
    ref, hand = _three(model)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=batch, cost_model=False,
                           capture=capture)
    scalers = [torch.amp.GradScaler("cpu") for _ in range(3)]
    x, y = batch
    scalers[0].scale(cm(x, y)).backward()
    scalers[1].scale(ref(x, y)).backward()
    for s, n in zip(STARTS, SIZES):
        scalers[2].scale(hand(x[s:s + n], y[s:s + n]) * (n / GBS)).backward()
    want = _grad(ref)
    ours, theirs = _distance(_grad(model), want), _distance(_grad(hand), want)
    assert ours <= max(1.1 * theirs, 1e-4), (ours, theirs)  # fp16's rounding (eps 1e-3)


class _Tokens(_SmallLoss):
    """A token-mean loss: counted over the step (``ignore_index``), near 1e-5."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.b(torch.tanh(self.a(x)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100) * self.small


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x, labels = torch.randn(n, 5, 6, generator=g), torch.randint(0, 4, (n, 5), generator=g)
    labels[torch.rand(n, 5, generator=g) < 0.3] = -100
    return x, labels


def test_a_batch_size_compiled_mid_run_with_a_counted_loss_is_guessed():
    """The module was backpropagated: a batch of another size (its own graph, its own
    count) replays the module's last gradient through its tail, and runs each microbatch
    once. Measured before: it waited again (each microbatch's forward twice)."""
    torch.manual_seed(0)
    model = _Tokens()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 1, MBS, example_inputs=_tokens(GBS),
                           cost_model=False, precision="fp16-mixed", batch_sizes="any")
    seen: list[int] = []
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    for n in (GBS, 5):
        batch = _tokens(n)
        if n == 5:
            model.b.register_forward_hook(mbcompile.per_microbatch(
                lambda module, args, out: seen.append(out.shape[0])))
        for call, scaler in zip((cm, ref), scalers):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = call(*batch)
            scaler.scale(loss).backward()
        assert _distance(_grad(model), _grad(ref)) < 1e-3  # as a hand loop's: 3e-4
    assert sum(cm.plan.microbatch_sizes, ()) == (3, 2)  # the variant's plan
    assert seen == [3, 2]  # one forward per microbatch


@pytest.mark.parametrize("precision", ["fp16-mixed", "32"])
def test_the_batch_is_freed_at_backward_while_the_loss_is_kept(precision):
    """Eager frees the inputs its graph saved at backward; the step held the whole batch
    (every microbatch, for the second forwards of the first fp16 step) for as long as the
    caller kept the loss. Measured before: alive until the loss was dropped."""
    import gc
    import weakref

    model, batch = _model()
    cm = _compile(model, batch, precision)
    x, y = (t.clone() for t in batch)
    kept = weakref.ref(x)
    with torch.autocast("cpu", dtype=torch.float16, enabled=precision != "32"):
        loss = cm(x, y)
    loss.backward(retain_graph=True)
    del x, y
    gc.collect()
    assert kept() is None
    with pytest.raises(mbcompile.MicrobatchError, match="ran twice"):
        loss.backward()  # handed over once, refused again as before
