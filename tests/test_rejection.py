"""Rejection: ops that mix samples, and ops without a rule, are compile errors.

Ops that mix samples are rejected with ``coupling="reject"``; by default the same
models run as two-phase steps, exactly (checked here too, on uneven plans, against
one eager full-batch step). An op without a rule is rejected either way.

Every model here is defined in this file, so each error must point at this file's
own source line. The expected op, node and line are found independently of
mbcompile: the node by ``torch.fx.symbolic_trace``, the line by ``inspect``.
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from models import (
    MODELS,
    TOL,
    assert_close_errors,
    grad_errors,
    grads_of,
    rel_err,
    step_errors,
)

import mbcompile
from mbcompile import MbcompileError, MixingError, UnsupportedOpError
from mbcompile.passes import rules
from mbcompile.passes.rules import BATCH_RULES, rule_key

GBS = 12
FEATURES = 6
# BatchNorm and centring cancel the Linear's bias: its gradient is zero up to rounding, so
# each gradient is measured against at least this fraction of the largest one.
GRAD_FLOOR = 1e-4


def scale_rows(x: torch.Tensor) -> torch.Tensor:
    """A made-up op fx does not trace into; it treats samples independently."""
    return x * torch.linspace(0.5, 1.5, x.shape[-1], dtype=x.dtype) + 1


torch.fx.wrap("scale_rows")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, 8)


class SoftmaxOverBatch(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.softmax(h, dim=0).pow(2).mean()  # offending


class MaxOverBatch(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.max(h, dim=0).values.sum()  # offending


class AmaxOverBatch(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h - h.amax(0)).pow(2).sum()  # offending


class SortOverBatch(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.sort(h, dim=0).values[:, 0].pow(2).mean()  # offending


class VarOverBatch(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.var(0).sum()  # offending


class CenterByBatchMean(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        centered = h - h.mean(0)  # offending
        return centered.pow(2).mean()


class SqrtOfMeanLoss(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        loss = self.lin(x).pow(2).mean()
        return loss.sqrt()  # offending


class Gram(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        return (z @ z.T).mean()  # offending


class BatchNormTrain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.lin(x))  # offending
        return h.pow(2).mean()


class BakedBatchSize(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return h.view(GBS, -1).pow(2).mean()  # offending


class FFT(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.fft.fft(h).abs().pow(2).mean()  # offending


class MadeUpOp(_Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return scale_rows(h).pow(2).mean()  # offending


def offending_line(cls: type[nn.Module]) -> tuple[int, str]:
    """(line number, code) of the line marked ``# offending`` in ``cls.forward``."""
    lines, start = inspect.getsourcelines(cls.forward)
    for i, line in enumerate(lines):
        if line.rstrip().endswith("# offending"):
            return start + i, line.split("#")[0].strip()
    raise AssertionError(f"no offending line in {cls.__name__}")


def example(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GBS, FEATURES, generator=g, dtype=torch.float64)


def build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls().double()


def compile_it(model: nn.Module, **kwargs: Any) -> mbcompile.CompiledModule:
    args = {"gbs": GBS, "num_csx": 2, "mbs": 2, **kwargs}
    return mbcompile.compile(model, example_inputs=(example(),), **args)


def assert_step_matches_eager(cm: nn.Module, model: nn.Module, x: torch.Tensor) -> None:
    """One compiled training step equals the eager full-batch step: loss and every gradient."""
    loss = cm(x)
    loss.backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(x)
    want.backward()
    assert rel_err(loss, want) <= 1e-10
    assert_close_errors(grad_errors(got, grads_of(model)), 1e-10)


# (model, what the message must call the op, the fx target of the offending node)
MIXING = [
    pytest.param(SoftmaxOverBatch, "softmax", torch.softmax, id="softmax-dim0"),
    pytest.param(MaxOverBatch, "max", torch.max, id="max-dim0"),
    pytest.param(AmaxOverBatch, "amax", "amax", id="amax-dim0"),
    pytest.param(SortOverBatch, "sort", torch.sort, id="sort-dim0"),
    pytest.param(VarOverBatch, "var", "var", id="var-dim0"),
    pytest.param(CenterByBatchMean, "sub", None, id="x-minus-batch-mean"),
    pytest.param(SqrtOfMeanLoss, "sqrt", "sqrt", id="sqrt-of-mean-loss"),
    pytest.param(Gram, "matmul", None, id="z-matmul-zT"),
    pytest.param(BatchNormTrain, "BatchNorm1d", "bn", id="batchnorm-train"),
]


def node_name_in(message: str) -> str:
    match = re.search(r"node '([^']+)'", message)
    assert match, f"no node named in:\n{message}"
    return match.group(1)


def check_message(err: MixingError, cls: type[nn.Module], op: str, target: Any) -> None:
    message = str(err)
    line, code = offending_line(cls)
    assert f"test_rejection.py:{line}" in message, message
    assert code in message, message
    assert op in message, message
    # The node is a real node of the model's graph, created on the offending line.
    traced = torch.fx.symbolic_trace(build(cls))
    nodes = {n.name: n for n in traced.graph.nodes}
    name = node_name_in(message)
    assert name in nodes, f"{name!r} is not a node of {list(nodes)}"
    node = nodes[name]
    if target is not None:
        assert node.target == target, (name, node.target)
    if node.op == "call_module":
        assert type(traced.get_submodule(node.target)).__name__ == op
    else:
        assert op in str(node.target) or op in name, (op, name, node.target)
    # The reason and the fix are spelled out.
    why = re.search(r"why:\s*(.+?)\n\s*fix:", message, re.DOTALL)
    fix = re.search(r"fix:\s*(.+)", message, re.DOTALL)
    assert why and len(why.group(1).strip()) > 20 and "batch" in why.group(1), message
    assert fix and len(fix.group(1).strip()) > 20, message


@pytest.mark.parametrize("cls, op, target", MIXING)
def test_mixing_op_is_rejected(cls: type[nn.Module], op: str, target: Any) -> None:
    with pytest.raises(MixingError) as info:
        compile_it(build(cls), coupling="reject")
    assert isinstance(info.value, MbcompileError)
    assert not isinstance(info.value, UnsupportedOpError)  # it has a rule, and the rule says no
    check_message(info.value, cls, op, target)


@pytest.mark.parametrize("cls, op, target", MIXING)
def test_mixing_op_is_rejected_whatever_the_plan(cls: type[nn.Module], op: str,
                                                 target: Any) -> None:
    """The analysis does not depend on the MBS: mbs=1 over 4 systems rejects too."""
    with pytest.raises(MixingError):
        compile_it(build(cls), num_csx=4, mbs=1, coupling="reject")


#: (num_csx, mbs): systems of 3, 3, 2, 2, 2 samples in microbatches 2+1, 2+1, 2, 2, 2;
#: systems of 3 samples in microbatches of one.
TWO_PHASE_PLANS = [(5, 2), (4, 1)]


def assert_two_phase_matches_eager(model: nn.Module, num_csx: int = 5, mbs: int = 2) -> None:
    """The default compile runs ``model`` as a two-phase step on the plan, and one step of it
    equals one eager full-batch step of a copy: loss, every gradient, running statistics."""
    x = example()
    cm = compile_it(model, num_csx=num_csx, mbs=mbs)
    assert cm.analysis.rejected is not None and "two-phase step" in cm.plan.reason
    assert len(cm.plan.microbatch_sizes) == num_csx
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TwoPhaseWarning: C holds most of the memory
        errors = step_errors(model, cm, (x,), floor=GRAD_FLOOR)
    assert_close_errors(errors, TOL)


@pytest.mark.parametrize(("num_csx", "mbs"), TWO_PHASE_PLANS)
@pytest.mark.parametrize("cls, op, target", MIXING)
def test_mixing_op_runs_as_an_exact_two_phase_step(cls: type[nn.Module], op: str, target: Any,
                                                   num_csx: int, mbs: int) -> None:
    assert_two_phase_matches_eager(build(cls), num_csx, mbs)


def test_reason_says_why_batch_norm_mixes() -> None:
    with pytest.raises(MixingError) as info:
        compile_it(build(BatchNormTrain), coupling="reject")
    message = str(info.value)
    assert "eval" in message  # the fix: running statistics
    assert "GroupNorm" in message or "LayerNorm" in message


@pytest.mark.parametrize("cls", [SoftmaxOverBatch, BatchNormTrain, Gram])
def test_suggested_mbs_none_fix_works(cls: type[nn.Module]) -> None:
    """An error that suggests mbs='none' must compile with it on one system (no split at all)."""
    with pytest.raises(MixingError) as info:
        compile_it(build(cls), coupling="reject")
    if "mbs='none'" not in str(info.value):
        pytest.fail(f"no mbs='none' fix offered; the test needs updating:\n{info.value}")
    model = build(cls)
    x = example()
    cm = mbcompile.compile(model, GBS, 1, "none", example_inputs=(x,))
    with torch.no_grad():
        assert rel_err(cm(x), model(x)) <= 1e-10


def test_batch_norm_eval_is_accepted_and_exact() -> None:
    model = build(BatchNormTrain)
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = example()
    cm = compile_it(model)
    model.zero_grad(set_to_none=True)
    assert_step_matches_eager(cm, model, x)


def test_batch_norm_without_running_stats_is_rejected_in_eval() -> None:
    """track_running_stats=False uses batch statistics even in eval mode (by default: a
    two-phase step)."""
    model = build(BatchNormTrain)
    model.bn = nn.BatchNorm1d(8, track_running_stats=False).double()
    model.eval()
    with pytest.raises(MixingError, match="BatchNorm"):
        compile_it(model, coupling="reject")
    assert_two_phase_matches_eager(model)


def test_batch_size_baked_into_a_constant_is_rejected() -> None:
    with pytest.raises(MixingError) as info:
        compile_it(build(BakedBatchSize))
    message = str(info.value)
    line, code = offending_line(BakedBatchSize)
    assert f"test_rejection.py:{line}" in message and code in message
    assert "view" in message
    assert "x.size(0)" in message or "-1" in message  # the fix names the way out


# The same ops over a feature dim are per sample: no false alarms, and exact.
FEATURE_DIM_OPS = {
    "softmax-dim1": lambda h: torch.softmax(h, dim=1),
    "log_softmax-dim-1": lambda h: F.log_softmax(h, dim=-1),
    "sort-dim-1": lambda h: torch.sort(h, dim=-1).values,
    "topk-dim1": lambda h: h.topk(3, dim=1).values,
    "max-dim1": lambda h: torch.max(h, dim=1).values,
    "amax-dim1": lambda h: h.amax(1, keepdim=True),
    "var-dim1": lambda h: h.var(1),
    "x-minus-row-mean": lambda h: h - h.mean(1, keepdim=True),
    "cumsum-dim1": lambda h: h.cumsum(1),
    "normalize": lambda h: F.normalize(h, dim=-1),
}


class FeatureDimOp(_Net):
    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.op(torch.tanh(self.lin(x))) + 0.5).pow(3).mean()


@pytest.mark.parametrize("op", FEATURE_DIM_OPS.values(), ids=FEATURE_DIM_OPS.keys())
def test_same_ops_over_a_feature_dim_are_accepted(op: Any) -> None:
    torch.manual_seed(0)
    model = FeatureDimOp(op).double()
    x = example()
    cm = compile_it(model)
    assert_step_matches_eager(cm, model, x)


# --------------------------------------------------------------------------- #
# Ops without a rule
# --------------------------------------------------------------------------- #


@pytest.fixture
def restore_rules() -> Iterator[None]:
    """Undo any rule a test registers, so the table is the same for every test."""
    before = dict(BATCH_RULES)
    try:
        yield
    finally:
        BATCH_RULES.clear()
        BATCH_RULES.update(before)


UNSUPPORTED = [
    pytest.param(FFT, torch.fft.fft, "fft", id="torch.fft.fft"),
    pytest.param(MadeUpOp, scale_rows, "scale_rows", id="fx-wrapped-function"),
]


@pytest.mark.parametrize("cls, op, op_name", UNSUPPORTED)
def test_op_without_rule_is_rejected_then_registered(cls: type[nn.Module], op: Any,
                                                     op_name: str, restore_rules: None) -> None:
    assert rule_key(op) not in BATCH_RULES
    with pytest.raises(UnsupportedOpError) as info:  # fx only: "auto" would look inside
        compile_it(build(cls), capture="fx")
    err = info.value
    assert isinstance(err, MixingError) and isinstance(err, MbcompileError)
    message = str(err)
    line, code = offending_line(cls)
    assert f"test_rejection.py:{line}" in message and code in message
    assert op_name in message
    assert "register_batch_rule" in message and "trust_module" in message

    mbcompile.register_batch_rule(op, "per_sample")
    model = build(cls)
    x = example()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cm = compile_it(model)
        assert_step_matches_eager(cm, model, x)


def test_registration_is_cleaned_up(restore_rules: None) -> None:
    """The fixture above really restores the table (the other tests rely on it)."""
    assert rule_key(scale_rows) not in BATCH_RULES
    with pytest.raises(UnsupportedOpError):
        compile_it(build(MadeUpOp), capture="fx")


def test_auto_capture_looks_inside_a_wrapped_function_before_rejecting() -> None:
    """``fx.wrap``-ped ``scale_rows`` has no rule; torch.export traces into it, and the ops
    inside have rules, so ``capture="auto"`` compiles it exactly instead of rejecting."""
    assert rule_key(scale_rows) not in BATCH_RULES
    model = build(MadeUpOp)
    x = example()
    cm = compile_it(model)
    assert cm.analysis.rejected is None
    assert_step_matches_eager(cm, model, x)


def test_unknown_rule_family_is_refused(restore_rules: None) -> None:
    with pytest.raises(ValueError, match="per_sample"):
        mbcompile.register_batch_rule(scale_rows, "probably_fine")
    assert rule_key(scale_rows) not in BATCH_RULES


def test_trust_module_makes_a_custom_layer_a_per_sample_leaf(restore_rules: None) -> None:
    """A layer whose forward has Python control flow on values: untraceable until trusted."""

    class RowNorm(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if bool((h.abs() > 100).any()):  # data-dependent: fx cannot trace this
                h = h.clamp(-100, 100)
            return h / h.norm(dim=-1, keepdim=True)

    class WithRowNorm(_Net):
        def __init__(self) -> None:
            super().__init__()
            self.norm = RowNorm()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x)).pow(3).mean()

    with pytest.raises(MbcompileError):
        compile_it(build(WithRowNorm))
    with rules.scoped():  # the trust ends with the test
        mbcompile.trust_module(RowNorm)
        model = build(WithRowNorm)
        x = example()
        assert_step_matches_eager(compile_it(model), model, x)


def test_rejection_leaves_the_model_usable() -> None:
    model, batch = MODELS["mlp"](GBS)
    bad = build(SoftmaxOverBatch)
    with pytest.raises(MixingError):
        compile_it(bad, coupling="reject")
    cm = mbcompile.compile(model, GBS, 2, 2, example_inputs=batch)
    with torch.no_grad():
        assert rel_err(cm(*batch)[0], model(*batch)[0]) <= 1e-10
