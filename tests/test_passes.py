"""Each pass alone, called directly on small graphs: capture, shapes, batch analysis, rewrite.

No ``mbcompile.compile`` here: every test builds its graph with the passes themselves,
chained the way ``mbcompile.compiler._analyse`` chains them (capture -> shape_prop ->
batch_analysis; then microbatch_rewrite with a hand-written split). Per pass: a
golden printout of what it writes, idempotence where it applies, and equality with
eager PyTorch on models from ``tests/models.py`` (float64).

The rewritten graphs run UNBOUND: the ops of ``mbcompile.passes.ops`` keep their
reference meaning (the loop is a plain Python loop, the all-reduce is the identity),
so autograd through the whole graph gives the gradients, with no backend involved.

Regenerate the golden files under ``tests/golden/passes/`` after an intended change with
``MBCOMPILE_UPDATE_GOLDEN=1 python -m pytest tests/test_passes.py`` and read the diff
before committing it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from models import (
    MODELS,
    assert_close_errors,
    grad_errors,
    grads_of,
    max_rel_err_outputs,
    tensor_leaves,
)
from torch.utils import _pytree as pytree

from mbcompile.passes import ops
from mbcompile.passes.batch_analysis import BatchAnalysis, analyse_batch
from mbcompile.passes.capture import CaptureResult, capture
from mbcompile.passes.errors import MixingError
from mbcompile.passes.facts import (
    FACT,
    PARAMS,
    REDUCTION,
    SHAPES,
    Batched,
    Coupled,
    Fact,
    ValueInfo,
    input_fact,
)
from mbcompile.passes.graph_walks import arg_leaves
from mbcompile.passes.microbatch_rewrite import microbatch_rewrite
from mbcompile.passes.shape_prop import propagate_shapes

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "passes"
UPDATE = os.environ.get("MBCOMPILE_UPDATE_GOLDEN") == "1"
TOL = 1e-12

#: The running example: batch 7, two systems of two microbatches each, the last one short.
GBS = 7
SLICES = ((0, 2), (2, 4), (4, 6), (6, 7))
SYSTEMS = (2, 2)


# --------------------------------------------------------------------------- #
# Small inline models
# --------------------------------------------------------------------------- #


class Zoo(nn.Module):
    """One value of every kind the shape and batch passes tell apart.

    A batch size (``x.size(0)``) and a number computed from it, a parameter and a
    batch-free value made from it, an unbatched input (``bias``), a merged batch dim
    (``(B, 2, 2) -> (2B, 2)``), a namedtuple result (``max(dim)``), a tuple result
    (``split``), a bool mask, an integer index, and a sum over the batch divided by B.
    """

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 4)
        self.gain = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        b = x.size(0)
        h = self.l(x).view(b, 2, 2) * (self.gain * 2)
        rows = h.reshape(-1, 2) + bias
        top = h.flatten(1).max(dim=1)
        halves = h.flatten(1).split(2, dim=1)
        loss = (top.values * y).sum() / b
        return loss, halves[0], top.indices, rows > 0, rows


def zoo(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = (torch.randn(batch, 6, generator=g, dtype=torch.float64),
              torch.randn(batch, generator=g, dtype=torch.float64),
              torch.randn(2, generator=g, dtype=torch.float64))
    return Zoo().to(torch.float64), inputs


ZOO_IN_DIMS = (0, 0, None)


class SoftmaxOverBatch(nn.Module):
    """Mixes samples: softmax over dim 0, the batch dim."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.l(x), dim=0).sum()


# --------------------------------------------------------------------------- #
# Helpers: the chain of passes, printouts, goldens
# --------------------------------------------------------------------------- #


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _in_dims(batch: Sequence[Any], in_dims: Sequence[int | None] | None) -> tuple[Any, ...]:
    return tuple(in_dims) if in_dims is not None else (0,) * len(batch)


def shaped(model: nn.Module, batch: Sequence[Any], in_dims: Sequence[int | None] | None = None,
           gbs: int = GBS) -> CaptureResult:
    """capture -> propagate_shapes."""
    captured = capture(model)
    propagate_shapes(captured.graph_module, list(batch), _in_dims(batch, in_dims), gbs)
    return captured


def input_facts(gm: fx.GraphModule, batch: Sequence[Any],
                in_dims: Sequence[int | None] | None = None) -> dict[str, Fact]:
    return {p.target: input_fact(v, d)
            for p, v, d in zip(_placeholders(gm), batch, _in_dims(batch, in_dims))}


def analysed(model: nn.Module, batch: Sequence[Any], in_dims: Sequence[int | None] | None = None,
             gbs: int = GBS) -> tuple[CaptureResult, BatchAnalysis]:
    """capture -> propagate_shapes -> analyse_batch."""
    captured = shaped(model, batch, in_dims, gbs)
    gm = captured.graph_module
    return captured, analyse_batch(gm, input_facts(gm, batch, in_dims), gbs)


def rewritten(analysis: BatchAnalysis, in_dims: Sequence[int | None] | None = None
              ) -> fx.GraphModule:
    placeholders = _placeholders(analysis.graph_module)
    dims = _in_dims(placeholders, in_dims)
    return microbatch_rewrite(analysis, slices=SLICES, systems=SYSTEMS,
                              in_dims={p.target: d for p, d in zip(placeholders, dims)})


_FILE_LINE = re.compile(r"# File: (?:[^\n:]*[/\\])?([^/\\\n:]+):\d+ in ")


def normalise(code: str) -> str:
    """A printout without what varies between checkouts and runs: absolute paths, line
    numbers, addresses, fx's eval keys and trailing blanks."""
    code = _FILE_LINE.sub(r"# File: \1:<line> in ", code)
    code = re.sub(r"0x[0-9a-fA-F]+", "0x?", code)
    code = re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", code)
    return "\n".join(line.rstrip() for line in code.strip().splitlines()) + "\n"


def readable(gm: fx.GraphModule) -> str:
    """fx's readable printout: the code with each node's source line, submodules nested."""
    return normalise(gm.print_readable(print_output=False))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with MBCOMPILE_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"the printout differs from {path.name}; if the change is intended, regenerate it with "
        f"MBCOMPILE_UPDATE_GOLDEN=1 and review the diff\n--- got ---\n{text}")


def describe_info(info: Any) -> str:
    """A ``ValueInfo`` (or a tuple of them) in one line: every compared field."""
    if info is None:
        return "-"
    if isinstance(info, ValueInfo):
        if info.is_tensor:
            dtype = str(info.dtype).removeprefix("torch.")
            return (f"tensor {dtype} {info.shape_a} / {info.shape_b}"
                    f" batch dims {info.batch_dims}")
        return f"{type(info.int_a).__name__} {info.int_a!r} / {info.int_b!r}"
    if isinstance(info, tuple):
        keys = getattr(info, "fields", None) or range(len(info))
        kind = type(info).__name__
        return f"{kind}(" + ", ".join(f"{k}: {describe_info(v)}" for k, v in zip(keys, info)) + ")"
    return f"?{info!r}"


def shape_listing(gm: fx.GraphModule) -> str:
    return "".join(f"{n.name}: {describe_info(n.meta[SHAPES])}\n" for n in gm.graph.nodes)


def fact_listing(gm: fx.GraphModule) -> str:
    """``node: fact`` for every node, with what the analysis writes beside the fact."""
    lines = []
    for n in gm.graph.nodes:
        line = f"{n.name}: {n.meta[FACT]}"
        if n.meta.get(PARAMS):
            line += "  [params]"
        if REDUCTION in n.meta:
            spec = n.meta[REDUCTION]
            partial = "the op itself" if spec.partial is None else spec.partial.__name__
            line += f"  [reduction: {spec.kind}, partial: {partial}]"
        lines.append(line + "\n")
    return "".join(lines)


def analysis_summary(a: BatchAnalysis) -> str:
    return (f"reductions: {[n.name for n in a.reductions]}\n"
            f"trained_loss: {a.trained_loss.name if a.trained_loss is not None else None}\n"
            f"loss_outputs: {a.loss_outputs}\n"
            f"fused: {a.fused}\n")


def _probe(leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """A scalar that depends on every float output: fixed random weights times each leaf.

    Its gradient tests the backward of per-sample outputs (joined by accumulate_cat)
    and of partial sums (added by accumulate_sum) at once.
    """
    g = torch.Generator().manual_seed(1234)
    total = torch.zeros((), dtype=torch.float64)
    for t in leaves:
        if t.is_floating_point() and t.requires_grad:
            w = torch.randn(t.shape, generator=g, dtype=t.dtype)
            total = total + (w * t).sum()
    return total


def _structure(gm: fx.GraphModule) -> list[tuple[str, str, str, str, str]]:
    return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in gm.graph.nodes]


# --------------------------------------------------------------------------- #
# capture
# --------------------------------------------------------------------------- #


def test_capture_golden_mlp() -> None:
    model, _ = MODELS["mlp"](GBS)
    check_golden("capture_mlp.txt", readable(capture(model).graph_module))


@pytest.mark.parametrize("name", ["mlp", "dict_out", "namedtuple_out", "dataclass_out"])
def test_capture_runs_equal_to_eager(name: str) -> None:
    """The flat outputs, rebuilt by the output spec, are eager's outputs (same structure)."""
    model, batch = MODELS[name](GBS)
    captured = capture(model)
    with torch.no_grad():
        got = captured.output_spec.rebuild(captured.graph_module(*batch))
        want = model(*batch)
    assert type(got) is type(want)
    assert_close_errors(max_rel_err_outputs(got, want), 0.0)


def test_capture_outputs_are_flat() -> None:
    model, _ = MODELS["dict_out"](GBS)
    captured = capture(model)
    (out,) = [n for n in captured.graph_module.graph.nodes if n.op == "output"]
    assert isinstance(out.args[0], tuple)
    assert all(isinstance(a, fx.Node) for a in out.args[0])
    assert captured.output_spec.kind == "dict"
    assert captured.output_spec.keys == ("loss", "logits", "probs")


def test_capture_is_idempotent() -> None:
    """Capturing the captured GraphModule again changes nothing; so does capturing twice."""
    model, batch = MODELS["dict_out"](GBS)
    first = capture(model)
    again = capture(first.graph_module)
    # The same nodes; only the return annotation of the generated forward may differ.
    assert _structure(again.graph_module) == _structure(first.graph_module)
    assert again.output_spec.kind == "tuple"  # the flat tuple of the captured graph
    assert capture(model).graph_module.code == first.graph_module.code
    with torch.no_grad():
        assert_close_errors(max_rel_err_outputs(again.graph_module(*batch),
                                                first.graph_module(*batch)), 0.0)


# --------------------------------------------------------------------------- #
# shape propagation
# --------------------------------------------------------------------------- #


def test_shape_prop_golden_zoo() -> None:
    model, batch = zoo(GBS)
    captured = shaped(model, batch, ZOO_IN_DIMS)
    check_golden("shape_prop_zoo.txt", shape_listing(captured.graph_module))


def test_shape_prop_sees_the_batch_dim() -> None:
    """Dims that scale with the batch, and only those, differ between the two runs."""
    model, batch = zoo(GBS)
    nodes = {n.name: n for n in shaped(model, batch, ZOO_IN_DIMS).graph_module.graph.nodes}
    assert nodes["x"].meta[SHAPES].batch_dims == (0,)
    assert nodes["bias"].meta[SHAPES].batch_dims == ()
    assert nodes["reshape"].meta[SHAPES].shape_a == (2 * GBS, 2)  # merged: B*2 rows
    size = nodes["size"].meta[SHAPES]
    assert (size.is_tensor, size.int_a, size.int_b) == (False, GBS, GBS + 1)
    assert nodes["split"].meta[SHAPES].fields is None  # a plain tuple


def test_shape_prop_names_the_fields_of_a_torch_return_type() -> None:
    model, batch = zoo(GBS)
    nodes = {n.name: n for n in shaped(model, batch, ZOO_IN_DIMS).graph_module.graph.nodes}
    assert nodes["max_1"].meta[SHAPES].fields == ("values", "indices")


def test_shape_prop_is_idempotent() -> None:
    model, batch = zoo(GBS)
    gm = shaped(model, batch, ZOO_IN_DIMS).graph_module
    first = {n: n.meta[SHAPES] for n in gm.graph.nodes}
    listing = shape_listing(gm)
    code = gm.code
    assert propagate_shapes(gm, list(batch), ZOO_IN_DIMS, GBS) is gm
    assert {n: n.meta[SHAPES] for n in gm.graph.nodes} == first
    assert shape_listing(gm) == listing
    assert gm.code == code  # an analysis: it only writes meta


def test_shape_prop_leaves_the_model_untouched() -> None:
    """Parameters and buffers enter as fake copies: BatchNorm's running statistics in
    training mode, updated by the fake run, stay as they were."""
    model, batch = MODELS["batch_norm"](GBS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shaped(model, batch)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


# --------------------------------------------------------------------------- #
# batch analysis
# --------------------------------------------------------------------------- #


def test_batch_analysis_golden_zoo() -> None:
    model, batch = zoo(GBS)
    captured, analysis = analysed(model, batch, ZOO_IN_DIMS)
    assert analysis.rejected is None
    check_golden("batch_analysis_zoo.txt",
                 fact_listing(captured.graph_module) + "\n" + analysis_summary(analysis))


def test_batch_analysis_golden_mlp() -> None:
    model, batch = MODELS["mlp"](GBS)
    captured, analysis = analysed(model, batch)
    check_golden("batch_analysis_mlp.txt",
                 fact_listing(captured.graph_module) + "\n" + analysis_summary(analysis))


@pytest.mark.parametrize(("name", "loss"), [("mlp", "mse_loss"), ("mean_output", "mean"),
                                            ("tensor_out", "cross_entropy")])
def test_the_trained_loss_of_a_mean_loss(name: str, loss: str) -> None:
    model, batch = MODELS[name](GBS)
    _, analysis = analysed(model, batch)
    assert analysis.rejected is None
    assert analysis.trained_loss is not None and analysis.trained_loss.name == loss
    assert analysis.fused
    assert analysis.reductions == (analysis.trained_loss,)
    assert analysis.loss_outputs == (0,)
    spec = analysis.trained_loss.meta[REDUCTION]
    assert spec.kind == "mean" and spec.partial is not None


@pytest.mark.parametrize("name", ["per_sample", "two_losses"])
def test_no_single_trained_loss(name: str) -> None:
    """No loss inside, or two of them: nothing to backpropagate per microbatch."""
    model, batch = MODELS[name](GBS)
    _, analysis = analysed(model, batch)
    assert analysis.rejected is None
    assert analysis.trained_loss is None and not analysis.fused
    assert len(analysis.reductions) == (0 if name == "per_sample" else 2)


def test_mixing_is_rejected_not_raised() -> None:
    torch.manual_seed(0)
    model = SoftmaxOverBatch().to(torch.float64)
    batch = (torch.randn(GBS, 6, dtype=torch.float64),)
    _, analysis = analysed(model, batch)
    err = analysis.rejected
    assert isinstance(err, MixingError)
    assert err.node == "softmax" and err.op == "torch.softmax"
    assert err.path == "x -> l -> softmax"
    assert "dim 0" in err.reason and "batch dim" in err.reason
    assert "test_passes.py" in err.source_line
    # the softmax and all it feeds are the coupled part: a two-phase step runs it exactly
    assert analysis.two_phase and analysis.trained_loss is None and analysis.reductions == ()
    facts = {n.name: n.meta[FACT] for n in analysis.graph_module.graph.nodes}
    assert isinstance(facts["softmax"], Coupled) and "dim 0" in facts["softmax"].reason
    assert isinstance(facts["l"], Batched)
    gm = rewritten(analysis)
    assert {"body", "coupled"} <= {name for name, _ in gm.named_children()}
    # a rejection the two-phase step cannot run is still refused by the rewrite
    strict = dataclasses.replace(analysis, two_phase=False)
    with pytest.raises(MixingError) as raised:
        rewritten(strict)
    assert raised.value is err


def test_batch_analysis_is_idempotent() -> None:
    model, batch = zoo(GBS)
    captured, first = analysed(model, batch, ZOO_IN_DIMS)
    gm = captured.graph_module
    listing, code = fact_listing(gm), gm.code
    second = analyse_batch(gm, input_facts(gm, batch, ZOO_IN_DIMS), GBS)
    assert fact_listing(gm) == listing
    assert analysis_summary(second) == analysis_summary(first)
    assert (second.reductions, second.trained_loss, second.loss_outputs) == (
        first.reductions, first.trained_loss, first.loss_outputs)
    assert second.graph_module is gm and gm.code == code  # an analysis: it only writes meta


# --------------------------------------------------------------------------- #
# the microbatch rewrite
# --------------------------------------------------------------------------- #


def test_rewrite_golden_mlp() -> None:
    model, batch = MODELS["mlp"](GBS)
    _, analysis = analysed(model, batch)
    check_golden("microbatch_rewrite_mlp.txt", readable(rewritten(analysis)))


def test_rewrite_golden_zoo() -> None:
    """A sum over the batch (no partial needed), an unbatched input, a batch size after
    the loop (the global one), four per-sample outputs of different kinds."""
    model, batch = zoo(GBS)
    _, analysis = analysed(model, batch, ZOO_IN_DIMS)
    check_golden("microbatch_rewrite_zoo.txt", readable(rewritten(analysis, ZOO_IN_DIMS)))


CASES = ["mlp", "tiny_gpt", "sum_loss", "mean_output", "two_losses", "per_sample", "dict_out",
         "masked_mean_bool", "zoo"]


def _case(name: str) -> tuple[nn.Module, tuple[Any, ...], tuple[Any, ...] | None]:
    if name == "zoo":
        return (*zoo(GBS), ZOO_IN_DIMS)
    return (*MODELS[name](GBS), None)


@pytest.mark.parametrize("name", CASES)
def test_unbound_rewrite_equals_eager(name: str) -> None:
    """Forward outputs and parameter gradients of the unbound rewritten graph, on the
    uneven split (2, 2 | 2, 1), equal eager PyTorch on the whole batch."""
    model, batch, in_dims = _case(name)
    captured, analysis = analysed(model, batch, in_dims)
    gm = rewritten(analysis, in_dims)

    want_out = model(*batch)
    _probe([t for _, t in tensor_leaves(want_out)]).backward()
    want_grads = grads_of(model)
    model.zero_grad(set_to_none=True)

    flat = gm(*batch)  # the body shares the model's parameters: gradients land there
    _probe(list(flat)).backward()
    got_grads = grads_of(model)

    got_out = captured.output_spec.rebuild(flat)
    assert_close_errors(max_rel_err_outputs(got_out, want_out), TOL)
    assert_close_errors(grad_errors(got_grads, want_grads), TOL)
    assert any(g is not None for g in got_grads.values())


@pytest.mark.parametrize("name", CASES)
def test_rewritten_graphs_lint(name: str) -> None:
    model, batch, in_dims = _case(name)
    _, analysis = analysed(model, batch, in_dims)
    gm = rewritten(analysis, in_dims)
    gm.graph.lint()
    gm.body.graph.lint()
    assert isinstance(gm.body, fx.GraphModule)


def _calls(gm: fx.GraphModule, op: Any) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and ops.op_of(n.target) is op]


def test_rewritten_structure_mlp() -> None:
    """split -> loop(body) -> accumulate -> one all-reduce -> combine; the model runs in
    the body only, on the parameters of the model itself."""
    model, batch = MODELS["mlp"](GBS)
    _, analysis = analysed(model, batch)
    gm = rewritten(analysis)
    (split,) = _calls(gm, ops.split)
    (loop,) = _calls(gm, ops.microbatch_loop)
    (reduce,) = _calls(gm, ops.all_reduce_sums)
    assert split.kwargs["slices"] == SLICES and split.kwargs["in_dims"] == (0, 0)
    assert loop.args == (next(n for n in gm.graph.nodes if n.op == "get_attr"), split)
    assert loop.kwargs == {"fused_index": 0, "count_index": 1, "systems": SYSTEMS,
                           "sizes": (2, 2, 2, 1)}
    assert len(_calls(gm, ops.accumulate_sum)) == 2 and len(_calls(gm, ops.accumulate_cat)) == 1
    assert len(reduce.args) == 2
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    assert gm.body.get_submodule("net.0") is model.net[0]  # shared, not copied


def test_rewrite_leaves_its_input_alone_and_repeats_itself() -> None:
    """The analysed graph is not changed by the rewrite, and a second rewrite of the same
    analysis prints the same."""
    model, batch = MODELS["mlp"](GBS)
    captured, analysis = analysed(model, batch)
    before, facts = captured.graph_module.code, fact_listing(captured.graph_module)
    first = readable(rewritten(analysis))
    assert captured.graph_module.code == before
    assert fact_listing(captured.graph_module) == facts
    assert readable(rewritten(analysis)) == first
    with torch.no_grad():
        assert_close_errors(max_rel_err_outputs(captured.graph_module(*batch), model(*batch)),
                            0.0)


def test_bind_replaces_only_the_loop() -> None:
    model, batch = MODELS["mlp"](GBS)
    _, analysis = analysed(model, batch)
    gm = rewritten(analysis)
    calls: list[int] = []

    def my_loop(body: Any, microbatches: list[tuple[Any, ...]], **kwargs: Any) -> Any:
        calls.append(len(microbatches))
        return ops.microbatch_loop(body, microbatches, **kwargs)

    bound = ops.bind(gm, {ops.microbatch_loop: my_loop})
    pairs = list(zip(gm.graph.nodes, bound.graph.nodes))
    assert len(pairs) == len(gm.graph.nodes) == len(bound.graph.nodes)
    for old, new in pairs:
        assert (new.op, new.name) == (old.op, old.name)
        if old.target is ops.microbatch_loop:
            assert new.target is my_loop
            assert ops.op_of(new.target) is ops.microbatch_loop
        else:
            assert new.target is old.target
            assert ops.op_of(new.target) is ops.op_of(old.target)
    assert [n.target for n in gm.graph.nodes if n.target is ops.microbatch_loop]  # unchanged
    assert bound.body is gm.body  # shared, not copied
    bound.graph.lint()

    with torch.no_grad():
        got, want = bound(*batch), gm(*batch)
    assert calls == [len(SLICES)]
    assert_close_errors(max_rel_err_outputs(list(got), list(want)), 0.0)


def test_bind_refuses_other_ops() -> None:
    model, batch = MODELS["mlp"](GBS)
    _, analysis = analysed(model, batch)
    with pytest.raises(ValueError, match="can be bound"):
        ops.bind(rewritten(analysis), {ops.split: ops.split})


def test_arg_leaves_are_pytrees() -> None:
    """``graph_walks.arg_leaves`` walks fx's own containers itself and hands the rest to
    pytree: the same leaves, in the same order, as ``pytree.tree_leaves`` of the arguments."""
    pair = collections.namedtuple("pair", "a b")
    graph = fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.add, (
        x, [x, (1, 2.5)], {"b": x, "a": (None, "s")}, torch.Size([2, 3]), slice(1, 2),
        pair(x, 3), torch.float32, torch.device("cpu"), True), {"k": {"z": [x], "y": 4}})
    assert arg_leaves(node) == pytree.tree_leaves((node.args, node.kwargs))
    assert len(arg_leaves(node)) == 17
