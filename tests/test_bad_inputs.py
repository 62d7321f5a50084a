"""The catalogue of bad inputs: every one gets the project's own error, naming the fix.

Convention (``mbcompile.errors``): everything raised on purpose is an
``MbcompileError``; ``PlanError`` and ``InputError`` are also ``ValueError``,
``ArgumentTypeError`` also ``TypeError``. Messages name the argument and say what
to do, so each case asserts on the key words of its message.

The second half holds the inputs that must *work*: non-tensor, nested
(dict/list/tuple) and keyword arguments, compared exactly with eager.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile import (
    ArgumentTypeError,
    CaptureError,
    InputError,
    MbcompileError,
    MicrobatchError,
    MixingError,
    PlanError,
)
from mbcompile.models import make_mlp
from mbcompile.passes import rules

DTYPE = torch.float64
GBS = 8


@pytest.fixture
def mlp():
    model, batch = make_mlp(GBS, dtype=DTYPE)
    return model, batch


def _compile(model, batch, gbs=GBS, num_csx=2, mbs=2, **kw):
    return mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch, **kw)


def _raises(exc_types, fn, *words):
    """Run ``fn``; it must raise one of ``exc_types`` whose message holds every word."""
    with pytest.raises(exc_types) as info:
        fn()
    assert isinstance(info.value, MbcompileError), (
        f"{type(info.value).__name__} is not an MbcompileError: {info.value}")
    message = str(info.value)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in message: {message}"
    return info.value


# --------------------------------------------------------------------------- #
# gbs and num_csx
# --------------------------------------------------------------------------- #

BAD_COUNTS = [
    (0, PlanError, ValueError),
    (-1, PlanError, ValueError),
    (-8, PlanError, ValueError),
    (True, ArgumentTypeError, TypeError),
    (False, ArgumentTypeError, TypeError),
    (8.0, ArgumentTypeError, TypeError),
    (2.5, ArgumentTypeError, TypeError),
    ("8", ArgumentTypeError, TypeError),
    (None, ArgumentTypeError, TypeError),
]


@pytest.mark.parametrize("value, cls, py", BAD_COUNTS, ids=repr)
def test_bad_gbs(mlp, value, cls, py):
    model, batch = mlp
    err = _raises(cls, lambda: mbcompile.compile(model, value, 1, example_inputs=batch), "gbs")
    assert isinstance(err, py)
    if cls is PlanError:
        assert "at least 1" in str(err)  # the fix: the smallest valid value
    else:
        assert "int" in str(err) and type(value).__name__ in str(err)


@pytest.mark.parametrize("value, cls, py", BAD_COUNTS, ids=repr)
def test_bad_num_csx(mlp, value, cls, py):
    model, batch = mlp
    err = _raises(cls, lambda: mbcompile.compile(model, GBS, value, example_inputs=batch),
                  "num_csx")
    assert isinstance(err, py)


def test_gbs_smaller_than_num_csx(mlp):
    model, batch = mlp
    err = _raises(PlanError, lambda: mbcompile.compile(model, 3, 4, example_inputs=batch),
                  "gbs", "num_csx")
    assert isinstance(err, ValueError)
    assert "gbs >= 4" in str(err) or "num_csx <= 3" in str(err)  # says how to fix it


# --------------------------------------------------------------------------- #
# mbs
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("mbs", [0, -1, -100])
def test_mbs_not_positive(mlp, mbs):
    model, batch = mlp
    err = _raises(PlanError, lambda: _compile(model, batch, mbs=mbs), "mbs", "positive")
    assert isinstance(err, ValueError)
    assert "auto" in str(err)  # names the alternatives


def test_mbs_above_per_system_batch(mlp):
    model, batch = mlp
    # gbs 8 over 2 systems: pbs 4
    err = _raises(PlanError, lambda: _compile(model, batch, mbs=5), "mbs=5", "at most",
                  "per-system batch size 4", "mbs=4")
    assert isinstance(err, ValueError)


def test_mbs_above_per_system_batch_documented_example():
    model, _ = make_mlp(4, dtype=DTYPE)
    x, y = make_mlp(240, dtype=DTYPE)[1]
    _raises(PlanError, lambda: mbcompile.compile(model, 240, 2, 121, example_inputs=(x, y)),
            "must be at most the per-system batch size 120")


@pytest.mark.parametrize("mbs", [2.0, 1.5, float("nan"), True, None, [2], (2,)], ids=repr)
def test_mbs_wrong_type(mlp, mbs):
    model, batch = mlp
    err = _raises(ArgumentTypeError, lambda: _compile(model, batch, mbs=mbs), "mbs",
                  "positive int", "'auto'")
    assert isinstance(err, TypeError)


@pytest.mark.parametrize("mbs", ["fast", "", "AUTO", "max", "explore "])
def test_mbs_unknown_string(mlp, mbs):
    model, batch = mlp
    err = _raises(PlanError, lambda: _compile(model, batch, mbs=mbs), "mbs", "'auto'",
                  "'explore'", "'none'")
    assert isinstance(err, ValueError)


def test_mbs_unknown_string_suggests_the_spelling(mlp):
    model, batch = mlp
    _raises(PlanError, lambda: _compile(model, batch, mbs="Auto"), "did you mean 'auto'")


MALFORMED_EXPLORE = [
    {"explore": {"min": 3, "max": 1}},
    {"explore": {"min": 0}},
    {"explore": {"max": -2}},
    {"explore": {"min": 1.5}},
    {"explore": {"min": "1"}},
    {"explore": {"lo": 1}},
    {"explore": 4},
    {"explor": {}},
    {"explore": {}, "auto": 1},
    {},
]


@pytest.mark.parametrize("mbs", MALFORMED_EXPLORE, ids=repr)
def test_mbs_malformed_explore_range(mlp, mbs):
    model, batch = mlp
    err = _raises(PlanError, lambda: _compile(model, batch, mbs=mbs), "malformed mbs",
                  "{'explore': {'min': a, 'max': b}}")
    assert isinstance(err, ValueError)


def test_mbs_explore_range_without_supported_value(mlp):
    model, batch = mlp
    # pbs 4: supported 1, 2, 4; [3, 3] holds none of them
    _raises(PlanError, lambda: _compile(model, batch, mbs={"explore": {"min": 3, "max": 3}}),
            "explore range", "widen the range")


# --------------------------------------------------------------------------- #
# example inputs and in_dims
# --------------------------------------------------------------------------- #


def test_example_inputs_missing(mlp):
    model, _ = mlp
    err = _raises(InputError, lambda: mbcompile.compile(model, GBS, 2, 2), "example_inputs",
                  "compile(model, gbs, num_csx, example_inputs=")
    assert isinstance(err, ValueError)


def test_example_inputs_do_not_match_forward(mlp):
    model, (x, y) = mlp
    _raises(InputError, lambda: _compile(model, (x, y, x)), "example inputs", "forward")
    _raises(InputError, lambda: _compile(model, (x,)), "example inputs", "forward")


def test_model_not_a_module(mlp):
    _, batch = mlp
    err = _raises(ArgumentTypeError, lambda: _compile(lambda x, y: x, batch), "model",
                  "nn.Module")
    assert isinstance(err, TypeError)


def test_in_dims_tuple_of_wrong_length(mlp):
    model, batch = mlp
    err = _raises(InputError, lambda: _compile(model, batch, in_dims=(0,)), "in_dims",
                  "1 entries", "2 positional")
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("in_dims", ["0", 1.0, True, {"x": "0"}, {"x": True}, (0, 0.0)],
                         ids=repr)
def test_in_dims_wrong_type(mlp, in_dims):
    model, batch = mlp
    err = _raises(ArgumentTypeError, lambda: _compile(model, batch, in_dims=in_dims),
                  "in_dims", "int")
    assert isinstance(err, TypeError)


def test_in_dims_beyond_the_input_rank(mlp):
    model, batch = mlp
    err = _raises(InputError, lambda: _compile(model, batch, in_dims=2), "in_dims", "'x'",
                  "dims", "in_dims=None")
    assert isinstance(err, ValueError)


def test_in_dims_on_a_zero_dim_tensor():
    class Temperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, y, t):
            return F.cross_entropy(self.lin(x) / t, y)

    torch.manual_seed(0)
    model = Temperature().to(DTYPE)
    batch = (torch.randn(GBS, 4, dtype=DTYPE), torch.randint(0, 3, (GBS,)),
             torch.tensor(2.0, dtype=DTYPE))
    # a batch dim given to it explicitly is refused with a message for scalars
    _raises(InputError, lambda: _compile(model, batch, in_dims=(0, 0, 0)), "'t'", "is a scalar",
            "give it None", "torch.stack them in the collator")
    # by default a scalar has no batch dim (issue 27: HF's num_items_in_batch)
    ref = copy.deepcopy(model)
    cm = _compile(model, batch)
    assert torch.equal(cm(*batch).detach(), model(*batch).detach()) or torch.allclose(
        cm(*batch), model(*batch), rtol=1e-12, atol=0)
    # passed whole, and read at each call: a new value gives eager's gradients
    later = (*batch[:2], torch.tensor(0.5, dtype=DTYPE))
    cm(*later).backward()
    ref(*later).backward()
    assert all(torch.allclose(p.grad, q.grad, rtol=0, atol=1e-14)
               for p, q in zip(model.parameters(), ref.parameters()))


def test_in_dims_that_make_batch_sizes_disagree(mlp):
    model, batch = mlp  # x (8, 8), y (8, 3): in_dims 1 gives batches 8 and 3
    err = _raises(InputError, lambda: _compile(model, batch, in_dims=(0, 1)), "in_dims",
                  "'x'", "'y'")
    assert isinstance(err, ValueError)


def test_example_inputs_whose_batch_sizes_disagree(mlp):
    model, (x, y) = mlp
    err = _raises(InputError, lambda: _compile(model, (x, y[:6])), "'x'", "'y'", "8", "6")
    assert isinstance(err, ValueError)


def test_in_dims_negative_is_a_clear_error_or_works(mlp):
    """vmap accepts negative in_dims; mbcompile must either accept them or say so plainly."""
    model, (x, y) = mlp
    try:
        cm = _compile(model, (x, y), in_dims=-2)
    except InputError as err:
        assert "in_dims" in str(err)
        assert re.search(r"negative|non-negative|>= ?0", str(err)), (
            f"message does not say negative in_dims are not supported: {err}")
    else:
        assert torch.allclose(cm(x, y)[0], model(x, y)[0], rtol=1e-10, atol=0)


def test_in_dims_dict_with_unknown_name(mlp):
    """A typo in an in_dims key must not be ignored silently."""
    model, batch = mlp
    _raises(InputError, lambda: _compile(model, batch, in_dims={"z": 0}), "in_dims", "'z'")


# --------------------------------------------------------------------------- #
# calls that do not match the compiled module
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("batch_size", [1, 6, 7, 9, 16])
def test_call_with_another_batch_size(mlp, batch_size):
    model, batch = mlp
    cm = _compile(model, batch, batch_sizes="fixed")  # the default plans other sizes
    x, y = make_mlp(batch_size, dtype=DTYPE)[1]
    err = _raises(InputError, lambda: cm(x, y), "gbs=8", str(batch_size))
    assert isinstance(err, ValueError)
    assert "batch_sizes='any'" in str(err)


def test_call_with_batch_sizes_that_disagree(mlp):
    model, (x, y) = mlp
    cm = _compile(model, (x, y))
    err = _raises(InputError, lambda: cm(x, y[:6]), "'x'", "'y'", "8", "6", "disagree",
                  "into one tensor a field", "in_dims={name: None}")
    assert isinstance(err, ValueError)


def test_call_with_wrong_arguments(mlp):
    model, (x, y) = mlp
    cm = _compile(model, (x, y))
    _raises(InputError, lambda: cm(x), "forward")
    _raises(InputError, lambda: cm(x, y, x), "forward")
    _raises(InputError, lambda: cm(x, y, z=x), "forward")


def test_call_with_fewer_dims_than_in_dims(mlp):
    model, (x, y) = mlp
    cm = _compile(model, (x, y))
    _raises(InputError, lambda: cm(x, y[:, 0].sum()), "'y'", "in_dims")


class SeqNormNet(nn.Module):
    """The loss divides by ``x.size(0) * x.size(1)``: B times a non-batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return (self.lin(x) ** 2).sum() / (x.size(0) * x.size(1))


def test_call_with_another_non_batch_shape_is_exact_or_rejected():
    """Compiled for (8, 4, 3), called with (8, 6, 3): the eager answer, or an InputError."""
    torch.manual_seed(0)
    model = SeqNormNet().to(DTYPE)
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(torch.randn(GBS, 4, 3, dtype=DTYPE),))
    x = torch.randn(GBS, 6, 3, dtype=DTYPE)
    try:
        got = cm(x)
    except InputError as err:
        assert "'x'" in str(err) and "shape" in str(err).lower() and "compile again" in str(err)
    else:
        want = model(x)
        assert torch.allclose(got, want, rtol=1e-10, atol=0), (
            f"silent wrong answer: compiled {got.item()} vs eager {want.item()} (a size baked "
            "in at compile time)")


# --------------------------------------------------------------------------- #
# models that cannot be compiled
# --------------------------------------------------------------------------- #


class DataDependentBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        if x.sum() > 0:  # control flow on a tensor value: fx cannot trace it
            return F.mse_loss(self.lin(x), y)
        return 2 * F.mse_loss(self.lin(x), y)


def test_untraceable_model(mlp):
    _, batch = mlp
    model = DataDependentBranch().to(DTYPE)
    err = _raises(CaptureError, lambda: _compile(model, batch), "DataDependentBranch",
                  "Fix:")
    assert "test_bad_inputs.py" in str(err)  # the user's source line
    assert "if x.sum() > 0" in str(err)


class VarArgsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, *args):
        return F.mse_loss(self.lin(args[0]), args[1])


def test_forward_with_var_args(mlp):
    _, batch = mlp
    _raises(CaptureError, lambda: _compile(VarArgsNet().to(DTYPE), batch), "*args",
            "Wrap the model")


class BatchNormTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, y):
        return F.mse_loss(self.bn(self.lin(x))[:, :3], y)


def test_mixing_model_is_rejected_with_node_line_and_fix(mlp):
    _, batch = mlp
    err = _raises(MixingError, lambda: _compile(BatchNormTrain().to(DTYPE), batch,
                                                coupling="reject"),
                  "BatchNorm1d", "'bn'", "why:", "fix:")
    assert "test_bad_inputs.py" in str(err)
    # eval mode uses running statistics: per sample, so it compiles
    model = BatchNormTrain().to(DTYPE).eval()
    _compile(model, batch)


def test_the_fix_a_mixing_error_suggests_works(mlp):
    """Every rejection says what to do; when that is mbs='none', it must compile and be exact."""
    _, batch = mlp
    model = BatchNormTrain().to(DTYPE)
    with pytest.raises(MixingError) as info:
        _compile(model, batch, coupling="reject")
    message = str(info.value)
    assert message.count("mbs='none'") <= 1, f"the same fix is offered twice: {message}"
    if "mbs='none'" not in message:
        return
    # with num_csx=2 the systems still split the batch: mbs='none' alone is no fix
    assert "num_csx=1" in message, f"mbs='none' is offered without num_csx=1: {message}"
    # one system, one microbatch: nothing is split, so nothing can mix
    cm = mbcompile.compile(model, GBS, 1, "none", example_inputs=batch)
    reference = copy.deepcopy(model)
    got, want = cm(*batch), reference(*batch)
    assert torch.allclose(got, want, rtol=1e-10, atol=0)


# --------------------------------------------------------------------------- #
# the meta device
# --------------------------------------------------------------------------- #


def test_model_on_meta_device(mlp):
    model, batch = mlp
    meta = copy.deepcopy(model).to("meta")
    err = _raises(InputError, lambda: _compile(meta, batch), "meta", "to_empty")
    assert isinstance(err, ValueError)


class BufferOnly(nn.Module):
    """No parameters, one buffer: still a model on the meta device when moved there."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(8, dtype=DTYPE))

    def forward(self, x):
        return x * self.scale


def test_buffer_only_model_on_meta_device(mlp):
    _, (x, _) = mlp
    _raises(InputError, lambda: mbcompile.compile(BufferOnly().to("meta"), GBS, 2, 2,
                                                  example_inputs=(x,)), "meta")


def test_example_inputs_on_meta_device(mlp):
    """A CPU model with meta example inputs: an input problem, not 'cannot be microbatched'."""
    model, (x, y) = mlp
    _raises(InputError, lambda: _compile(model, (x.to("meta"), y.to("meta"))), "meta",
            "example_inputs")


# --------------------------------------------------------------------------- #
# failures inside a microbatch
# --------------------------------------------------------------------------- #


class Injected(Exception):
    pass


def _raise_on_call(module: nn.Module, k: int) -> dict[str, int]:
    """Make ``module`` raise ``Injected`` on its ``k``-th call (0-based) from now on."""
    state = {"calls": 0}

    def hook(mod, args):
        state["calls"] += 1
        if state["calls"] - 1 == k:
            raise Injected(f"injected failure on call {k}")

    module.register_forward_pre_hook(mbcompile.per_microbatch(hook))
    return state


def test_model_raising_inside_a_microbatch_names_system_and_microbatch():
    model, (x, y) = make_mlp(10, dtype=DTYPE)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y))  # ((2, 2), (2, 1), (2, 1))
    _raise_on_call(model.net[0], 3)  # the 4th microbatch to run: system 1, microbatch 1
    with pytest.raises(MicrobatchError) as info:
        cm(x, y)
    message = str(info.value)
    assert "system 1" in message and "microbatch 1" in message, message
    assert isinstance(info.value.__cause__, Injected)  # the user's exception, kept
    assert all(p.grad is None for p in model.parameters())


def test_model_raising_inside_a_microbatch_under_no_grad():
    model, (x, y) = make_mlp(10, dtype=DTYPE)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y))
    _raise_on_call(model.net[0], 4)  # system 2, microbatch 0
    with torch.no_grad(), pytest.raises(MicrobatchError) as info:
        cm(x, y)
    assert "system 2" in str(info.value) and "microbatch 0" in str(info.value)
    assert isinstance(info.value.__cause__, Injected)


class Checked(nn.Module):
    """A user layer with a Python-level check; trusted, so it runs per microbatch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0
        self.fail_on = -1

    def forward(self, x):
        self.calls += 1
        if self.calls - 1 == self.fail_on:
            raise Injected("a check inside a trusted layer failed")
        return torch.tanh(self.lin(x))


class CheckedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.checked = Checked()
        self.out = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.mse_loss(self.out(self.checked(x)), y)


def test_trusted_module_is_a_leaf_and_raising_in_it_is_reported():
    """trust_module promises a leaf that is never traced into: its forward runs per call."""
    with rules.scoped():  # the trust ends with the test
        mbcompile.trust_module(Checked)
        torch.manual_seed(0)
        model = CheckedNet().to(DTYPE)
        x, y = make_mlp(10, dtype=DTYPE)[1]
        cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(x, y))
    targets = [n.target for n in cm.original_graph_module.graph.nodes if n.op == "call_module"]
    assert "checked" in targets, f"Checked was traced into: {targets}"
    model.checked.calls, model.checked.fail_on = 0, 5  # system 2, microbatch 1
    with pytest.raises(MicrobatchError) as info:
        cm(x, y)
    assert "system 2" in str(info.value) and "microbatch 1" in str(info.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_loss_names_system_and_microbatch(bad):
    model, (x, y) = make_mlp(GBS, dtype=DTYPE)
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, y),  # ((2, 2), (2, 2))
                           nonfinite="raise")  # the default returns it, as eager
    y = y.clone()
    y[5, 0] = bad  # sample 5: (pred - nan)^2 is nan, (pred - inf)^2 is inf
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MicrobatchError) as info:
        cm(x, y)
    message = str(info.value)
    assert "system 1" in message and "microbatch 0" in message, message  # sample 5
    assert ("nan" if bad != bad else "inf") in message
    assert "rolled back" in message
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g and torch.equal(p.grad, torch.full_like(p, 0.5))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


# --------------------------------------------------------------------------- #
# inputs that must work: non-tensor, nested, keyword
# --------------------------------------------------------------------------- #


def _assert_exact(got, want, rel=1e-10):
    flat_got, spec_got = torch.utils._pytree.tree_flatten(got)
    flat_want, spec_want = torch.utils._pytree.tree_flatten(want)
    assert spec_got == spec_want, f"structure differs: {spec_got} vs {spec_want}"
    for g, w in zip(flat_got, flat_want):
        if isinstance(w, torch.Tensor):
            assert g.shape == w.shape and g.dtype == w.dtype
            scale = w.detach().abs().max().item() if w.numel() else 0.0
            err = (g.detach() - w.detach()).abs().max().item() if w.numel() else 0.0
            assert err <= rel * max(scale, 1e-300), f"relative error {err / max(scale, 1e-300)}"
        else:
            assert g == w


def _check_step(model, cm_args, cm_kwargs, gbs=GBS, num_csx=2, mbs=2, in_dims=0):
    """Compile with this example call, then compare one training step with eager."""
    reference = copy.deepcopy(model)
    cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=cm_args,
                           example_kwargs=cm_kwargs, in_dims=in_dims)
    want = reference(*cm_args, **cm_kwargs)
    got = cm(*cm_args, **cm_kwargs)
    _assert_exact(got, want)
    loss_of = (lambda out: out["loss"]) if isinstance(want, dict) else (
        (lambda out: out[0]) if isinstance(want, (tuple, list)) else (lambda out: out))
    loss_of(want).backward()
    loss_of(got).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        _assert_exact(p.grad, q.grad)
    return cm


class NestedNet(nn.Module):
    """A dict input holding a tuple, a list of extra tensors, keyword-only arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, batch, extras, *, weight):
        h = self.a(batch["x"]) + self.b(batch["pair"][1]) * batch["pair"][0]
        h = h + extras[0] * extras[1]
        loss = ((h - batch["y"]).pow(2).sum(1) * weight.sum(1)).mean()  # per-sample weights
        return {"loss": loss, "parts": [h, (torch.tanh(h),)]}


def _nested_batch(gbs=GBS, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=DTYPE)

    batch = {"x": r(gbs, 4), "pair": (r(gbs, 1), r(gbs, 5)), "y": r(gbs, 3)}
    return batch, [r(gbs, 3), r(gbs, 1)], r(gbs, 2)


def test_nested_dict_list_tuple_and_keyword_inputs_work():
    torch.manual_seed(0)
    model = NestedNet().to(DTYPE)
    batch, extras, weight = _nested_batch()
    cm = _check_step(model, (batch, extras), {"weight": weight}, num_csx=3, mbs=1)
    # the same call with every argument passed by keyword
    with torch.no_grad():
        _assert_exact(cm(batch=batch, extras=extras, weight=weight),
                      model(batch, extras, weight=weight))


def test_nested_input_whose_leaves_disagree_names_the_leaf():
    torch.manual_seed(0)
    model = NestedNet().to(DTYPE)
    batch, extras, weight = _nested_batch()
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(batch, extras),
                           example_kwargs={"weight": weight})
    bad = {**batch, "y": batch["y"][:6]}
    err = _raises(InputError, lambda: cm(bad, extras, weight=weight), "batch", "8", "6")
    assert re.search(r"""\[['"]y['"]\]|'y'""", str(err)), (
        f"message does not say which leaf of 'batch' has 6 samples: {err}")


def test_nested_input_with_another_structure_is_an_input_error():
    torch.manual_seed(0)
    model = NestedNet().to(DTYPE)
    batch, extras, weight = _nested_batch()
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(batch, extras),
                           example_kwargs={"weight": weight})
    missing = {"x": batch["x"], "y": batch["y"]}  # no "pair"
    _raises(InputError, lambda: cm(missing, extras, weight=weight), "'batch'")


class FlagsNet(nn.Module):
    """Non-tensor arguments of every common kind, with defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x, y, scale=1.0, mode="mean", double=False, repeats=1, mask=None,
                dims=(0,)):
        h = self.lin(x) * scale
        for _ in range(repeats):
            h = h + torch.tanh(h)
        if double:
            h = 2 * h
        if mask is not None:
            h = h * mask
        loss = F.mse_loss(h, y, reduction=mode)
        return loss, h


def _flags_batch(gbs=GBS):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(gbs, 4, generator=g, dtype=DTYPE),
            torch.randn(gbs, 3, generator=g, dtype=DTYPE))


@pytest.mark.parametrize("kwargs", [
    {},
    {"scale": 0.5},
    {"mode": "sum"},
    {"double": True, "repeats": 2},
    {"dims": (0, 1), "scale": 2},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults")
def test_non_tensor_arguments_work(kwargs):
    torch.manual_seed(0)
    model = FlagsNet().to(DTYPE)
    x, y = _flags_batch()
    _check_step(model, (x, y), kwargs)


def test_non_tensor_argument_changed_at_call_time_is_an_input_error():
    torch.manual_seed(0)
    model = FlagsNet().to(DTYPE)
    x, y = _flags_batch()
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, y, 0.5))
    _raises(InputError, lambda: cm(x, y, 0.7), "'scale'", "0.5", "0.7", "compile again")
    # tensors in a container where None was given: named as such, not as a changed number
    _raises(InputError, lambda: cm(x, y, 0.5, mask={"m": torch.ones(GBS, 3, dtype=DTYPE)}),
            "'mask' holds tensors (dict) where the example passed None", "compile again")
    # a tensor where None was given at compile time: another graph, captured once for it
    mask = torch.rand(GBS, 3, dtype=DTYPE)
    reference = copy.deepcopy(model)
    with pytest.warns(mbcompile.RecompileWarning, match="a tensor for 'mask' where the "
                      "example passed None"):
        got = cm(x, y, 0.5, mask=mask)
    want = reference(x, y, 0.5, mask=mask)
    _assert_exact(got, want)
    got[0].backward(), want[0].backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        _assert_exact(p.grad, q.grad)


def test_unbatched_tensor_input_with_in_dims_none():
    torch.manual_seed(0)
    model = FlagsNet().to(DTYPE)
    x, y = _flags_batch()
    mask = torch.rand(3, dtype=DTYPE)  # shared by every sample
    _check_step(model, (x, y), {"mask": mask}, in_dims={"mask": None})


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y), x, y.shape[1]


def test_model_returning_an_input_unchanged(mlp):
    torch.manual_seed(0)
    model = ReturnsItsInput().to(DTYPE)
    _, batch = mlp
    _check_step(model, batch, {})


def test_keyword_only_call_of_a_positionally_compiled_module(mlp):
    model, (x, y) = mlp
    cm = _compile(model, (x, y))
    with torch.no_grad():
        _assert_exact(cm(x=x, y=y), model(x, y))
        _assert_exact(cm(x, y=y), model(x, y))
