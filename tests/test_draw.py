"""Graph views: split/loop/accumulate visible; a rejected model's mixing op and path in red."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.draw import draw, to_dot
from mbcompile.errors import MbcompileError, MbcompileWarning, MixingError
from mbcompile.models import make_mlp

HAS_DOT = shutil.which("dot") is not None


class Normed(nn.Module):
    """BatchNorm in training mixes samples: rejected at node 'bn'."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.l(x)).relu()).mean()


@pytest.fixture(scope="module")
def compiled():
    model, batch = make_mlp(8)
    return mbcompile.compile(model, 8, 2, 2, example_inputs=batch)


@pytest.fixture(scope="module")
def rejected():
    model = Normed()
    with pytest.raises(MixingError) as info:
        mbcompile.compile(model, 8, 2, 2, example_inputs=(torch.randn(8, 4),))
    return model, info.value


def node_line(dot: str, node_id: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith(f'"{node_id}" ['))


def test_original_and_rewritten_graphs_with_the_loop_visible(compiled):
    dot = to_dot(compiled)
    assert dot.startswith("digraph mbcompile {") and dot.rstrip().endswith("}")
    for cluster in ("cluster_original", "cluster_rewritten", "cluster_body"):
        assert f'subgraph "{cluster}"' in dot
    assert "invtrapezium" in node_line(dot, "r_microbatches")  # split
    loop = node_line(dot, "r_loop")
    assert "box3d" in loop and "2 per system x 2 systems, mbs 2" in loop
    assert "accumulate_sum" in node_line(dot, "r_mse_loss_sum")
    assert "accumulate_cat" in node_line(dot, "r_net_4")
    assert '"r_loop" -> "b_x" [lhead="cluster_body"' in dot  # the loop runs the body
    # the body shows per-microbatch shapes; the original graph the whole batch's
    assert "(2, 8) per microbatch" in node_line(dot, "b_x")
    assert "(8, 8)" in node_line(dot, "o_x") and "per-sample(dim 0)" in node_line(dot, "o_x")
    # every edge joins declared nodes
    declared = set(re.findall(r'^\s*"([^"]+)" \[', dot, re.M))
    for a, b in re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', dot, re.M):
        assert a in declared and b in declared


def test_rejected_model_highlights_the_mixing_op_and_its_path(rejected):
    model, error = rejected
    assert error.node == "bn" and error.path == "x -> l -> bn"
    dot = to_dot(model, error=error)
    assert 'fillcolor="#f87171"' in node_line(dot, "o_bn")  # the mixing op
    for name in ("o_x", "o_l"):
        assert 'fillcolor="#fecaca"' in node_line(dot, name)  # its path from the input
    assert '"o_x" -> "o_l" [color="#b91c1c"' in dot
    assert '"o_l" -> "o_bn" [color="#b91c1c"' in dot
    assert 'fillcolor="#ffffff"' in node_line(dot, "o_head")  # off the path: plain
    assert "BatchNorm" in node_line(dot, "note")


def test_draw_writes_dot_and_renders_where_graphviz_is(tmp_path, compiled, rejected,
                                                       monkeypatch):
    files = draw(compiled, tmp_path / "g.dot")
    assert files == [tmp_path / "g.dot"] and (tmp_path / "g.dot").read_text().startswith(
        "digraph")
    if HAS_DOT:
        files = draw(rejected[0], tmp_path / "rejected.svg", error=rejected[1])
        assert files == [tmp_path / "rejected.dot", tmp_path / "rejected.svg"]
        assert "<svg" in (tmp_path / "rejected.svg").read_text()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.warns(MbcompileWarning, match="Graphviz's 'dot' is not installed"):
        files = draw(compiled, tmp_path / "nodot.svg")
    assert files == [tmp_path / "nodot.dot"]


def test_bad_targets(tmp_path, compiled):
    with pytest.raises(MbcompileError, match=r"\.dot, \.gv, \.svg"):
        draw(compiled, tmp_path / "graph.txt")
    with pytest.raises(MbcompileError, match="draw\\(\\) takes"):
        to_dot(42)
