"""The plan sees the precision the step runs in (issue 36 item 4).

Activations under bf16 or fp16 autocast take about half the bytes of float32 ones. A
model compiled outside its autocast region says ``precision="bf16-mixed"``, or is
planned again on its first training call under an autocast the plan did not assume;
the plan and the report name the precision they assumed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mbcompile
from mbcompile import InputError, RecompileWarning
from mbcompile.models import make_tiny_gpt

GBS, NUM_CSX, MBS = 16, 1, 4
#: CPU autocast keeps layer norm, softmax, GELU and the loss in float32: activations come to
#: 0.60 of float32's on the tiny GPT below (the weights' bf16 copies are counted apart)
HALF = (0.45, 0.62)


def _model() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return make_tiny_gpt(GBS, width=256, depth=4, seq=128, vocab=512, heads=4)


def _activations(cm: mbcompile.CompiledModule) -> float:
    return cm.estimate.memory.activations


@pytest.mark.parametrize("name", ["bf16-mixed", "fp16-mixed"])
def test_a_mixed_precision_plan_sizes_activations_in_half_precision(name: str) -> None:
    model, batch = _model()
    full = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch, compile_only=True)
    half = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch, compile_only=True,
                             precision=name)
    ratio = _activations(half) / _activations(full)
    assert HALF[0] <= ratio <= HALF[1], ratio
    assert half.estimate.memory.casts > 0 == full.estimate.memory.casts  # the weights' copies
    assert full.plan.precision == "32" and half.plan.precision == name
    assert f"precision: {name}" in str(half.plan)
    assert half.report("json") and f"precision: {name}" in half.report()


def test_auto_is_the_autocast_compile_runs_under_and_32_switches_it_off() -> None:
    model, batch = _model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch,
                                   compile_only=True)
        off = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch,
                                compile_only=True, precision="32")
    named = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch, compile_only=True,
                              precision="bf16-mixed")
    assert inside.plan.precision == "bf16-mixed" and off.plan.precision == "32"
    assert _activations(inside) == _activations(named)
    assert HALF[0] <= _activations(inside) / _activations(off) <= HALF[1]


def test_lightning_spellings_and_a_bad_name() -> None:
    model, batch = _model()
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch, compile_only=True,
                           precision="16-mixed")
    assert cm.plan.precision == "fp16-mixed"
    with pytest.raises(InputError, match="precision must be one of .*bf16-mixed"):
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch, precision="bf16")


def test_a_first_training_call_under_another_autocast_plans_again_once() -> None:
    torch.manual_seed(0)
    model, batch = make_tiny_gpt(8)
    cm = mbcompile.compile(model, 8, 2, "auto", example_inputs=batch)
    assert cm.plan.precision == "32"
    full = cm.estimate.memory.activations
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RecompileWarning, match="planned for 32 .*bf16-mixed"):
            loss, _ = cm(*batch)
    loss.backward()
    assert cm.plan.precision == "bf16-mixed"
    assert cm.estimate.memory.activations < full
    eager = torch.nn.utils.parameters_to_vector([p.grad for p in model.parameters()])
    assert torch.isfinite(eager).all()
    with warnings.catch_warnings():  # once: later calls, under autocast or not, plan nothing
        warnings.simplefilter("error", RecompileWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(*batch)
        cm(*batch)
    assert "precision: bf16-mixed" in str(cm.plan)


def test_a_call_under_the_autocast_the_plan_assumed_plans_nothing() -> None:
    model, batch = make_tiny_gpt(8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, precision="bf16-mixed")
    plan = cm.plan
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cm(*batch)[0].backward()
    assert cm.plan is plan
