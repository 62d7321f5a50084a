"""Graph views: split/loop/accumulate visible; a rejected model's mixing op and path in red;
SVG with or without Graphviz."""

from __future__ import annotations

import importlib
import itertools
import re
import shutil
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.errors import MbcompileError, MbcompileWarning, MixingError
from mbcompile.models import make_mlp, make_tiny_gpt
from mbcompile.reports.draw import draw, to_dot, to_svg
from mbcompile.reports.picture import picture as draw_picture
from mbcompile.reports.svg import place

drawing = importlib.import_module("mbcompile.reports.draw")  # the module, not mbcompile.draw
HAS_DOT = shutil.which("dot") is not None
SVG = "{http://www.w3.org/2000/svg}"


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
        mbcompile.compile(model, 8, 2, 2, example_inputs=(torch.randn(8, 4),),
                          coupling="reject")
    return model, info.value


@pytest.fixture
def no_graphviz(monkeypatch):
    """A machine without Graphviz's ``dot``, whether or not this one has it."""
    monkeypatch.setattr(drawing, "_graphviz", lambda: None)


def node_line(dot: str, node_id: str) -> str:
    return next(line for line in dot.splitlines() if line.strip().startswith(f'"{node_id}" ['))


def svg_lines(root: ET.Element) -> set[str]:
    """Every line of text in the drawing (Graphviz: one <text> each; ours: one <tspan>)."""
    return {"".join(el.itertext()).strip() for el in root.iter()
            if el.tag in (SVG + "text", SVG + "tspan")}


def svg_nodes(root: ET.Element) -> dict[str, ET.Element]:
    """The node groups of our SVG by node id."""
    return {g.get("id"): g for g in root.iter(SVG + "g") if g.get("class") == "node"}


def declared(dot: str) -> set[str]:
    return set(re.findall(r'^\s*"([^"]+)" \[', dot, re.M))


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
    for a, b in re.findall(r'^\s*"([^"]+)" -> "([^"]+)"', dot, re.M):
        assert a in declared(dot) and b in declared(dot)


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


def test_the_svg_needs_no_graphviz(tmp_path, compiled, rejected, no_graphviz):
    files = draw(rejected[0], tmp_path / "rejected.svg", error=rejected[1])
    assert files == [tmp_path / "rejected.dot", tmp_path / "rejected.svg"]
    root = ET.parse(tmp_path / "rejected.svg").getroot()  # valid XML
    assert root.tag == SVG + "svg"
    assert {"x", "l", "bn", "relu", "head", "mean", "output", "BatchNorm1d"} <= svg_lines(root)
    nodes = svg_nodes(root)
    assert nodes["o_bn"][1].get("fill") == "#f87171"  # [0] is the <title>, [1] the outline
    assert nodes["o_l"][1].get("fill") == "#fecaca" and nodes["o_head"][1].get("fill") == "#ffffff"

    draw(compiled, tmp_path / "graph.svg", title='a <"title"> & more')
    root = ET.parse(tmp_path / "graph.svg").getroot()
    nodes = svg_nodes(root)
    assert set(nodes) == declared((tmp_path / "graph.dot").read_text())  # one picture, twice
    assert nodes["r_loop"][1].get("fill") == "#fcd34d"  # the loop, gold
    assert nodes["b_x"][1].get("fill") == "#dbeafe"  # per-sample, in the body
    assert {"cluster_original", "cluster_rewritten", "cluster_body"} <= {
        g.get("id") for g in root.iter(SVG + "g") if g.get("class") == "cluster"}
    assert {'a <"title"> & more', "(2, 8) per microbatch", "each microbatch"} <= svg_lines(root)


@pytest.mark.parametrize("make", [make_mlp, make_tiny_gpt], ids=["mlp", "tiny_gpt"])
def test_our_layout_keeps_nodes_apart_and_inside_their_clusters(make):
    model, batch = make(8)
    pic = draw_picture(mbcompile.compile(model, 8, 2, 2, example_inputs=batch), None, None)
    block = place(pic, "")
    boxes = list(block.nodes.values())
    assert len(boxes) == len(pic.boxes)
    for (x1, y1, w1, h1), (x2, y2, w2, h2) in itertools.combinations(boxes, 2):
        assert x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1
    frames = {c.name: (x, y, w, h) for c, x, y, w, h in block.frames}
    for b in pic.boxes:
        x, y, w, h = block.nodes[b.id]
        fx, fy, fw, fh = frames[b.cluster]
        assert fx <= x and x + w <= fx + fw and fy <= y and y + h <= fy + fh
    for a in pic.arrows:  # an edge goes down the page, except into the body cluster
        if a.lhead is None and a.head:
            assert block.nodes[a.src][1] < block.nodes[a.dst][1]


def test_graphviz_lays_out_the_svg_where_it_works(tmp_path, compiled, monkeypatch):
    if HAS_DOT:
        files = draw(compiled, tmp_path / "dot.svg")
        assert files == [tmp_path / "dot.dot", tmp_path / "dot.svg"]
        root = ET.parse(tmp_path / "dot.svg").getroot()
        assert {"loop", "microbatch_loop", "microbatches"} <= svg_lines(root)
    # a dot that fails: a warning, and our own layout
    monkeypatch.setattr(drawing, "_graphviz", lambda: shutil.which("false"))
    with pytest.warns(MbcompileWarning, match="laid out without Graphviz instead"):
        files = draw(compiled, tmp_path / "broken.svg")
    assert files[-1] == tmp_path / "broken.svg"
    assert svg_nodes(ET.parse(tmp_path / "broken.svg").getroot())


def test_png_needs_graphviz(tmp_path, compiled, no_graphviz):
    files = draw(compiled, tmp_path / "g.dot")
    assert files == [tmp_path / "g.dot"] and (tmp_path / "g.dot").read_text().startswith(
        "digraph")
    with pytest.warns(MbcompileWarning, match="draw to .svg, which needs no Graphviz"):
        files = draw(compiled, tmp_path / "nodot.png")
    assert files == [tmp_path / "nodot.dot"]
    assert to_svg(compiled).startswith("<?xml")


def test_bad_targets(tmp_path, compiled):
    with pytest.raises(MbcompileError, match=r"\.dot, \.gv, \.svg"):
        draw(compiled, tmp_path / "graph.txt")
    with pytest.raises(MbcompileError, match="draw\\(\\) takes"):
        to_dot(42)


def test_a_two_phase_step_shows_p_c_and_the_frontier(no_graphviz):
    """The body P, the coupled part C in its own cluster, and one bold frontier arrow per
    value P hands to C (here: the BatchNorm's input, and the joined labels are not read)."""
    torch.manual_seed(0)
    cm = mbcompile.compile(Normed(), 8, 2, 2, example_inputs=(torch.randn(8, 4),),
                           coupling="two_phase")
    picture = draw_picture(cm, None, None)
    clusters = {c.name: c.label for c in picture.clusters}
    assert "body (P)" in clusters["body"] and "coupled part (C)" in clusters["coupled"]
    frontier = [a for a in picture.arrows if a.label == "frontier"]
    body_outputs = next(n for n in reversed(cm.graph_module.body.graph.nodes)
                        if n.op == "output").all_input_nodes
    assert len(frontier) == len(body_outputs) == 1
    assert frontier[0].src == "b_l" and frontier[0].dst.startswith("c_")
    boxes = {b.id: b for b in picture.boxes}
    assert boxes["c_bn"].cluster == "coupled" and boxes["b_l"].cluster == "body"
    assert "two_phase" in {b.id[2:] for b in picture.boxes if b.cluster != "coupled"}
