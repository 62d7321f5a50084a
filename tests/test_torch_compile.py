"""``compile(..., torch_compile=...)``: the body (and a two-phase step's coupled part) is
compiled with torch.compile once per microbatch shape of the plan and never again; the
step stays exact to float32 rounding and atomic.

The tests use the ``aot_eager`` backend (AOTAutograd without code generation), which
needs no C++ compiler; inductor is what ``torch_compile=True`` uses, and what the
benchmark measures."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.utils import counters

import mbcompile
from mbcompile.check import relative_error
from mbcompile.models import make_tiny_gpt

AOT = {"backend": "aot_eager"}
GBS = 14  # over 2 systems with mbs 4: microbatches of 4, 3 | 4, 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_each_shape_compiles_once_and_the_step_is_exact():
    model, batch = make_tiny_gpt(GBS)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile=AOT)
    order = [b - a for system in cm.plan.microbatch_slices for a, b in system if b > a]
    assert order == [4, 3, 4, 3]
    loss, logits = cm(*batch)
    loss.backward()
    first = _graphs()
    # one joint forward-backward graph per microbatch size, static shapes
    assert first == len(set(order))
    # ... each holding the whole body (no graph break runs part of it eagerly): every
    # linear layer of the model is in every graph
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not counters["graph_break"]
    assert counters["stats"]["calls_captured"] >= first * linears
    for _ in range(2):  # later steps: cache hits only, no recompilation
        cm(*batch)[0].backward()
    assert _graphs() == first
    want, want_logits = ref(*batch)
    want.backward()
    assert relative_error(loss, want) <= 1e-6
    assert relative_error(logits, want_logits) <= 1e-5
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad / 3, b.grad) <= 1e-5  # three steps accumulated


def test_a_two_phase_step_compiles_body_and_coupled_part():
    from two_phase_workers import Clip

    torch.manual_seed(0)
    model = Clip()
    ref = copy.deepcopy(model)
    batch = (torch.randn(7, 6), torch.randn(7, 5))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch, torch_compile=AOT)
    assert isinstance(cm.graph_module.body, torch._dynamo.eval_frame.OptimizedModule)
    assert isinstance(cm.graph_module.coupled, torch._dynamo.eval_frame.OptimizedModule)
    cm(*batch).backward()
    first = _graphs()
    # body: sizes 2 and 1, without grad (phase 1) and with (phase 3); coupled: once
    assert first == 2 * 2 + 1
    cm(*batch).backward()
    assert _graphs() == first
    ref(*batch).backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad / 2, b.grad) <= 1e-5


def test_freezing_and_unfreezing_between_steps():
    """The loop lists the body's parameters once; which of them train is read every call."""
    model, batch = make_tiny_gpt(GBS)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile=AOT)
    for frozen in (True, False, True):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m.head.requires_grad_(not frozen)
        cm(*batch)[0].backward()
        ref(*batch)[0].backward()
        assert (model.head.weight.grad is None) == frozen
        for a, b in zip(model.parameters(), ref.parameters()):
            if b.requires_grad:
                assert relative_error(a.grad, b.grad) <= 1e-5


def test_a_failed_step_is_rolled_back():
    model, batch = make_tiny_gpt(GBS)
    cm = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile=AOT)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    weight = model.head.weight
    kept = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = float("nan")  # every microbatch's loss is NaN
    with pytest.raises(mbcompile.MicrobatchError, match="not finite"):
        cm(*batch)
    with torch.no_grad():
        weight[0, 0] = kept
    for p, (value, grad) in zip(model.parameters(), before):
        assert torch.equal(p, value) and torch.equal(p.grad, grad)


def test_bad_options_are_refused():
    model, batch = make_tiny_gpt(GBS)
    with pytest.raises(mbcompile.InputError, match="torch.compile does not take"):
        mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile={"speed": 1})
    with pytest.raises(mbcompile.ArgumentTypeError):
        mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile="yes")
