"""Autograd building blocks inside forward, exact or refused at the user's line.

- An in-place write inside ``torch.no_grad()`` into an intermediate that requires grad
  (a straight-through clip, ``h.clamp_(-0.1, 0.1)``): eager keeps ``h``'s gradient. The
  compiled step read the region's result detached, so layer ``a`` got ``.grad`` None
  (silent, fx and export). Now every later use reads the value with ``h``'s gradient
  (``passes/no_grad_writes.py``).
- A gradient hook forward registers on a parameter (``self.a.weight.register_hook``, often
  once behind a flag) was dropped under fx: it is a lasting change to the model. Refused
  at its line; registered outside forward it is exact.
- A tensor hook whose closure holds a traced value (``lambda g: g * m``) crashed inside
  mbcompile; ``h.retain_grad()`` and ``h.t_()`` suggested a batch rule that would be
  wrong. Each is a ``CaptureError`` at the line with its fix (``passes/fx_refusals.py``).

Plan: 7 rows over 2 systems, MBS 2 (uneven), float64, two SGD steps against eager on a
copy made before compile.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, plan_free, rel_err

import mbcompile
from mbcompile.errors import CaptureError

GBS, SYSTEMS, MBS = 7, 2, 2
COMPILED = {"backend": "aot_eager"}  # torch_compile without a C++ toolchain's inductor

pytestmark = pytest.mark.usefixtures("float64_default")  # conftest.py


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g)


def _compile(model: nn.Module, batch: tuple[Any, ...], **kw: Any) -> Any:
    return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch,
                             **plan_free(MBS, **kw))


def _leaves(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _two_steps_exact(model: nn.Module, batch: tuple[Any, ...], **kw: Any) -> None:
    """Two SGD steps of the compiled model equal eager's on a copy made before compile:
    the loss, the outputs (values and requires_grad), every .grad (None-ness too) and the
    parameters after each step."""
    ref = copy.deepcopy(model)
    cm = _compile(model, batch, **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(2):
        got, want = _leaves(cm(*batch)), _leaves(ref(*batch))
        for g, w in zip(got, want):
            assert g.requires_grad == w.requires_grad
            assert rel_err(g.detach(), w.detach()) < TOL
        for opt, out in zip(opts, (got, want)):
            opt.zero_grad(set_to_none=True)
            out[0].backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert rel_err(p.grad, q.grad) < TOL, name
        for opt in opts:
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert rel_err(p.detach(), q.detach()) < TOL


def _refused(model: nn.Module, match: str, **kw: Any) -> None:
    """Compiling ``model`` raises a CaptureError matching ``match``, changing nothing."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attrs = dict(vars(model))
    with pytest.raises(CaptureError, match=match):
        _compile(model, _batch(), **kw)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None and not p._backward_hooks for p in model.parameters())
    assert {k: v for k, v in vars(model).items() if k in attrs} == attrs


# --------------------------------------------------------------------- no-grad writes


class NoGradWrite(nn.Module):
    """``h`` written in place under ``torch.no_grad()``, then used and returned."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.a, self.o, self.write = nn.Linear(4, 4), nn.Linear(4, 3), write

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        early = h.sum(1, keepdim=True)  # read before the write: its own gradient
        with torch.no_grad():
            if self.write == "clamp_":
                h.clamp_(-0.1, 0.1)
            elif self.write == "chain":
                h.clamp_(-0.1, 0.1).mul_(2)
            elif self.write == "iadd":
                h += 1
            elif self.write == "view":
                h[:, 1].mul_(2)
        return F.cross_entropy(self.o(h) + early, y), h


@pytest.mark.parametrize("write, kw", [
    ("clamp_", {"capture": "fx"}),
    ("clamp_", {"capture": "export"}),
    ("clamp_", {"capture": "fx", "torch_compile": COMPILED}),
    ("chain", {"capture": "fx"}),
    ("chain", {"capture": "export"}),
    ("iadd", {"capture": "fx"}),
    ("view", {"capture": "auto"}),  # fx refuses the view write, export takes it
], ids=["clamp-fx", "clamp-export", "clamp-compiled", "chain-fx", "chain-export", "iadd-fx",
        "view-auto"])
def test_a_write_under_no_grad_keeps_the_gradient_of_what_it_writes(write, kw):
    torch.manual_seed(0)
    _two_steps_exact(NoGradWrite(write), _batch(), **kw)


class NoGradFill(nn.Module):
    """A no-grad write into a tensor that requires no grad stays without one."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        gate = torch.zeros_like(h)
        with torch.no_grad():
            gate.add_(0.5)
        return F.cross_entropy(self.o(h * gate), y), gate


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_write_under_no_grad_into_a_tensor_without_gradient_stays_without(capture):
    torch.manual_seed(0)
    _two_steps_exact(NoGradFill(), _batch(), capture=capture)


class InputClipped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.clamp_(-0.5, 0.5)
        return F.cross_entropy(self.o(self.a(x)), y)


def test_a_write_under_no_grad_into_an_input_that_requires_grad_keeps_its_gradient():
    torch.manual_seed(0)
    model, (x, y) = InputClipped(), _batch()
    ref = copy.deepcopy(model)
    cm = _compile(model, (x.clone().requires_grad_(), y), capture="fx")
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    cm(got, y).backward()
    ref(want, y).backward()
    assert torch.equal(got.detach(), want.detach())  # clamped in place, as eager's
    assert rel_err(got.grad, want.grad) < TOL
    assert rel_err(model.a.weight.grad, ref.a.weight.grad) < TOL


class NoGradReshape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            h.unsqueeze_(0)
        return F.cross_entropy(self.o(h[0]), y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_write_under_no_grad_that_changes_the_shape_is_refused(capture):
    _refused(NoGradReshape(), r"changes the shape .* no-grad region .*h\.unsqueeze_\(0\).*"
             r"h = h \+ \(new - h\)\.detach\(\)", capture=capture)


# --------------------------------------------------------------------- parameter hooks


class ParamHook(nn.Module):
    """A gradient hook on ``a.weight`` registered in forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.o, self.how, self.hooked = nn.Linear(4, 4), nn.Linear(4, 3), how, False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.how == "once" and not self.hooked:
            self.a.weight.register_hook(lambda g: g * 0.5)
            self.hooked = True
        elif self.how == "every call":
            self.a.weight.register_hook(lambda g: g * 0.5)
        elif self.how == "parameters()":
            for p in self.a.parameters():
                p.register_hook(lambda g: g * 0.5)
        elif self.how == "post-accumulate":
            self.a.weight.register_post_accumulate_grad_hook(lambda p: None)
        if self.how == "F.linear":
            self.a.weight.register_hook(lambda g: g * 0.5)
            return F.cross_entropy(self.o(F.linear(x, self.a.weight, self.a.bias)), y)
        return F.cross_entropy(self.o(self.a(x)), y)


@pytest.mark.parametrize("how", ["once", "every call", "F.linear", "parameters()",
                                 "post-accumulate"])
def test_a_hook_registered_on_a_parameter_in_forward_is_refused_changing_nothing(how):
    _refused(ParamHook(how), r"registers a gradient hook on 'a\.weight' at .*register_.*"
             r"register it once outside forward", capture="fx")


@pytest.mark.parametrize("when", ["before compile", "after compile"])
def test_a_parameter_hook_registered_outside_forward_is_exact(when):
    torch.manual_seed(0)
    model, batch = ParamHook("none"), _batch()
    ref = copy.deepcopy(model)
    ref.a.weight.register_hook(lambda g: g * 0.5)
    if when == "before compile":
        model.a.weight.register_hook(lambda g: g * 0.5)
    cm = _compile(model, batch, capture="fx")
    if when == "after compile":
        model.a.weight.register_hook(lambda g: g * 0.5)
    for _ in range(2):
        for module, call in ((model, cm), (ref, ref)):
            module.zero_grad(set_to_none=True)
            call(*batch).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) < TOL


# --------------------------------------------------------------------- hook closures


class MaskHook(nn.Module):
    """A tensor hook that masks the gradient with a mask computed in forward."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.o, self.how = nn.Linear(4, 4), nn.Linear(4, 3), how

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        m = (x[:, :1] > 0).to(h.dtype)
        if self.how == "closure":
            h.register_hook(lambda g: g * m)
        elif self.how == "default":
            h.register_hook(lambda g, m=m: g * m)
        elif self.how == "list":
            held = [m]
            h.register_hook(lambda g: g * held[0])
        else:  # the fix the error names: the same value, the gradient times m
            h = h.detach() + (h - h.detach()) * m
        return F.cross_entropy(self.o(h), y)


@pytest.mark.parametrize("how, name", [("closure", "m"), ("default", "m"), ("list", "held")])
def test_a_tensor_hook_holding_a_traced_value_is_refused_at_its_line(how, name):
    _refused(MaskHook(how), rf"closure holds '{name}', a value computed in forward, at "
             r".*register_hook.*h = h\.detach\(\) \+ \(h - h\.detach\(\)\) \* " + name,
             capture="fx")


def test_the_fix_for_a_hook_holding_a_traced_value_is_exact():
    torch.manual_seed(0)
    _two_steps_exact(MaskHook("fix"), _batch(), capture="fx")


def test_a_tensor_hook_on_an_intermediate_still_runs():
    class Halved(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h.register_hook(lambda g: g * 0.5)
            return F.cross_entropy(self.o(h), y)

    torch.manual_seed(0)
    _two_steps_exact(Halved(), _batch(), capture="fx")


# --------------------------------------------------------------------- retain_grad, t_


class Asks(nn.Module):
    def __init__(self, call: str) -> None:
        super().__init__()
        self.a, self.o, self.call, self.act = nn.Linear(4, 4), nn.Linear(4, 3), call, None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.call == "retain_grad":
            h.retain_grad()
            self.act = h
        elif self.call == "t_":
            h.t_()
            h = h.t()
        else:
            h.swapdims_(0, 1)
            h = h.swapdims(0, 1)
        return F.cross_entropy(self.o(h), y)


def test_retain_grad_in_forward_is_refused_at_its_line():
    _refused(Asks("retain_grad"), r"gradient of an intermediate at .*h\.retain_grad\(\).*"
             r"per_microbatch.*cm\.module", capture="fx")


@pytest.mark.parametrize("call", ["t_", "swapdims_"])
def test_an_in_place_transpose_is_refused_without_a_batch_rule_suggested(call):
    with pytest.raises(CaptureError, match=rf"transposes a tensor in place at .*h\.{call}\(") \
            as caught:
        _compile(Asks(call), _batch(), capture="fx")
    assert "register_batch_rule" not in str(caught.value)


def test_an_in_place_transpose_under_auto_is_exact():
    torch.manual_seed(0)
    _two_steps_exact(Asks("t_"), _batch(), capture="auto")
