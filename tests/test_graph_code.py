"""Graph modules whose code is made once, where it is needed (``passes/graph_code.py``).

Oracles: a count of fx's code generations per module (``GraphModule.recompile``, which
the lazy module's generation runs too) and the code of a plain ``fx.GraphModule`` made
from the same graph.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.fx as fx
from models import TOL, assert_close_errors, plan_free, step_errors

import mbcompile
from mbcompile.models import make_tiny_gpt
from mbcompile.passes.graph_code import code_now, graph_module


@pytest.fixture()
def made(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Class name -> how many times fx made a module's code."""
    counts: collections.Counter[str] = collections.Counter()
    plain = fx.GraphModule.recompile

    def recompile(self: fx.GraphModule) -> object:
        counts[type(self).__name__] += 1
        return plain(self)

    monkeypatch.setattr(fx.GraphModule, "recompile", recompile)
    return counts


def _graph(scale: float) -> fx.Graph:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.mul, (x, scale)))
    return graph


def test_code_is_made_once_parent_first(made: collections.Counter[str]) -> None:
    """No code at construction, nor for a child when a parent is made around it; ``code_now``
    makes the parent's, then the child's, once each; the code is a plain module's."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("child", (x,)))
    plain = fx.GraphModule({"child": fx.GraphModule(torch.nn.Module(), _graph(2.0))}, graph)
    made.clear()
    child = graph_module(torch.nn.Module(), _graph(2.0), "Child")
    parent = graph_module({"child": child}, graph, "Parent")
    again = graph_module({"child": child}, graph, "Again")  # fx would remake child's code
    assert made == {}
    assert code_now(parent) is parent
    assert made == {"Parent": 1, "Child": 1}
    assert (parent.code, child.code) == (plain.code, plain.child.code)
    assert made == {"Parent": 1, "Child": 1}  # current: not made again
    assert again(torch.ones(2)).tolist() == [2.0, 2.0]  # a first call makes its code
    assert made["Again"] == 1


def test_a_changed_graph_gets_new_code(made: collections.Counter[str]) -> None:
    """``recompile`` after a change marks the code stale: the next call runs the new graph."""
    gm = code_now(graph_module(torch.nn.Module(), _graph(2.0), "Scaled"))
    assert gm(torch.ones(1)).item() == 2.0
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.args = (node.args[0], 3.0)
    gm.recompile()
    assert gm(torch.ones(1)).item() == 3.0
    assert made["Scaled"] == 2


def test_compile_makes_the_body_code_once(made: collections.Counter[str]) -> None:
    """A split step's body and top module get their code once per compile (fx made the
    body's with the cut, the rewrite and the binding); the captured graph and the graphs
    cut to a few blocks get none, as nothing runs them; the step equals eager's."""
    model, batch = make_tiny_gpt(8, dtype=torch.float64, vocab=32, width=16, depth=5,
                                 heads=2, seq=8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch, **plan_free(2))
    assert made["MicrobatchBody"] == 1
    assert made["MicrobatchedTinyGPT"] == 1
    assert made["TinyGPT"] == 0
    assert_close_errors(step_errors(model, cm, batch), TOL)
    assert "def forward" in cm.original_graph_module.code  # made when asked for
    assert made["TinyGPT"] == 1


class _Centred(torch.nn.Module):
    """Subtracts the batch mean: it mixes samples, so a split is refused."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.nn.functional.mse_loss(h - h.mean(0), y)


def test_an_unsplit_step_runs_the_captured_graph_with_its_code(
        made: collections.Counter[str]) -> None:
    """One system, one microbatch of a graph the analysis refuses to split: the captured
    graph is what runs, its code made at compile."""
    torch.manual_seed(0)
    model, batch = _Centred(), (torch.randn(4, 3).double(), torch.randn(4, 2).double())
    cm = mbcompile.compile(model, 4, 1, 4, example_inputs=batch, **plan_free(4))
    assert cm.graph_module is cm.original_graph_module
    assert made["_Centred"] == 1
    assert_close_errors(step_errors(model, cm, batch), TOL)
