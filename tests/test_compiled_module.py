"""CompiledModule's face: output structures, argument forms, in_dims, state and errors."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import pytest
import torch
from models import (
    MODELS,
    DataclassOutNet,
    Out,
    Pair,
    assert_close_errors,
    grad_errors,
    grads_of,
    max_rel_err_outputs,
    one_intra_op_thread,
    rel_err,
    step_errors,
    tensor_leaves,
)

import mbcompile
from mbcompile import InputError, MixingError

TOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: see models.one_intra_op_thread."""
    with one_intra_op_thread():
        yield


def train_and_compare(cm: mbcompile.CompiledModule, model: torch.nn.Module, args: tuple,
                      kwargs: dict | None = None) -> None:
    """One compiled training call against eager: outputs and every gradient."""
    kwargs = kwargs or {}
    model.zero_grad(set_to_none=True)
    out = cm(*args, **kwargs)
    tensor_leaves(out)[0][1].backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(*args, **kwargs)
    tensor_leaves(want)[0][1].backward()
    assert_close_errors(max_rel_err_outputs(out, want), TOL)
    assert_close_errors(grad_errors(got, grads_of(model)), TOL)


# --------------------------------------------------------------------------- #
# Output structure
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name, kind", [
    ("tensor_out", torch.Tensor),
    ("mlp", tuple),
    ("dict_out", dict),
    ("dataclass_out", Out),
    ("namedtuple_out", Pair),
])
def test_output_structure_is_kept(name: str, kind: type) -> None:
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    out = cm(*batch)
    want = model(*batch)
    assert type(out) is type(want)
    assert isinstance(out, kind)
    if isinstance(want, dict):
        assert list(out) == list(want) == ["loss", "logits", "probs"]
    if dataclasses.is_dataclass(want):
        assert [f.name for f in dataclasses.fields(out)] == ["loss", "logits", "hidden"]
    if isinstance(want, tuple):
        assert len(out) == len(want)
        if hasattr(want, "_fields"):
            assert out._fields == ("loss", "logits")
            assert out.logits is out[1]
    assert_close_errors(max_rel_err_outputs(out, want), TOL)
    train_and_compare(cm, model, batch)


def test_dataclass_output_fields_are_the_right_tensors() -> None:
    """Fields are not shuffled: each has the shape and value of its eager field."""
    model, batch = MODELS["dataclass_out"](10)
    assert isinstance(model, DataclassOutNet)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    with torch.no_grad():
        out, want = cm(*batch), model(*batch)
    assert out.loss.shape == () and out.logits.shape == (10, 4) and out.hidden.shape == (10, 16)
    for field in ("loss", "logits", "hidden"):
        assert torch.allclose(getattr(out, field), getattr(want, field), rtol=TOL, atol=0)


@pytest.mark.parametrize("name", ["dataclass_out", "mlp"])
def test_loss_of_is_the_trained_loss_the_analysis_found(name: str) -> None:
    """``cm.loss_of(output)``: the leaf the batch analysis trains, wherever the output
    keeps it (a dataclass field, a tuple position); one rule for every caller."""
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    out = cm(*batch)
    assert cm.loss_of(out) is (out.loss if name == "dataclass_out" else tensor_leaves(out)[0][1])
    model, (x,) = MODELS["per_sample"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x,), cost_model=False)
    with pytest.raises(InputError, match="no trained loss"):
        cm.loss_of(cm(x))


# --------------------------------------------------------------------------- #
# Argument forms
# --------------------------------------------------------------------------- #


def test_keyword_call() -> None:
    model, (x, y) = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y), cost_model=False)
    train_and_compare(cm, model, (), {"x": x, "y": y})
    train_and_compare(cm, model, (x,), {"y": y})


def test_compiled_from_example_kwargs_called_positionally() -> None:
    model, (x, y) = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_kwargs={"x": x[:4], "y": y[:4]})
    assert cm.plan.gbs == 10  # the example may have any batch size
    train_and_compare(cm, model, (x, y))


def test_non_tensor_arguments_are_fixed_at_compile_time() -> None:
    model, (x, y) = MODELS["flag"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y, True, 2), cost_model=False)
    train_and_compare(cm, model, (x, y, True, 2))
    train_and_compare(cm, model, (x, y), {"double": True, "repeats": 2})
    with pytest.raises(InputError, match="double"):
        cm(x, y, False, 2)
    with pytest.raises(InputError, match="repeats"):
        cm(x, y, True, 3)


def test_default_non_tensor_arguments() -> None:
    """Defaults of non-tensor parameters are fixed too; the defaults' graph is the one run."""
    model, (x, y) = MODELS["flag"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y), cost_model=False)
    train_and_compare(cm, model, (x, y))
    with pytest.raises(InputError, match="double"):
        cm(x, y, double=True)


def test_unbatched_tensor_input() -> None:
    """in_dims=(0, 0, None): the bias is shared by every microbatch, never split."""
    model, (x, y, bias) = MODELS["unbatched_input"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y, bias), in_dims=(0, 0, None))
    train_and_compare(cm, model, (x, y, bias))
    # The bias is an input, not a constant baked in at compile time.
    other = torch.linspace(-1.0, 1.0, bias.numel(), dtype=bias.dtype)
    train_and_compare(cm, model, (x, y, other))


def test_unbatched_input_of_other_length_is_not_a_batch_mismatch() -> None:
    model, (x, y, _) = MODELS["unbatched_input"](10)
    bias = torch.zeros(4, dtype=torch.float64)  # 4 != gbs; unbatched, so fine
    cm = mbcompile.compile(model, 10, 2, 1, example_inputs=(x, y, bias), in_dims=(0, 0, None))
    with torch.no_grad():
        assert_close_errors(max_rel_err_outputs(cm(x, y, bias), model(x, y, bias)), TOL)


def test_in_dims_1_for_time_major_inputs() -> None:
    model, (x, y) = MODELS["time_major"](10)
    assert x.shape[1] == 10
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y), in_dims=1, cost_model=False)
    rows: list[int] = []
    handle = model.inp.register_forward_pre_hook(
        mbcompile.per_microbatch(lambda m, a: rows.append(a[0].shape[1])))
    try:
        train_and_compare(cm, model, (x, y))
    finally:
        handle.remove()
    compiled_rows = rows[:len(rows) - 1]  # the last call is the eager reference
    assert rows[-1] == 10
    assert sum(compiled_rows) == 10 and max(compiled_rows) <= cm.plan.mbs
    out = cm(x, y)[1]
    assert out.shape == (x.shape[0], 10, 2)


# --------------------------------------------------------------------------- #
# Call-time errors
# --------------------------------------------------------------------------- #


def test_call_with_other_batch_size_is_an_input_error_when_fixed() -> None:
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False,
                           batch_sizes="fixed")
    _, (x, y) = MODELS["mlp"](12)
    with pytest.raises(InputError, match="gbs=10") as info:
        cm(x, y)
    assert "12" in str(info.value)
    assert isinstance(info.value, mbcompile.MbcompileError) and isinstance(info.value, ValueError)


def test_inputs_disagreeing_on_batch_size() -> None:
    model, (x, y) = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y), cost_model=False)
    with pytest.raises(InputError):
        cm(x, y[:9])


def test_call_with_wrong_arguments() -> None:
    model, (x, y) = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y), cost_model=False)
    with pytest.raises(InputError):
        cm(x, y, x)
    with pytest.raises(InputError):
        cm(x, z=y)


def test_train_after_eval_compile_rechecks_batch_norm() -> None:
    """BatchNorm is fine in eval; switching a strict compiled module to train must not run it."""
    model, batch = MODELS["batch_norm"](10)
    model.eval()
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, coupling="reject")
    with torch.no_grad():
        cm(*batch)
    cm.train()
    assert model.bn.training
    running = model.bn.running_mean.clone()
    with pytest.raises(MixingError, match="BatchNorm"):
        cm(*batch)
    assert torch.equal(model.bn.running_mean, running)


def test_train_after_eval_compile_runs_batch_norm_as_a_two_phase_step() -> None:
    """By default the module recompiled for training runs BatchNorm as a two-phase step:
    equal to one eager full-batch step (loss, logits, gradients, running statistics)."""
    model, batch = MODELS["batch_norm"](10)
    model.eval()
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    with torch.no_grad():
        cm(*batch)
    cm.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)  # C's share of memory
        errors = step_errors(model, cm, batch, floor=1e-4)  # inp.bias: zero up to rounding
    assert_close_errors(errors, TOL)


# --------------------------------------------------------------------------- #
# State: parameters are the model's own
# --------------------------------------------------------------------------- #


def test_parameters_are_the_models_own_objects() -> None:
    model, batch = MODELS["cnn"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    own = list(model.parameters())
    got = list(cm.parameters())
    assert len(got) == len(own)
    assert all(a is b for a, b in zip(got, own))


def test_state_dict_round_trip() -> None:
    model, batch = MODELS["tiny_gpt"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    state = cm.state_dict()
    assert state.keys() == model.state_dict().keys()
    fresh, _ = MODELS["tiny_gpt"](10, seed=5)
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                       state.values()))
    fresh.load_state_dict(state)  # strict: same keys, no "module." prefix
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)
    # ... and back: loading into the compiled module changes the user's model.
    other, _ = MODELS["tiny_gpt"](10, seed=9)
    cm.load_state_dict(other.state_dict())
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    with torch.no_grad():
        got, want = cm(*batch), other(*batch)
    assert_close_errors(max_rel_err_outputs(got, want), TOL)


def test_optimizer_step_through_compiled_module_matches_eager() -> None:
    """The user's loop, unchanged: two SGD steps compiled equal two eager steps."""
    model, batch = MODELS["mlp"](10)
    twin, _ = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    opt = torch.optim.SGD(cm.parameters(), lr=0.1, momentum=0.9)
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        cm(*batch)[0].backward()
        opt.step()
        opt_twin.zero_grad()
        twin(*batch)[0].backward()
        opt_twin.step()
    assert_close_errors({n: rel_err(p, q, floor=1.0) for (n, p), q in
                         zip(model.named_parameters(), twin.parameters())}, TOL)


def test_plan_is_frozen_and_printable() -> None:
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    assert isinstance(cm.plan, mbcompile.MicrobatchPlan)
    assert (cm.plan.gbs, cm.plan.num_csx, cm.plan.mbs) == (10, 3, 2)
    assert cm.plan.per_system_batch_sizes == (4, 3, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cm.plan.mbs = 3  # type: ignore[misc]
    text = str(cm.plan)
    assert "10" in text and "4, 3, 3" in text


def test_compile_warns_nothing_for_a_supported_plan() -> None:
    model, batch = MODELS["tiny_gpt"](10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
        cm(*batch)[0].backward()
