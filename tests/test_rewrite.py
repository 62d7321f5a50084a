"""The microbatch rewrite: golden printout, lint, facts, structure and idempotence.

Regenerate the golden file after an intended change with
``MBCOMPILE_UPDATE_GOLDEN=1 python -m pytest tests/test_rewrite.py`` and read
the diff before committing it.
"""

from __future__ import annotations

import itertools
import operator
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from models import MODELS, max_rel_err_outputs, one_intra_op_thread, tensor_leaves

import mbcompile
from mbcompile.passes import ops, partials
from mbcompile.passes.facts import FACT, Batched, BatchSize, Container, Free, Reduced

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("MBCOMPILE_UPDATE_GOLDEN") == "1"
TOL = 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models: see models.one_intra_op_thread."""
    with one_intra_op_thread():
        yield


def normalise(code: str) -> str:
    """Graph code without what varies between runs: addresses and trailing blanks."""
    code = re.sub(r"0x[0-9a-fA-F]+", "0x?", code)
    code = re.sub(r"<eval_with_key>\.\d+", "<eval_with_key>", code)
    return "\n".join(line.rstrip() for line in code.strip().splitlines()) + "\n"


def printout(cm: mbcompile.CompiledModule) -> str:
    return ("# graph_module.code\n" + normalise(cm.graph_module.code)
            + "\n# graph_module.body.code\n" + normalise(cm.graph_module.body.code))


def check_golden(name: str, text: str) -> None:
    path = GOLDEN_DIR / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with MBCOMPILE_UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), (
        f"the printout differs from {path.name}; if the change is intended, regenerate it with "
        f"MBCOMPILE_UPDATE_GOLDEN=1 and review the diff\n--- got ---\n{text}")


@pytest.fixture
def mlp_10_3_2() -> tuple[mbcompile.CompiledModule, torch.nn.Module, tuple]:
    model, batch = MODELS["mlp"](10)
    return mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False), model, batch


def test_golden_mlp_gbs10_csx3_mbs2(mlp_10_3_2) -> None:
    cm, _, _ = mlp_10_3_2
    check_golden("mlp_gbs10_csx3_mbs2.txt", printout(cm))


def test_normalise_hides_addresses() -> None:
    a = "x = f(<object at 0x7f00aa>) # <eval_with_key>.12  \n"
    b = "x = f(<object at 0x55bb01>) # <eval_with_key>.3\n"
    assert normalise(a) == normalise(b)
    assert normalise("y = 1\n") != normalise("y = 2\n")


def _calls(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and ops.op_of(n.target) is target]


def test_rewritten_structure(mlp_10_3_2) -> None:
    """split -> loop(body) -> accumulate_sum x2 + accumulate_cat -> all_reduce_sums ->
    mean_combine."""
    cm, _, _ = mlp_10_3_2
    gm = cm.graph_module
    (split,) = _calls(gm, ops.split)
    (loop,) = _calls(gm, ops.microbatch_loop)
    sums = _calls(gm, ops.accumulate_sum)
    cats = _calls(gm, ops.accumulate_cat)
    (reduced,) = _calls(gm, ops.all_reduce_sums)
    (combine,) = _calls(gm, partials.mean_combine)
    assert loop.target is not ops.microbatch_loop  # bound to the simulated backend's loop
    assert isinstance(gm.body, fx.GraphModule)
    assert loop.args[0].op == "get_attr" and loop.args[0].target == "body"
    assert loop.args[1] is split
    assert len(sums) == 2 and len(cats) == 1
    assert all(n.args[0] is loop for n in sums + cats)
    assert set(reduced.args) == set(sums)
    assert all(a.target is operator.getitem and a.args[0] is reduced for a in combine.args)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert out.args[0] == (combine, cats[0])
    # The split covers exactly the plan's non-empty microbatches, in batch order.
    sizes = [s for system in cm.plan.microbatch_sizes for s in system]
    bounds = list(itertools.accumulate([0] + sizes))
    want = tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a)
    assert tuple(split.kwargs["slices"]) == want
    assert want == ((0, 2), (2, 4), (4, 6), (6, 7), (7, 9), (9, 10))
    # No ops of the model run outside the loop: the top graph only splits and combines.
    allowed = {ops.split, ops.microbatch_loop, ops.accumulate_sum, ops.accumulate_cat,
               ops.all_reduce_sums, operator.getitem, partials.mean_combine}
    assert {ops.op_of(n.target) for n in gm.graph.nodes if n.op == "call_function"} <= allowed
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]


def test_body_holds_the_model_and_partial_loss(mlp_10_3_2) -> None:
    cm, model, _ = mlp_10_3_2
    body = cm.graph_module.body
    modules = [n.target for n in body.graph.nodes if n.op == "call_module"]
    assert modules == [f"net.{i}" for i in range(5)]
    assert body.get_submodule("net.0") is model.net[0]  # shared, not copied
    targets = {n.target for n in body.graph.nodes if n.op == "call_function"}
    assert partials.mse_loss_partial in targets
    assert torch.nn.functional.mse_loss not in targets


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "cnn", "two_losses", "per_sample",
                                  "masked_mean_bool", "dict_out"])
def test_graphs_lint_and_original_is_annotated(name: str) -> None:
    model, batch = MODELS[name](10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.RetainedActivationsWarning)
        cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    cm.graph_module.graph.lint()
    cm.graph_module.body.graph.lint()
    cm.original_graph_module.graph.lint()
    facts = (Batched, BatchSize, Reduced, Free, Container)
    for node in cm.original_graph_module.graph.nodes:
        assert isinstance(node.meta.get(FACT), facts), (node.name, node.meta.get(FACT))
    placeholders = [n for n in cm.original_graph_module.graph.nodes if n.op == "placeholder"]
    assert all(isinstance(n.meta[FACT], Batched) and n.meta[FACT].dim == 0
               for n in placeholders)
    params = [n for n in cm.original_graph_module.graph.nodes if n.op == "get_attr"]
    assert all(isinstance(n.meta[FACT], Free) for n in params)


def test_facts_of_the_mlp(mlp_10_3_2) -> None:
    cm, _, _ = mlp_10_3_2
    facts = {n.name: n.meta[FACT] for n in cm.original_graph_module.graph.nodes}
    assert isinstance(facts["x"], Batched) and isinstance(facts["y"], Batched)
    assert all(isinstance(facts[f"net_{i}"], Batched) for i in range(5))
    assert isinstance(facts["mse_loss"], Reduced)


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "cnn", "dict_out"])
def test_original_graph_module_runs_and_equals_eager(name: str) -> None:
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    with torch.no_grad():
        flat = cm.original_graph_module(*batch)
        want = [t for _, t in tensor_leaves(model(*batch))]
    assert len(flat) == len(want)
    assert max(max_rel_err_outputs(list(flat), want).values()) <= TOL


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "cnn"])
def test_rewritten_graph_equals_the_graph_before_the_pass(name: str) -> None:
    """The pass alone: the rewritten GraphModule, called directly, equals the captured one."""
    model, batch = MODELS[name](10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    with torch.no_grad():
        got = cm.graph_module(*batch)
        want = cm.original_graph_module(*batch)
    assert max(max_rel_err_outputs(list(got), list(want)).values()) <= TOL


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "cnn", "two_losses"])
def test_compiling_twice_gives_the_same_graph(name: str) -> None:
    model, batch = MODELS[name](10)
    first = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    second = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    assert printout(first) == printout(second)
    assert first.original_graph_module.code == second.original_graph_module.code
    # A fresh, equal model compiles to the same code as well.
    twin, batch2 = MODELS[name](10, seed=1)
    assert printout(mbcompile.compile(twin, 10, 3, 2, example_inputs=batch2)) == printout(first)


def test_plan_changes_only_the_split_and_loop() -> None:
    model, batch = MODELS["mlp"](10)
    a = mbcompile.compile(model, 10, 3, 2, example_inputs=batch, cost_model=False)
    b = mbcompile.compile(model, 10, 2, 1, example_inputs=batch, cost_model=False)
    assert normalise(a.graph_module.body.code) == normalise(b.graph_module.body.code)
    assert a.graph_module.code != b.graph_module.code


def test_rewrite_keeps_source_lines(mlp_10_3_2) -> None:
    """New nodes copy meta from the node they stand for, so source lines survive."""
    cm, _, _ = mlp_10_3_2
    (combine,) = _calls(cm.graph_module, partials.mean_combine)
    assert "mse_loss" in (combine.stack_trace or "")
    body_calls = [n for n in cm.graph_module.body.graph.nodes if n.op == "call_module"]
    assert all(n.stack_trace for n in body_calls)
