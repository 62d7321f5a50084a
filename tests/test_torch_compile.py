"""``compile(..., torch_compile=...)``: the body (and a two-phase step's coupled part) is
compiled with torch.compile once per microbatch shape of the plan and never again; the
step stays exact to float32 rounding and atomic. A training step runs each microbatch
as one joint forward-backward graph (``execution/joint.py``); where it cannot, the
compiled forward and autograd's backward, as before.

The tests use the ``aot_eager`` backend (AOTAutograd without code generation), which
needs no C++ compiler; inductor is what ``torch_compile=True`` uses, and what the
benchmark measures."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo as dynamo
import torch.fx as fx
from host_reads import HostReads
from models import (
    MODELS,
    assert_close_errors,
    one_intra_op_thread,
    step_errors,
    tensor_leaves,
    tiered,
)
from torch._dynamo.utils import counters

import mbcompile
from mbcompile.check import relative_error
from mbcompile.execution import joint
from mbcompile.models import make_tiny_gpt

AOT = {"backend": "aot_eager"}
GBS = 14  # over 2 systems with mbs 4: microbatches of 4, 3 | 4, 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: see models.one_intra_op_thread."""
    with one_intra_op_thread():
        yield


@pytest.fixture
def joint_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The microbatch sizes the joint forward-backward graph ran, call by call."""
    calls: list[int] = []
    real = joint.JointStep.__call__

    def counted(self, names, params, grads, fused_index, mb, seed):
        calls.append(next(t.shape[0] for t in mb if isinstance(t, torch.Tensor)))
        return real(self, names, params, grads, fused_index, mb, seed)

    monkeypatch.setattr(joint.JointStep, "__call__", counted)
    return calls


def _sizes(cm) -> list[int]:
    return [b - a for system in cm.plan.microbatch_slices for a, b in system if b > a]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_each_shape_compiles_once_and_the_step_is_exact(joint_calls):
    """tiny_gpt, 13 over 2 systems with mbs 3 (microbatches 3, 2, 2 | 2, 2, 2): one joint
    graph per microbatch size, each holding the whole body, and the step equals eager's
    full-batch step in float64; later steps only hit the cache. The loop lists the body's
    parameters once; which of them train is read every call (freezing the head compiles
    the graphs for that set once, and each step is still exact). One compiled module
    serves all of it: a torch.compile is seconds."""
    model, batch = MODELS["tiny_gpt"](13)
    cm = mbcompile.compile(model, 13, 2, 3, example_inputs=batch, torch_compile=AOT)
    assert _sizes(cm) == [3, 2, 2, 2, 2, 2]
    assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert joint_calls == _sizes(cm)  # the joint graph ran them all, in order
    first = _graphs()
    # one joint forward-backward graph per microbatch size, static shapes
    assert first == 2
    # ... each holding the whole body (no graph break runs part of it eagerly): every
    # linear layer of the model is in every graph
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not counters["graph_break"]
    assert counters["stats"]["calls_captured"] >= first * linears
    one_step = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):  # later steps: cache hits only, no recompilation
        cm(*batch)[0].backward()
    assert _graphs() == first
    for p, g in zip(model.parameters(), one_step):  # three steps accumulated in .grad
        assert relative_error(p.grad / 3, g) <= 1e-10

    ref = copy.deepcopy(model)
    for frozen in (True, False, True):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            m.head.requires_grad_(not frozen)
        cm(*batch)[0].backward()
        ref(*batch)[0].backward()
        assert (model.head.weight.grad is None) == frozen
        for a, b in zip(model.parameters(), ref.parameters()):
            if b.requires_grad:
                assert relative_error(a.grad, b.grad) <= 1e-10
    assert _graphs() == 2 * first  # the frozen set's graphs, once


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


def test_bad_options_are_refused():
    model, batch = make_tiny_gpt(GBS)
    with pytest.raises(mbcompile.InputError, match="torch.compile does not take"):
        mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile={"speed": 1})
    with pytest.raises(mbcompile.ArgumentTypeError):
        mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, torch_compile="yes")


# Models whose loss is computed inside (the training step the joint graph runs), with
# the output kinds the step returns beside it: logits, masks, dicts, dataclasses, counts.
# (tiny_gpt on gbs13-csx2-mbs3: test_each_shape_compiles_once_and_the_step_is_exact.)
JOINT_MODELS = ["mlp", "cnn", "masked_mean_bool", "weighted_ce", "size_normalised",
                "dict_out", "dataclass_out", "namedtuple_out"]


#: two uneven plans, each with microbatches of two sizes: systems of 4, 3, 3 (microbatches
#: 2, 2 | 2, 1 | 2, 1) and of 7, 6 (3, 2, 2 | 2, 2, 2). A joint graph is made per size, so
#: each model runs on one plan (a torch.compile is seconds) and each plan on four or five
#: models, the heaviest on the cheaper plan
JOINT_PLANS = {"gbs10-csx3-mbs2": (10, 3, 2), "gbs13-csx2-mbs3": (13, 2, 3)}
JOINT_PLAN_OF = {"mlp": "gbs13-csx2-mbs3",
                 "cnn": "gbs10-csx3-mbs2", "masked_mean_bool": "gbs13-csx2-mbs3",
                 "weighted_ce": "gbs10-csx3-mbs2", "size_normalised": "gbs10-csx3-mbs2",
                 "dict_out": "gbs13-csx2-mbs3", "dataclass_out": "gbs10-csx3-mbs2",
                 "namedtuple_out": "gbs10-csx3-mbs2"}
# the fast tier runs three models; the slow tier the rest
JOINT_CASES = tiered([(name, JOINT_PLAN_OF[name], JOINT_PLANS[JOINT_PLAN_OF[name]])
                      for name in JOINT_MODELS],
                     fast=("mlp-gbs13-csx2-mbs3", "masked_mean_bool-gbs13-csx2-mbs3",
                           "dict_out-gbs13-csx2-mbs3"), name=lambda case: f"{case[0]}-{case[1]}")


@pytest.mark.parametrize("case", JOINT_CASES)
def test_the_joint_graph_equals_the_eager_full_batch_in_float64(case, joint_calls):
    """Every microbatch of every system through the joint graph (uneven plans: short
    microbatches, systems of different sizes), against one eager full-batch step."""
    name, _, (gbs, num_csx, mbs) = case
    model, batch = MODELS[name](gbs)
    cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch, torch_compile=AOT)
    errors = step_errors(model, cm, batch)
    assert_close_errors(errors, 1e-10)
    assert joint_calls == _sizes(cm)  # the joint graph ran them all, in order


@pytest.mark.slow
def test_outputs_require_grad_as_in_the_autograd_path(joint_calls):
    """The joint graph returns detached values; which of them a gradient may enter (and
    so which come back requiring grad) is what the autograd path gives, frozen layers
    included, and a gradient sent into a per-sample output is still refused."""
    model, batch = MODELS["dict_out"](10)
    plain = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    for frozen in (False, True):
        for p in model.parameters():
            p.requires_grad_(not frozen or p.dim() < 2)  # frozen: only biases train
        want = [(path, t.requires_grad) for path, t in tensor_leaves(plain(*batch))]
        out = cm(*batch)
        assert [(path, t.requires_grad) for path, t in tensor_leaves(out)] == want
    assert joint_calls  # the joint graph ran
    per_sample = next(t for path, t in tensor_leaves(out)[1:] if t.requires_grad)
    with pytest.raises(mbcompile.MicrobatchError, match="per-sample output"):
        per_sample.pow(2).mean().backward()


@pytest.mark.slow
def test_a_parameter_hook_fires_once_on_the_step_gradient(joint_calls):
    """A hook on a parameter fires once per step, on the step's gradient, as in eager (the
    copy the eager reference steps has no hooks); the joint graph still runs, since the
    hook waits for the caller's backward (``handover.hooks_aside``)."""
    model, batch = MODELS["mlp"](10)
    seen: list[tuple[int, ...]] = []
    hook = model.net[0].weight.register_hook(lambda g: seen.append(tuple(g.shape)))
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert seen == [tuple(model.net[0].weight.shape)]  # not once per microbatch as well
    assert joint_calls == _sizes(cm)
    hook.remove()
    seen.clear()
    assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert not seen


@pytest.mark.slow
def test_a_failing_joint_graph_falls_back_to_autograd_once(joint_calls):
    """The joint graph fails (here: its compiled function raises at the second microbatch);
    the step runs the autograd way, exact, and says so once; later steps run the autograd
    way without trying the joint graph again."""
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    step = cm._compiled().channels.config.joint
    real, tries = step._step, []

    def failing(*args):
        tries.append(1)
        if len(tries) == 2:
            raise RuntimeError("no joint graph for this op")
        return real(*args)

    step._step = failing
    with pytest.warns(mbcompile.JointStepWarning, match="no joint graph for this op"):
        errors = step_errors(model, cm, batch)
    assert_close_errors(errors, 1e-10)
    assert len(joint_calls) == 2 and step.broken
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.JointStepWarning)
        assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert len(joint_calls) == 2  # not tried again


@pytest.mark.slow
def test_a_model_error_is_the_models_and_keeps_the_joint_graph(joint_calls):
    """A label out of range fails in the joint graph and in autograd alike: the step raises
    the model's error as usual, nothing changes, and the next good step uses the joint graph."""
    model, batch = MODELS["dict_out"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
    x, y = batch
    bad = y.clone()
    bad[5] = 99
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.JointStepWarning)
        with pytest.raises(mbcompile.MicrobatchError, match="out of bounds"):
            cm(x, bad)
    for p, (value, grad) in zip(model.parameters(), before):
        assert torch.equal(p, value) and torch.equal(p.grad, grad)
    assert cm._compiled().channels.config.joint.broken is None
    joint_calls.clear()
    assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert joint_calls == _sizes(cm)


@pytest.mark.slow
def test_one_host_read_per_step_and_a_failed_step_is_rolled_back(joint_calls):
    """nonfinite="raise" through the joint graph: one host read per step (the finiteness
    checks, read once at the end); a step whose losses are NaN raises and leaves every
    parameter and gradient as it was."""
    model, batch = MODELS["tiny_gpt"](13)
    cm = mbcompile.compile(model, 13, 2, 3, example_inputs=batch, torch_compile=AOT,
                           nonfinite="raise")  # the default reads nothing (test_host_sync)
    cm(*batch)[0].backward()  # the first step compiles
    joint_calls.clear()
    with HostReads() as reads:
        loss, _ = cm(*batch)
        loss.backward()
    assert reads.total == 1, dict(reads.ops)
    assert reads.ops["mbcompile.execution.runtime.read_host"] == 1
    assert joint_calls == _sizes(cm) == [3, 2, 2, 2, 2, 2]

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


class _ReadsAValue(torch.nn.Module):
    def forward(self, x):
        return (x * x.sum().item()).sum()


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x).sum(), self.unused(x)


def test_the_meta_facts_of_a_body():
    """Which outputs require grad and which parameters the loss reaches come from a run
    on meta tensors; a body that reads a value cannot run there (None: autograd)."""
    body = fx.symbolic_trace(_TwoHeads())
    params = list(body.parameters())
    names = tuple(n for n, _ in body.named_parameters())
    x = (torch.randn(4, 3),)
    facts = joint._meta_facts(body, names, params, 0, x)
    assert facts == joint.MetaFacts((True, True), (True, True, False, False),
                                    numbers=(None, None))  # (no output is a count)
    facts = joint._meta_facts(body, names[2:], params[2:], 0, x)  # only the unused head trains
    assert facts == joint.MetaFacts((False, True), (False, False), numbers=(None, None))
    reads = fx.GraphModule(_ReadsAValue(), fx.Tracer().trace(_ReadsAValue()))
    assert joint._meta_facts(reads, (), [], 0, x) is None


class _AuxHead(torch.nn.Module):
    """A classifier that also returns an auxiliary head's output, not in the loss, and
    a threshold used only in a comparison: neither gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head, self.aux = (torch.nn.Linear(8, 8), torch.nn.Linear(8, 3),
                                         torch.nn.Linear(8, 2))
        self.threshold = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, x, y):
        h = torch.tanh(self.inp(x)) * (x > self.threshold)
        return torch.nn.functional.cross_entropy(self.head(h), y), self.aux(x)


def test_parameters_the_loss_does_not_reach_keep_no_gradient(joint_calls):
    """As in eager: .grad stays None (a zero gradient would move them under weight decay
    or momentum), and an optimizer step leaves them as they were."""
    torch.manual_seed(0)
    model = _AuxHead().double()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(10, 8, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (10,), generator=g))
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert model.aux.weight.grad is None and model.threshold.grad is None
    assert joint_calls == _sizes(cm)
    before = model.aux.weight.detach().clone()
    torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1).step()
    assert torch.equal(model.aux.weight, before)


@pytest.mark.slow
def test_a_sparse_embedding_keeps_the_autograd_path():
    """torch.func.grad would hand a sparse embedding's gradient back dense."""
    model, batch = MODELS["tiny_gpt"](10)
    model.tok.sparse = True
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    assert cm._compiled().channels.config.joint is None
    cm(*batch)[0].backward()
    assert model.tok.weight.grad.is_sparse


def test_module_backward_hooks_and_saved_tensor_hooks_keep_the_autograd_path(joint_calls):
    """Both belong to autograd's backward: while present the step runs autograd, exact and
    without a warning, and the joint graph is used again once they are gone."""
    model, batch = MODELS["mlp"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT)
    seen: list[int] = []
    hook = model.net[2].register_full_backward_hook(  # counts microbatches, on purpose
        mbcompile.per_microbatch(lambda m, gi, go: seen.append(1)))
    with pytest.warns(mbcompile.RecompileWarning):  # its calls at compile are checks
        cm._compiled()
    seen.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.JointStepWarning)
        assert_close_errors(step_errors(model, cm, batch), 1e-10)
        assert not joint_calls and len(seen) == len(_sizes(cm)) + 1  # + the eager reference
        hook.remove()
        with torch.autograd.graph.save_on_cpu():
            assert_close_errors(step_errors(model, cm, batch), 1e-10)
        assert not joint_calls
        assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert joint_calls == _sizes(cm)


def test_activation_checkpointing_keeps_the_autograd_path(joint_calls):
    """torch.func.grad refuses saved-tensor hooks, which checkpointing uses: a recompute
    body has no joint step and trains with the compiled forward and autograd's backward.
    Forced onto that body, the joint graph fails inside torch.func.grad, which had
    switched saved-tensor hooks off: they are on again for the autograd path."""
    model, batch = MODELS["tiny_gpt"](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, torch_compile=AOT,
                           recompute=True)
    assert cm.plan.recompute
    assert cm._compiled().channels.config.joint is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.JointStepWarning)
        assert_close_errors(step_errors(model, cm, batch), 1e-10)
    assert not joint_calls

    body = cm.graph_module.body._orig_mod
    step = joint.JointStep(body, {"dynamic": False, **AOT})
    params = list(model.parameters())
    with torch.no_grad(), pytest.raises(Exception, match="saved tensor hooks"):
        step(step.names(params), params, None, 0, (batch[0][:2], batch[1][:2]),
             torch.ones(()))
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    assert_close_errors(step_errors(model, cm, batch), 1e-10)  # checkpointing still works


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.lin(x), y)


@pytest.mark.slow
def test_each_compiled_module_gets_its_own_joint_graphs(joint_calls):
    """Dynamo's cache limit (8) is per code object: were every JointStep's graphs kept on
    one, the ninth compiled module would run its step eagerly. With the limit lowered to
    2 (the same check, fewer compiles), four each compile theirs."""
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with dynamo.config.patch(recompile_limit=2):
        for _ in range(4):
            cm = mbcompile.compile(_Linear(), 8, 1, 4, example_inputs=(x, y),
                                   torch_compile=AOT)
            before = _graphs()
            cm(x, y).backward()
            assert _graphs() == before + 1  # its own graph, for its one microbatch size
    assert not counters["recompile_limit"]


class _Normed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.bn(self.lin(x)), y)


def test_per_microbatch_batch_norm_keeps_the_autograd_path(joint_calls):
    """Running statistics updated in place per microbatch: torch.func refuses that write,
    so the step runs autograd (no failed attempt, no warning) and equals the step without
    torch.compile, running statistics included."""
    torch.manual_seed(0)
    model = _Normed().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.PerMicrobatchStatisticsWarning)
        cm = mbcompile.compile(model, 8, 1, 2, example_inputs=(x, y), torch_compile=AOT,
                               batch_norm="per_microbatch")
        plain = mbcompile.compile(ref, 8, 1, 2, example_inputs=(x, y),
                                  batch_norm="per_microbatch")
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.JointStepWarning)
        cm(x, y).backward()
    plain(x, y).backward()
    assert not joint_calls
    assert torch.equal(model.bn.num_batches_tracked, ref.bn.num_batches_tracked)
    assert relative_error(model.bn.running_mean, ref.bn.running_mean) <= 1e-12
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-12
