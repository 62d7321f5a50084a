"""Autograd building blocks in forward under ``capture="export"``: exact, or refused.

torch.export traces a forward's ops on fake tensors, so what only autograd sees leaves
no node. A custom ``autograd.Function``'s forward is inlined: an output it marks
non-differentiable was differentiated (``passes/custom_functions.py`` now detaches it), and
its backward check refused a forward that reads ``ctx.needs_input_grad`` or writes its
input (``ctx.mark_dirty``). ``t.detach_()``, ``h.retain_grad()`` and a
``requires_grad_()`` that flips a flag were dropped silently; they are refused at the
user's line now (``passes/export_autograd.py``), and the same calls where they change
nothing still compile. Compared with eager on a deep copy made before compile, float64,
on an uneven plan (gbs 7 over 2 systems, mbs 2), for two SGD steps: the loss, every
output with its ``requires_grad``, every ``.grad`` with its None-ness. A refusal leaves
the parameters, their ``.grad`` and the model's attributes as they were, and torch's
methods unpatched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, plan_free, rel_err

import mbcompile

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py

GBS, SYSTEMS, MBS = 7, 2, 2
#: torch's own methods, as the patch must leave them
TENSOR_METHODS = {name: torch.Tensor.__dict__.get(name)
                  for name in ("detach_", "retain_grad", "requires_grad_")}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g)


class Net(nn.Module):
    """Three layers and a body that uses them: ``a`` and ``c`` on ``x``, ``o`` the head."""

    def __init__(self, body: Callable[..., Any]) -> None:
        super().__init__()
        self.a, self.c, self.o = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        self.w = nn.Parameter(torch.randn(4, 4) / 2)
        self.act: torch.Tensor | None = None
        self.scale = torch.ones(3)  # a plain tensor attribute, not a buffer
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.body(self, x, y)


def _make(body: Callable[..., Any]) -> Net:
    torch.manual_seed(0)
    return Net(body)


# --------------------------------------------------------------------------- Functions


class TanhWithGate(torch.autograd.Function):
    """``tanh`` with its exact backward, and a ``sigmoid`` gate meant as a constant."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, gate = x.tanh(), x.sigmoid()
        ctx.mark_non_differentiable(gate)
        ctx.save_for_backward(y)
        return y, gate

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor, g_gate: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)


class NeedsGrad(torch.autograd.Function):
    """``x @ w``, exact; forward reads ``ctx.needs_input_grad`` for its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.want_x = ctx.needs_input_grad[0]
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        x, w = ctx.saved_tensors
        return (g @ w.t() if ctx.want_x else None), x.t() @ g


class Doubled(torch.autograd.Function):
    """``x * 2`` written into its input (``ctx.mark_dirty``), exact."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return 2 * g


def gated(s: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h, gate = TanhWithGate.apply(s.a(x))
    return F.cross_entropy(s.o(h * gate), y), gate


def needs_input_grad(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(s.o(NeedsGrad.apply(s.a(x), s.w)), y)


def dirty(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(s.o(Doubled.apply(s.a(x) * 1.0)), y)


# --------------------------------------------------------------------------- no-ops


def unchanged_flags(s: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``detach_`` on a value without gradient, ``requires_grad_()`` on one that has it,
    ``retain_grad`` on a parameter (a leaf): eager's autograd state is the same after."""
    with torch.no_grad():
        t = s.c(x)
    t.detach_()
    h = s.a(x).requires_grad_()
    s.w.retain_grad()
    return F.cross_entropy(s.o(h * t.sigmoid()), y), t, h


# --------------------------------------------------------------------------- refused


def detach_in_place(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = s.c(x).detach_()  # a gate computed without gradient
    return F.cross_entropy(s.o(s.a(x) * t), y)


def detach_then_requires_grad(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = s.c(x)
    t.detach_()
    t.requires_grad_()
    return F.cross_entropy(s.o(s.a(x) * t), y)


def retained(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = s.a(x)
    h.retain_grad()  # Grad-CAM: model.act.grad read after backward
    s.act = h
    return F.cross_entropy(s.o(h), y)


def made_a_leaf(s: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        t = s.c(x)
    t.requires_grad_()
    return F.cross_entropy(s.o(s.a(x) + t), y), t


def attribute_made_trainable(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s.scale.requires_grad_()
    return F.cross_entropy(s.o(s.a(x)) * s.scale, y)


def frozen_in_forward(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    s.c.weight.requires_grad_(False)
    return F.cross_entropy(s.o(s.a(x) * s.c(x)), y)


# --------------------------------------------------------------------------- checks


def _outputs(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _matches_eager(body: Callable[..., Any], capture: str, steps: int = 2) -> None:
    model = _make(body)
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(),
                           **plan_free(MBS, capture=capture))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    for step in range(steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        got, want = _outputs(cm(*_batch())), _outputs(eager(*_batch()))
        got[0].backward()
        want[0].backward()
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.requires_grad == w.requires_grad, (step, i, g.requires_grad)
            assert rel_err(g.detach(), w.detach()) <= TOL, (step, i)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), (step, name, p.grad, q.grad)
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) <= TOL, (step, name)
        for opt in opts:
            opt.step()


def _refused(body: Callable[..., Any], capture: str, match: str) -> str:
    model = _make(body)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(mbcompile.CaptureError, match=match) as info:
        mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=_batch(),
                          **plan_free(MBS, capture=capture))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.grad is None, n
        assert p.requires_grad == flags[n], n
    assert model.act is None and not model.scale.requires_grad
    assert {n: torch.Tensor.__dict__.get(n) for n in TENSOR_METHODS} == TENSOR_METHODS
    return str(info.value)


@pytest.mark.parametrize("capture", ["export", "auto"])
def test_a_non_differentiable_output_of_a_function_has_no_gradient_as_in_eager(capture):
    """The gate is detached where the trace returns it: ``a``'s gradient does not flow
    through it, and the returned gate does not require grad."""
    _matches_eager(gated, capture)


@pytest.mark.parametrize("body", [needs_input_grad, dirty], ids=["needs_input_grad", "dirty"])
def test_a_function_reading_needs_input_grad_or_writing_its_input_is_checked_and_exact(body):
    _matches_eager(body, "export")


def test_autograd_calls_that_change_nothing_compile_under_export_and_match_eager():
    _matches_eager(unchanged_flags, "export")


@pytest.mark.parametrize("body, match", [
    (detach_in_place, r"detaches a tensor in place at .*test_export_autograd\.py:\d+: "
                      r"t = s\.c\(x\)\.detach_\(\).*Fix: .*t = t\.detach\(\)"),
    (detach_then_requires_grad, r"detaches a tensor in place at .*: t\.detach_\(\)"),
    (retained, r"asks for the gradient of an intermediate at .*: h\.retain_grad\(\)"
               r".*Fix: .*mbcompile\.per_microbatch.*cm\.module"),
    (made_a_leaf, r"sets requires_grad=True on a tensor at .*: t\.requires_grad_\(\)"),
    (attribute_made_trainable, r"sets requires_grad=True on a tensor at .*"
                               r"s\.scale\.requires_grad_\(\)"),
    (frozen_in_forward, r"sets requires_grad=False on a tensor at .*"
                        r"s\.c\.weight\.requires_grad_\(False\)"),
], ids=["detach_", "detach_then_requires_grad_", "retain_grad", "requires_grad_leaf",
        "requires_grad_attribute", "requires_grad_frozen"])
def test_autograd_state_export_would_drop_is_refused_at_the_line(body, match):
    _refused(body, "export", match)


def test_detach_in_place_under_auto_is_captured_by_fx_and_exact():
    """The fx graph writes in place, so ``auto`` tried export first; export refuses the
    ``detach_``, and the fx graph (which keeps it) trains as eager: ``c`` gets no gradient."""
    _matches_eager(detach_in_place, "auto")


def test_a_gradient_penalty_is_still_refused_for_its_differentiation():
    """``x.detach().requires_grad_()`` before ``torch.autograd.grad``: the refusal names
    the differentiation (why it cannot be kept), not the flag."""
    def penalty(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        o = s.o(s.a(x))
        (g,) = torch.autograd.grad(o.sum(), x, create_graph=True)
        return F.cross_entropy(o, y) + g.pow(2).sum(1).mean()

    message = _refused(penalty, "export", "differentiates inside forward")
    assert "requires_grad=True" not in message


def _jvp(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out, tangent = torch.func.jvp(lambda v: torch.tanh(s.a(v)), (x,), (torch.ones_like(x),))
    return F.cross_entropy(s.o(out), y) + (tangent ** 2).mean()


def _dual(s: Net, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        out, tangent = fwAD.unpack_dual(torch.tanh(s.a(fwAD.make_dual(x, torch.ones_like(x)))))
    return F.cross_entropy(s.o(out), y) + (tangent ** 2).mean()


@pytest.mark.parametrize("capture", ["export", "auto"])
@pytest.mark.parametrize("body, line", [(_jvp, r"torch\.func\.jvp\(lambda"),
                                        (_dual, r"fwAD\.make_dual\(x")], ids=["jvp", "make_dual"])
def test_forward_mode_ad_in_forward_is_refused_by_name(capture, body, line):
    """Export traced the dual tensors and blamed 'the batch size is baked in: the code only
    works for a batch of 7', which is false; fx fails on them too."""
    message = _refused(body, capture, r"(?s)runs forward-mode AD at .*test_export_autograd\.py:"
                       rf"\d+: .*{line}.*Fix: compute it outside the compiled module")
    assert "baked in" not in message
