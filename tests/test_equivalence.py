"""Compiled vs eager full batch, in float64: outputs and every gradient, to rounding.

The oracle is always eager PyTorch on the whole batch; nothing expected here is
computed by mbcompile. "Exact" means a normwise relative error (``max|got -
want| / max|want|``, see ``models.rel_err``) of at most ``TOL`` on every output
leaf and every parameter gradient.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import (
    FIRST_LAYER,
    MODELS,
    TOL,
    WARNS_RETAINED,
    assert_close_errors,
    grad_errors,
    grads_of,
    max_rel_err_outputs,
    plan_free,
    tensor_leaves,
)

import mbcompile
from mbcompile import MbsAdjustedWarning, RetainedActivationsWarning


@dataclass(frozen=True)
class Case:
    """One plan: (gbs, num_csx, mbs) and, when the MBS gets adjusted, the value it must become."""

    gbs: int
    num_csx: int
    mbs: Any
    adjusted_to: int | None = None


# Each plan exercises one rule of the plan arithmetic (docs/mbs.md, "Plan rules").
PLANS = {
    "gbs10-csx3-mbs2-uneven-systems": Case(10, 3, 2),
    "gbs13-csx2-mbs3-pbs-not-multiple": Case(13, 2, 3),
    "gbs5-csx4-mbs1-empty-microbatches": Case(5, 4, 1),
    "gbs8-csx2-none": Case(8, 2, "none"),
    "gbs12-csx2-auto": Case(12, 2, "auto"),
    "gbs6-csx2-mbs1": Case(6, 2, 1),
    "gbs7-csx1-mbs3-one-system": Case(7, 1, 3),
    "gbs11-csx4-mbs2": Case(11, 4, 2),
    # pbs 8 supports {1, 2, 3, 4, 8}; 6 is as far from 4 as from 8, and ties go to the smaller.
    "gbs16-csx2-mbs6-adjusted-to-4": Case(16, 2, 6, adjusted_to=4),
}
PLAN_PARAMS = [pytest.param(case, id=name) for name, case in PLANS.items()]

CORE_MODELS = ["tiny_gpt", "mlp", "cnn"]
LOSS_MODELS = ["sum_loss", "mean_output", "masked_mean_bool", "masked_mean_double",
               "masked_mean_like", "size_normalised", "l2_regularised", "two_losses",
               "weighted_nll", "weighted_ce", "bce_logits", "smooth_l1", "kl_div"]
LOSS_PLANS = [pytest.param(PLANS[n], id=n) for n in (
    "gbs10-csx3-mbs2-uneven-systems", "gbs13-csx2-mbs3-pbs-not-multiple",
    "gbs5-csx4-mbs1-empty-microbatches")]


def loss_of(out: Any) -> torch.Tensor:
    """The model's loss: its first output leaf, which every registry model makes the scalar loss."""
    name, loss = tensor_leaves(out)[0]
    assert loss.dim() == 0, f"{name} is not a scalar loss"
    return loss


def train_loss(out: Any) -> torch.Tensor:
    """The loss to train on: the model's own, or for a loss-free model a loss made outside."""
    first = tensor_leaves(out)[0][1]
    return first if first.dim() == 0 else first.pow(2).mean()


def compile_case(model: torch.nn.Module, batch: tuple[Any, ...], case: Case,
                 **kwargs: Any) -> mbcompile.CompiledModule:
    """Compile for ``case``; the adjusted-MBS plan must warn, every other plan must not."""
    if case.adjusted_to is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error", MbsAdjustedWarning)
            cm = mbcompile.compile(model, case.gbs, case.num_csx, case.mbs,
                                   example_inputs=batch, **plan_free(case.mbs, **kwargs))
    else:
        with pytest.warns(MbsAdjustedWarning, match=f"mbs={case.mbs}"):
            cm = mbcompile.compile(model, case.gbs, case.num_csx, case.mbs,
                                   example_inputs=batch, **plan_free(case.mbs, **kwargs))
        assert cm.plan.mbs == case.adjusted_to
        assert cm.plan.requested_mbs == case.mbs
    return cm


def eager_step(model: torch.nn.Module, batch: tuple[Any, ...]) -> tuple[Any, dict]:
    model.zero_grad(set_to_none=True)
    out = model(*batch)
    train_loss(out).backward()
    return out, grads_of(model)


def compiled_step(cm: mbcompile.CompiledModule, model: torch.nn.Module, batch: tuple[Any, ...],
                  retained: bool, first_layer: torch.nn.Module | None = None
                  ) -> tuple[Any, dict, list[int]]:
    """One training call of ``cm``; asserts whether it warns about retained activations.

    Also returns the row counts that reached ``first_layer`` during the call.
    """
    model.zero_grad(set_to_none=True)
    rows: list[int] = []
    handle = None if first_layer is None else first_layer.register_forward_pre_hook(
        mbcompile.per_microbatch(lambda module, args: rows.append(args[0].shape[0])))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = cm(*batch)
        train_loss(out).backward()
    finally:
        if handle is not None:
            handle.remove()
    kinds = [w.category for w in caught]
    if retained:
        assert RetainedActivationsWarning in kinds
    else:  # one scalar loss inside: backward runs per microbatch, no activations kept
        assert RetainedActivationsWarning not in kinds, [str(w.message) for w in caught]
    return out, grads_of(model), rows


def check_rows(rows: list[int], cm: mbcompile.CompiledModule, case: Case) -> None:
    """Microbatching happened: the first layer saw each non-empty microbatch, never > MBS."""
    plan = cm.plan
    nonempty = [s for system in plan.microbatch_sizes for s in system if s > 0]
    assert sum(rows) == case.gbs
    assert max(rows) <= plan.mbs
    assert rows == nonempty  # system by system, microbatch by microbatch, in batch order
    if case.mbs == "none":
        assert len(rows) == case.num_csx  # one microbatch per system
    elif case.mbs != "auto":  # auto may rightly keep a small model whole on the host
        assert len(rows) > case.num_csx  # really split below the per-system batch


def assert_exact(name: str, case: Case) -> None:
    model, batch = MODELS[name](case.gbs)
    cm = compile_case(model, batch, case)
    out, grads, rows = compiled_step(cm, model, batch, retained=name in WARNS_RETAINED,
                                     first_layer=FIRST_LAYER[name](model))
    check_rows(rows, cm, case)
    want_out, want_grads = eager_step(model, batch)
    grad_err = grad_errors(grads, want_grads)
    assert grad_err, "the model has no gradients to compare"
    assert_close_errors({**max_rel_err_outputs(out, want_out), **grad_err}, TOL)


# --------------------------------------------------------------------------- #
# Training: outputs and gradients
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("case", PLAN_PARAMS)
@pytest.mark.parametrize("name", CORE_MODELS)
def test_core_models_match_eager(name: str, case: Case) -> None:
    assert_exact(name, case)


@pytest.mark.parametrize("case", LOSS_PLANS)
@pytest.mark.parametrize("name", LOSS_MODELS)
def test_loss_forms_match_eager(name: str, case: Case) -> None:
    assert_exact(name, case)


def test_plans_exercise_what_their_names_say() -> None:
    """Guard the plan table: empty microbatches and uneven splits really occur."""
    def plan(name: str) -> mbcompile.MicrobatchPlan:
        c = PLANS[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MbsAdjustedWarning)
            return mbcompile.make_plan(c.gbs, c.num_csx, c.mbs)

    assert plan("gbs10-csx3-mbs2-uneven-systems").per_system_batch_sizes == (4, 3, 3)
    assert 0 in sum(plan("gbs5-csx4-mbs1-empty-microbatches").microbatch_sizes, ())
    assert plan("gbs13-csx2-mbs3-pbs-not-multiple").microbatch_sizes == ((3, 2, 2), (2, 2, 2))
    assert plan("gbs8-csx2-none").microbatch_sizes == ((4,), (4,))


def test_token_labels_are_padded_unevenly() -> None:
    """The TinyGPT batch has -100 padding, unevenly per sample (what breaks naive means)."""
    _, (_, labels) = MODELS["tiny_gpt"](10)
    real = (labels != -100).sum(1)
    assert (labels == -100).any() and len(set(real.tolist())) > 1


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt"])
def test_grad_into_per_sample_output_of_fused_model_is_an_error(name: str) -> None:
    """With a loss inside, backward ran per microbatch for that loss only.

    A gradient arriving at a per-sample output would be dropped, so it must raise,
    never leave a silently wrong ``.grad``.
    """
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    model.zero_grad(set_to_none=True)
    per_sample = tensor_leaves(cm(*batch))[1][1]
    with pytest.raises(mbcompile.MbcompileError, match="per-sample output"):
        per_sample.pow(2).mean().backward()


@pytest.mark.parametrize("case", LOSS_PLANS)
def test_model_without_loss_trained_outside(case: Case) -> None:
    model, (x,) = MODELS["per_sample"](case.gbs)
    y = torch.randint(0, 4, (case.gbs,), generator=torch.Generator().manual_seed(7))
    cm = compile_case(model, (x,), case)
    model.zero_grad(set_to_none=True)
    with pytest.warns(RetainedActivationsWarning):
        logits = cm(x)
    assert logits.requires_grad
    F.cross_entropy(logits, y).backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(x)
    F.cross_entropy(want, y).backward()
    assert_close_errors(max_rel_err_outputs(logits, want), TOL)
    assert_close_errors(grad_errors(grads, grads_of(model)), TOL)


def test_two_losses_warns_retained_activations_once() -> None:
    model, batch = MODELS["two_losses"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    with pytest.warns(RetainedActivationsWarning, match="activations"):
        cm(*batch).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetainedActivationsWarning)
        cm(*batch).backward()


# --------------------------------------------------------------------------- #
# Gradient semantics of the user's loop
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", CORE_MODELS + ["two_losses"])
def test_backward_adds_to_existing_grads(name: str) -> None:
    """Like PyTorch: ``.grad`` holding values ends as old + this step's gradient."""
    model, batch = MODELS[name](10)
    _, step = eager_step(model, batch)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    g = torch.Generator().manual_seed(3)
    old = {}
    for n, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        old[n] = p.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RetainedActivationsWarning)
        loss_of(cm(*batch)).backward()
    want = {n: old[n] + step[n] for n in old}
    assert_close_errors(grad_errors(grads_of(model), want), TOL)


@pytest.mark.parametrize("name", ["tiny_gpt", "mlp"])
def test_two_compiled_steps_accumulate(name: str) -> None:
    model, batch = MODELS[name](10)
    _, step = eager_step(model, batch)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        loss_of(cm(*batch)).backward()
    want = {n: 2 * g for n, g in step.items()}
    assert_close_errors(grad_errors(grads_of(model), want), TOL)


@pytest.mark.parametrize("scale", [3.0, -0.25])
def test_scaled_loss_scales_grads(scale: float) -> None:
    model, batch = MODELS["cnn"](10)
    _, step = eager_step(model, batch)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    model.zero_grad(set_to_none=True)
    (scale * loss_of(cm(*batch))).backward()
    want = {n: scale * g for n, g in step.items()}
    assert_close_errors(grad_errors(grads_of(model), want), TOL)


def test_frozen_parameters_get_no_grad() -> None:
    model, batch = MODELS["mlp"](10)
    model.net[0].requires_grad_(False)
    _, want = eager_step(model, batch)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    model.zero_grad(set_to_none=True)
    loss_of(cm(*batch)).backward()
    got = grads_of(model)
    assert got["net.0.weight"] is None and got["net.0.bias"] is None
    assert_close_errors(grad_errors(got, want), TOL)


# --------------------------------------------------------------------------- #
# Inference
# --------------------------------------------------------------------------- #

INFERENCE_MODELS = CORE_MODELS + ["dict_out", "per_sample", "weighted_nll", "weighted_ce",
                                  "masked_mean_double", "masked_mean_like"]


@pytest.mark.parametrize("name", INFERENCE_MODELS)
def test_no_grad_outputs_equal_eager(name: str) -> None:
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    with torch.no_grad():
        got, want = cm(*batch), model(*batch)
    assert all(not t.requires_grad for _, t in tensor_leaves(got))
    assert_close_errors(max_rel_err_outputs(got, want), TOL)


@pytest.mark.parametrize("name", CORE_MODELS + ["batch_norm"])
def test_eval_mode_outputs_equal_eager(name: str) -> None:
    model, batch = MODELS[name](10)
    model.eval()
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    assert not model.training
    got, want = cm(*batch), model(*batch)
    assert_close_errors(max_rel_err_outputs(got, want), TOL)


def test_eval_after_compiling_in_train_mode() -> None:
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    cm.eval()
    assert not model.training
    with torch.no_grad():
        got, want = cm(*batch), model(*batch)
    assert_close_errors(max_rel_err_outputs(got, want), TOL)


def test_batch_norm_eval_trains_exactly() -> None:
    """BatchNorm in eval uses running statistics: per sample, so training the rest is exact."""
    model, batch = MODELS["batch_norm"](10)
    model.bn.running_mean.uniform_(-0.5, 0.5)
    model.bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    cm = compile_case(model, batch, PLANS["gbs10-csx3-mbs2-uneven-systems"])
    out, grads, _ = compiled_step(cm, model, batch, retained=False)
    want_out, want_grads = eager_step(model, batch)
    assert_close_errors(max_rel_err_outputs(out, want_out), TOL)
    assert_close_errors(grad_errors(grads, want_grads), TOL)


# --------------------------------------------------------------------------- #
# Microbatching really happened
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("case", PLAN_PARAMS)
@pytest.mark.parametrize("name", ["per_sample", "two_losses"])
def test_unfused_path_sees_microbatches(name: str, case: Case) -> None:
    """Without one loss inside, the loop keeps activations but still runs microbatches."""
    model, batch = MODELS[name](case.gbs)
    cm = compile_case(model, batch, case)
    _, _, rows = compiled_step(cm, model, batch, retained=True,
                               first_layer=FIRST_LAYER[name](model))
    check_rows(rows, cm, case)


def test_auto_splits_below_the_system_batch() -> None:
    """On a system too small for the whole per-system batch, auto must split it."""
    import dataclasses

    from mbcompile.planning.systems import get_system

    model, batch = MODELS["cnn"](32)
    peak = {mbs: mbcompile.compile(model, 32, 2, mbs, example_inputs=batch, compile_only=True
                                   ).estimate.memory.peak for mbs in ("none", 1)}
    assert peak[1] < peak["none"]
    small = dataclasses.replace(get_system("host"), name="small",
                                memory_bytes=(peak[1] + peak["none"]) / 2)
    cm = mbcompile.compile(model, 32, 2, "auto", example_inputs=batch, system=small)
    assert 1 <= cm.plan.mbs < cm.plan.pbs
    rows: list[int] = []
    handle = FIRST_LAYER["cnn"](model).register_forward_pre_hook(
        mbcompile.per_microbatch(lambda m, a: rows.append(a[0].shape[0])))
    try:
        with torch.no_grad():
            cm(*batch)
    finally:
        handle.remove()
    assert max(rows) <= cm.plan.mbs and sum(rows) == 32
