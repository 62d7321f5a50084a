"""Atomic steps: a call that fails in any microbatch leaves everything as it was.

For every non-empty microbatch position ``k`` of a plan (all systems, uneven and
empty microbatches included) a failure is injected at ``k``:

- ``forward``: a forward pre-hook on the first layer raises on its ``k``-th call;
- ``backward``: a tensor hook on the first layer's output raises in the ``k``-th
  microbatch's backward (which mbcompile runs inside the call; a parameter's own tensor
  hooks wait for the caller's backward, as in eager: ``tests/faults.py``);
- ``nan``: one target of microbatch ``k`` is NaN, so its loss is not finite.

After the failure, parameters (identity and bits), gradients (``None`` or
pre-existing values, identity and bits), buffers and the optimizer's state (Adam,
after one real step so it has moments) must be exactly as before the call; and a
clean call afterwards must give bitwise the gradients it gives with no failure
before it, so the failed call left nothing behind.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from faults import on_output_gradient

import mbcompile
from mbcompile.execution.noise import NoiseScale
from mbcompile.models import make_mlp, make_tiny_gpt

DTYPE = torch.float64

# gbs 10 over 3 systems, mbs 2: ((2, 2), (2, 1), (2, 1)), six microbatches;
# gbs 5 over 4 systems, mbs 1: ((1, 1), (1, 0), (1, 0), (1, 0)), five run, three are empty.
PLANS = [(10, 3, 2), (5, 4, 1)]


class BNEvalNet(nn.Module):
    """Linear -> BatchNorm1d (eval: running stats, buffers) -> Linear, cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x, y):
        logits = self.out(torch.relu(self.bn(self.inp(x))))
        return F.cross_entropy(logits, y), logits


class TwoLossNet(nn.Module):
    """Two losses: compiled without the fused per-microbatch backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.cls = nn.Linear(8, 4)
        self.reg = nn.Linear(8, 2)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        return F.cross_entropy(self.cls(h), y) + 0.1 * F.mse_loss(self.reg(h), h[:, :2])


@dataclass
class Case:
    model: nn.Module
    batch: tuple[Any, ...]
    first: nn.Module  # the first layer: sees every microbatch once, in order
    target: int  # index of the input holding targets, for the NaN injection
    float_target: bool


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_case(name: str, gbs: int) -> Case:
    torch.manual_seed(0)
    if name == "mlp":
        model, batch = make_mlp(gbs, dtype=DTYPE)
        return Case(model, batch, model.net[0], 1, True)
    if name == "bn_eval":
        model = BNEvalNet().to(DTYPE)
        with torch.no_grad():  # give the running statistics non-trivial values
            model.bn.running_mean.uniform_(-1, 1)
            model.bn.running_var.uniform_(0.5, 2)
            model.bn.num_batches_tracked.fill_(7)
        model.bn.eval()
        g = _gen(1)
        batch = (torch.randn(gbs, 6, generator=g, dtype=DTYPE),
                 torch.randint(0, 4, (gbs,), generator=g))
        return Case(model, batch, model.inp, 1, False)
    if name == "tiny_gpt":
        model, batch = make_tiny_gpt(gbs, dtype=DTYPE, vocab=16, width=8, depth=1, heads=2,
                                     seq=6)
        return Case(model, batch, model.tok, 1, False)
    if name == "two_losses":
        model = TwoLossNet().to(DTYPE)
        g = _gen(2)
        batch = (torch.randn(gbs, 6, generator=g, dtype=DTYPE),
                 torch.randint(0, 4, (gbs,), generator=g))
        return Case(model, batch, model.inp, 1, False)
    raise KeyError(name)


# --------------------------------------------------------------------------- #
# snapshots
# --------------------------------------------------------------------------- #


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return copy.deepcopy(value)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes: NaN equals NaN, -0.0 differs from 0.0."""
    t = t.detach().contiguous().view(-1)
    return t.view(torch.uint8) if t.is_floating_point() else t


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b


@dataclass
class Snapshot:
    params: dict[str, torch.Tensor]  # the Parameter objects
    values: dict[str, torch.Tensor]
    grad_objects: dict[str, torch.Tensor | None]
    grads: dict[str, torch.Tensor | None]
    requires_grad: dict[str, bool]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    training: list[bool]

    @classmethod
    def take(cls, model: nn.Module, opt: torch.optim.Optimizer) -> Snapshot:
        named = dict(model.named_parameters())
        return cls(
            params=dict(named),
            values={n: _clone(p) for n, p in named.items()},
            grad_objects={n: p.grad for n, p in named.items()},
            grads={n: None if p.grad is None else _clone(p.grad) for n, p in named.items()},
            requires_grad={n: p.requires_grad for n, p in named.items()},
            buffers={n: _clone(b) for n, b in model.named_buffers()},
            optimizer=_clone(opt.state_dict()),
            training=[m.training for m in model.modules()],
        )

    def check(self, model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
        named = dict(model.named_parameters())
        assert named.keys() == self.params.keys(), where
        for n, p in named.items():
            assert p is self.params[n], f"{where}: parameter {n} was replaced"
            assert _same(p.detach(), self.values[n]), f"{where}: parameter {n} changed"
            assert p.requires_grad == self.requires_grad[n], f"{where}: {n}.requires_grad"
            if self.grads[n] is None:
                assert p.grad is None, f"{where}: {n}.grad was None and is now set"
            else:
                assert p.grad is self.grad_objects[n], f"{where}: {n}.grad was replaced"
                assert _same(p.grad, self.grads[n]), f"{where}: {n}.grad changed"
        buffers = dict(model.named_buffers())
        assert buffers.keys() == self.buffers.keys(), where
        for n, b in buffers.items():
            assert _same(b, self.buffers[n]), f"{where}: buffer {n} changed"
        assert _same(opt.state_dict(), self.optimizer), f"{where}: optimizer state changed"
        assert [m.training for m in model.modules()] == self.training, f"{where}: training"


# --------------------------------------------------------------------------- #
# failure injection
# --------------------------------------------------------------------------- #


class Injected(Exception):
    """The failure the tests inject."""


def _nth_call_raises(k: int) -> tuple[dict[str, int], Callable[..., None]]:
    state = {"calls": 0}

    def fn(*_: Any) -> None:
        state["calls"] += 1
        if state["calls"] - 1 == k:
            raise Injected(f"injected at call {k}")

    return state, mbcompile.per_microbatch(fn)


def _nonempty_starts(plan: mbcompile.MicrobatchPlan) -> list[int]:
    return [a for system in plan.microbatch_slices for a, b in system if b > a]


def _inject(kind: str, case: Case, plan: mbcompile.MicrobatchPlan, k: int
            ) -> tuple[tuple[Any, ...], Callable[[], None]]:
    """Arm a failure at microbatch ``k``; returns the batch to call with and a disarm."""
    if kind == "forward":
        _, fn = _nth_call_raises(k)
        handle = case.first.register_forward_pre_hook(fn)
        return case.batch, handle.remove
    if kind == "backward":
        _, fn = _nth_call_raises(k)
        handle = on_output_gradient(case.first, fn)
        return case.batch, handle.remove
    if kind == "nan":
        batch = list(case.batch)
        start = _nonempty_starts(plan)[k]
        if case.float_target:
            target = batch[case.target].clone()
            target[start] = float("nan")
            batch[case.target] = target
        else:  # integer targets: poison the first float input instead
            i = next(i for i, t in enumerate(batch) if t.is_floating_point())
            x = batch[i].clone()
            x[start] = float("nan")
            batch[i] = x
        return tuple(batch), lambda: None
    raise KeyError(kind)


def _loss_of(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _setup(name: str, plan_args: tuple[int, int, int], grads: str, **compile_kw: Any):
    gbs, num_csx, mbs = plan_args
    case = make_case(name, gbs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(case.model, gbs, num_csx, mbs, example_inputs=case.batch,
                               **{"nonfinite": "raise", **compile_kw})
    opt = torch.optim.Adam(case.model.parameters(), lr=1e-2)
    # one real step, so Adam holds moments and a step count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        _loss_of(cm(*case.batch)).backward()
    opt.step()
    if grads == "none":
        opt.zero_grad(set_to_none=True)
    else:  # pre-existing gradients the failed step must not touch
        g = _gen(5)
        for p in case.model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    return case, cm, opt


def _clean_grads(case: Case, cm: nn.Module, snap: Snapshot) -> dict[str, torch.Tensor | None]:
    """Run one clean step from the snapshot's gradients; return the gradients it leaves."""
    for n, p in case.model.named_parameters():
        p.grad = None if snap.grads[n] is None else snap.grads[n].clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        _loss_of(cm(*case.batch)).backward()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in case.model.named_parameters()}


MODELS = ["mlp", "bn_eval", "tiny_gpt", "two_losses"]
KINDS = ["forward", "backward", "nan"]


def _cases() -> list[tuple[str, str, tuple[int, int, int], str]]:
    """Every (model, failure, plan, gradients) combination that can fail inside the call.

    two_losses has no single loss to run backward on per microbatch: backward (and a
    NaN gradient) happens in the user's own backward after the call, as in eager.
    tiny_gpt (attention, token-count means) is the slowest to compile: one plan.
    """
    cases = []
    for name in MODELS:
        for kind in KINDS:
            if name == "two_losses" and kind != "forward":
                continue
            if name == "tiny_gpt" and kind == "nan":
                continue  # token ids are integers; the float models cover NaN
            for plan_args in PLANS[:1] if name == "tiny_gpt" else PLANS:
                for grads in ["existing"] if name == "tiny_gpt" else ["none", "existing"]:
                    cases.append((name, kind, plan_args, grads))
    return cases


def _case_id(case: tuple[str, str, tuple[int, int, int], str]) -> str:
    name, kind, (gbs, num_csx, mbs), grads = case
    return f"{name}-{kind}-gbs{gbs}_csx{num_csx}_mbs{mbs}-grads_{grads}"


@pytest.mark.parametrize("name, kind, plan_args, grads", _cases(),
                         ids=[_case_id(c) for c in _cases()])
def test_failure_at_every_microbatch_leaves_the_step_untouched(name, kind, plan_args, grads):
    case, cm, opt = _setup(name, plan_args, grads)
    plan = cm.plan
    positions = len(_nonempty_starts(plan))
    assert positions == plan.num_nonempty_microbatches
    snap = Snapshot.take(case.model, opt)
    want = _clean_grads(case, cm, snap)
    for n, p in case.model.named_parameters():  # back to the snapshot, same objects
        p.grad = snap.grad_objects[n]
    snap.check(case.model, opt, "after restoring the snapshot")
    for k in range(positions):
        batch, disarm = _inject(kind, case, plan, k)
        where = f"{name}, {kind} failure at microbatch {k} of {positions} (plan {plan_args})"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
                with pytest.raises((Injected, mbcompile.MbcompileError)) as info:
                    cm(*batch)
        finally:
            disarm()
        if kind == "nan":
            assert isinstance(info.value, mbcompile.MicrobatchError), where
        snap.check(case.model, opt, where)
        if k not in (0, positions - 1):
            continue  # (the clean-step check below costs a call: first and last suffice)
        # the failed call left nothing behind: a clean step now matches one with no failure
        got = _clean_grads(case, cm, snap)
        for n in want:
            assert _same(got[n], want[n]), f"{where}: the next clean step's {n}.grad differs"
        for n, p in case.model.named_parameters():
            p.grad = snap.grad_objects[n]


@pytest.mark.parametrize("plan_args", PLANS, ids=lambda p: "gbs{}_csx{}_mbs{}".format(*p))
def test_failure_under_no_grad_leaves_the_step_untouched(plan_args):
    case, cm, opt = _setup("mlp", plan_args, "existing")
    snap = Snapshot.take(case.model, opt)
    for k in range(cm.plan.num_nonempty_microbatches):
        batch, disarm = _inject("forward", case, cm.plan, k)
        try:
            with torch.no_grad(), pytest.raises((Injected, mbcompile.MbcompileError)):
                cm(*batch)
        finally:
            disarm()
        snap.check(case.model, opt, f"no_grad failure at microbatch {k}")


class Interrupt(BaseException):
    """Not an Exception: what KeyboardInterrupt or SystemExit look like to the loop."""


def test_base_exception_in_a_microbatch_still_restores_gradients():
    case, cm, opt = _setup("mlp", (10, 3, 2), "existing")
    snap = Snapshot.take(case.model, opt)
    state = {"calls": 0}

    def hook(*_: Any) -> None:
        state["calls"] += 1
        if state["calls"] == 3:
            raise Interrupt()

    handle = case.first.register_forward_pre_hook(mbcompile.per_microbatch(hook))
    try:
        with pytest.raises(Interrupt):
            cm(*case.batch)
    finally:
        handle.remove()
    snap.check(case.model, opt, "BaseException at microbatch 2")


def test_failed_step_leaves_the_noise_scale_estimate_untouched():
    case, cm, opt = _setup("mlp", (10, 3, 2), "none", measure_noise_scale=NoiseScale())
    noise = cm.noise_scale
    before = copy.deepcopy(noise.__dict__)
    for k in range(cm.plan.num_nonempty_microbatches):
        batch, disarm = _inject("nan", case, cm.plan, k)
        try:
            with pytest.raises(mbcompile.MicrobatchError):
                cm(*batch)
        finally:
            disarm()
        assert _same(noise.__dict__, before), f"noise estimate changed by a failed step ({k})"


def test_successful_step_accumulates_into_existing_gradients_like_eager():
    """The other half of the contract: a step that succeeds adds to .grad, as eager does."""
    case, cm, opt = _setup("mlp", (10, 3, 2), "existing")
    reference = copy.deepcopy(case.model)
    existing = {n: p.grad.clone() for n, p in case.model.named_parameters()}
    for n, q in reference.named_parameters():
        q.grad = existing[n].clone()
    _loss_of(cm(*case.batch)).backward()
    _loss_of(reference(*case.batch)).backward()
    for (n, p), q in zip(case.model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), n
        assert not torch.equal(p.grad, existing[n]), n
