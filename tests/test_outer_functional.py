"""The compiled module called through ``torch.func.functional_call`` and inside
``FlopCounterMode`` (``execution/outer_calls.py``), compared with the same call on a copy of
the model made before compile (float64, gbs=7 over 2 systems, mbs=2).

A hunt found: computed weights (``functional_call(cm, {k: 2 * p})``, MAML's fast weights)
failing in the second microbatch's backward with the model's ``.grad`` changed, and, with
an op that saves nothing (``p - 0.1``), exact for ``loss.backward()`` only (``(3 *
loss).backward()`` off by 0.47, the leaves' ``.grad`` written inside the call,
``autograd.grad`` failing); under ``capture="export"`` any ``functional_call(cm, ...)``,
``no_grad`` too, refused with advice about data-dependent Python; and ``FlopCounterMode``
refused with messages that blamed the user for torch's ``ModuleTracker`` hooks. Computed
weights are now exact under fx; the others are refused, naming the cause and the fix,
with nothing changed.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, rel_err
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

import mbcompile
from mbcompile.errors import UncheckedHookError
from mbcompile.passes.errors import InputError

GBS, SYSTEMS, MBS = 7, 2, 2
CAPTURES = ["fx", "export"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.tanh(self.inp(x)))
        return F.cross_entropy(logits, y), logits


class Logits(nn.Module):
    """No loss inside: the step keeps every microbatch's graph (the unfused path)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inp(x)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(GBS, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GBS,), generator=g))


def _pair(capture: str, kind: type[nn.Module] = Net
          ) -> tuple[nn.Module, nn.Module, mbcompile.CompiledModule, tuple[torch.Tensor, ...]]:
    """(model, eager copy made before compile, cm, inputs)."""
    torch.manual_seed(0)
    model = kind().double()
    eager = copy.deepcopy(model)
    x, y = _data()
    inputs = (x, y) if kind is Net else (x,)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=inputs, cost_model=False,
                           capture=capture)
    return model, eager, cm, inputs


def _state(model: nn.Module) -> list[Any]:
    return [(p.detach().clone(), None if p.grad is None else p.grad.clone())
            for p in model.parameters()]


def _unchanged(model: nn.Module, before: list[Any]) -> None:
    for p, (value, grad) in zip(model.parameters(), before):
        assert torch.equal(p, value)
        assert (p.grad is None) == (grad is None)
        assert grad is None or torch.equal(p.grad, grad)


def _with_grads(model: nn.Module) -> None:
    """A ``.grad`` on every parameter, so that a refusal that wrote one shows."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.5 + i)


def _assert_steps_equal(model: nn.Module, eager: nn.Module, cm: nn.Module,
                        inputs: tuple[torch.Tensor, ...]) -> None:
    """One plain training step on each: loss and every ``.grad`` as eager's."""
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    got, want = cm(*inputs)[0], eager(*inputs)[0]
    got.backward()
    want.backward()
    assert rel_err(got, want) <= TOL
    for p, q in zip(model.parameters(), eager.parameters()):
        assert rel_err(p.grad, q.grad) <= TOL


FAST: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "scale": lambda p: 2 * p,  # a second microbatch's backward through it failed
    "tanh": torch.tanh,        # the same (it saves its output)
    "sub": lambda p: p - 0.1,  # saves nothing: was exact for a plain loss.backward() only
}


# ------------------------------------------------------------- computed (non-leaf) weights
@pytest.mark.parametrize("backward", ["plain", "scaled", "autograd.grad"])
@pytest.mark.parametrize("fast", list(FAST))
def test_computed_weights_train_the_leaves_behind_them_as_eager(fast, backward):
    """``functional_call(cm, {k: f(p)})`` under fx: the step's gradient goes through the
    caller's graph once, after the call (nothing is written into ``.grad`` before the
    user's backward), a hook on a computed weight fires once, and the factor a scaled
    backward brings reaches the leaves."""
    model, eager, cm, inputs = _pair("fx")
    got = []
    for m, call, prefix in ((model, cm, "module."), (eager, eager, "")):
        weights = {prefix + k: FAST[fast](v) for k, v in m.named_parameters()}
        calls: list[int] = []
        weights[prefix + "inp.weight"].register_hook(lambda g, calls=calls: calls.append(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RecompileWarning: new parameter slots
            loss = functional_call(call, weights, inputs)[0]
        assert all(p.grad is None for p in m.parameters())
        if backward == "autograd.grad":
            grads = torch.autograd.grad(loss, list(m.parameters()))
        else:
            (loss if backward == "plain" else 3 * loss).backward()
            grads = tuple(p.grad for p in m.parameters())
        got.append((loss, grads, len(calls)))
    (lc, gc, nc), (le, ge, ne) = got
    assert rel_err(lc, le) <= TOL and nc == ne == 1
    assert all(rel_err(a, b) <= TOL for a, b in zip(gc, ge))
    if backward == "autograd.grad":
        assert all(p.grad is None for p in model.parameters())
    _assert_steps_equal(model, eager, cm, inputs)  # the model's own slots are back


def test_second_order_fast_weights_train_as_eager():
    """MAML with second-order terms: the inner gradient taken with create_graph on the model
    itself, the outer loss through ``functional_call(cm, fast)``; Adam steps twice."""
    model, eager, cm, inputs = _pair("fx")
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, eager)]
    for _ in range(2):
        losses = []
        for m, call, prefix, opt in ((model, cm, "module.", opts[0]),
                                     (eager, eager, "", opts[1])):
            opt.zero_grad(set_to_none=True)
            names, params = zip(*m.named_parameters())
            inner = torch.autograd.grad(m(*inputs)[0], params, create_graph=True)
            fast = {prefix + n: p - 0.1 * g for n, p, g in zip(names, params, inner)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # RecompileWarning: new parameter slots
                loss = functional_call(call, fast, inputs)[0]
            loss.backward()
            opt.step()
            losses.append(loss)
        assert rel_err(*losses) <= TOL
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_err(p, q) <= TOL


def test_computed_weights_under_export_are_refused_and_change_nothing():
    """Export cannot capture plain tensors in parameter slots: it blamed data-dependent
    Python; the refusal names the slot and the fix, and the next plain step is eager's."""
    model, eager, cm, inputs = _pair("export")
    _with_grads(model)
    before, x_before = _state(model), [t.clone() for t in inputs]
    weights = {"module." + k: 2 * v for k, v in model.named_parameters()}
    with pytest.raises(InputError) as info:
        functional_call(cm, weights, inputs)[0].backward()
    text = str(info.value)
    assert "parameter 'inp.weight' holds a plain tensor, not an nn.Parameter" in text
    assert "capture='export'" in text and "capture='fx'" in text
    assert "functional_call(cm.module, ...)" in text and "nothing was changed" in text
    _unchanged(model, before)
    assert all(torch.equal(a, b) for a, b in zip(inputs, x_before))
    _assert_steps_equal(model, eager, cm, inputs)


def test_computed_weights_without_a_loss_inside_are_exact():
    """A model that returns logits (the loss taken outside) keeps every microbatch's graph:
    the caller's backward runs through them into the weights' graph once, as eager's."""
    model, eager, cm, (x,) = _pair("fx", Logits)
    _, y = _data()
    got = []
    for m, call, prefix in ((model, cm, "module."), (eager, eager, "")):
        weights = {prefix + k: torch.tanh(v) for k, v in m.named_parameters()}
        calls: list[int] = []
        weights[prefix + "head.weight"].register_hook(lambda g, calls=calls: calls.append(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RetainedActivationsWarning, RecompileWarning
            loss = F.cross_entropy(functional_call(call, weights, (x,)), y)
        (3 * loss).backward()
        got.append((loss, [p.grad for p in m.parameters()], len(calls)))
    (lc, gc, nc), (le, ge, ne) = got
    assert rel_err(lc, le) <= TOL and nc == ne == 1
    assert all(rel_err(a, b) <= TOL for a, b in zip(gc, ge))


@pytest.mark.parametrize("capture", CAPTURES)
def test_functional_call_with_the_parameters_themselves_trains_as_eager(capture):
    """``functional_call(cm, dict(cm.named_parameters()))``: the same tensors, a plain step
    (no alias: the step's slots are the model's)."""
    model, eager, cm, inputs = _pair(capture)
    for _ in range(2):
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        got = functional_call(cm, dict(cm.named_parameters()), inputs)[0]
        want = functional_call(eager, dict(eager.named_parameters()), inputs)[0]
        got.backward()
        want.backward()
        assert rel_err(got, want) <= TOL
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) <= TOL
        with torch.no_grad():
            for m in (model, eager):
                for p in m.parameters():
                    p -= 0.1 * p.grad


def test_functional_call_with_leaf_copies_trains_them_as_eager():
    """Leaf tensors in the parameter slots (``w.detach().requires_grad_()``, the fix the
    refusal names): fx compiles the new slots, and the copies get eager's ``.grad``."""
    model, eager, cm, inputs = _pair("fx")
    got = []
    for m, call, prefix in ((model, cm, "module."), (eager, eager, "")):
        leaves = {prefix + k: (2 * v).detach().requires_grad_()
                  for k, v in m.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RecompileWarning: new parameter slots
            loss = functional_call(call, leaves, inputs)[0]
        loss.backward()
        got.append((loss, [w.grad for w in leaves.values()]))
    assert rel_err(got[0][0], got[1][0]) <= TOL
    assert all(rel_err(a, b) <= TOL for a, b in zip(got[0][1], got[1][1]))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("capture", CAPTURES)
def test_computed_weights_under_no_grad(capture):
    """No step runs under ``no_grad``: fx gives eager's loss; export names the plain tensor
    in the parameter slot (it blamed data-dependent Python) and changes nothing."""
    model, eager, cm, inputs = _pair(capture)
    _with_grads(model)
    before = _state(model)
    with torch.no_grad():
        want = functional_call(eager, {k: 2 * v for k, v in eager.named_parameters()},
                               inputs)[0]
        weights = {"module." + k: 2 * v for k, v in model.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RecompileWarning: new parameter slots
            if capture == "fx":
                assert rel_err(functional_call(cm, weights, inputs)[0], want) <= TOL
            else:
                with pytest.raises(InputError, match="parameter 'inp.weight' holds a plain "
                                   r"tensor.*functional_call\(cm.module, \.\.\.\)"):
                    functional_call(cm, weights, inputs)
    _unchanged(model, before)


# ----------------------------------------------------------------------- FlopCounterMode
@pytest.mark.parametrize("capture", CAPTURES)
def test_a_training_step_inside_flop_counter_mode_is_refused_by_name(capture):
    model, eager, cm, inputs = _pair(capture)
    _with_grads(model)
    before = _state(model)
    with FlopCounterMode(display=False), pytest.raises(UncheckedHookError) as info:
        out = cm(*inputs)  # the outputs held, as a training loop holds them
        out[0].backward()
    text = str(info.value)
    assert "FlopCounterMode" in text and "ModuleTracker" in text
    assert "torch.no_grad()" in text and "cm.module" in text and "Nothing was changed" in text
    _unchanged(model, before)
    _assert_steps_equal(model, eager, cm, inputs)  # outside the mode: eager's step


def test_a_training_call_without_a_loss_inside_flop_counter_mode_is_refused_by_name():
    """The unfused step (loss outside the model) too: it named ModuleTracker's hook as the
    user's ("register the hook on the layers you mean")."""
    model, _, cm, (x,) = _pair("fx", Logits)
    before = _state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RetainedActivationsWarning
        with FlopCounterMode(display=False), pytest.raises(
                UncheckedHookError, match="step was called inside torch.utils.flop_counter"):
            cm(x)
    _unchanged(model, before)


@pytest.mark.parametrize("capture", CAPTURES)
def test_flop_counter_mode_counts_a_forward_only_call_as_eager(capture):
    """The fix the refusal names: under ``no_grad`` the counts are the model's forward's."""
    _, eager, cm, inputs = _pair(capture)
    counts = []
    for m in (cm, eager):
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            m(*inputs)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0
