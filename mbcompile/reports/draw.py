"""Graph views: ``mbcompile.reports.draw(cm, "graph.svg")`` writes an SVG (and the Graphviz DOT).

What is drawn, side by side in one picture:

- the **original** graph, each node coloured by its batch fact (per-sample blue,
  reductions amber, batch-free grey) and labelled with its op and shape;
- the **rewritten** graph: ``split`` (blue trapezium) -> ``microbatch_loop`` (gold)
  over the ``body`` (a dashed cluster: what runs once per microbatch) ->
  ``accumulate_cat`` / ``accumulate_sum`` (green) -> the tail after the loop; or, for a
  loss that couples samples, ``two_phase_step`` (pink) over the body P and the
  ``coupled`` part C (pink nodes, run once on the whole batch), with the frontier F
  drawn as bold pink arrows from P's outputs into C.

For a model the analysis rejected, ``draw(model, path, error=exc)`` draws its captured
graph with the mixing op in red and the path from the batched input to it in bold red,
plus a note with the reason::

    try:
        cm = mbcompile.compile(model, gbs, num_csx, example_inputs=batch)
    except mbcompile.MixingError as exc:
        mbcompile.reports.draw(model, "rejected.svg", error=exc)

The picture is built once (``_Picture``: boxes, arrows, clusters) and written two ways:
as DOT text (``to_dot``), and as SVG. The SVG needs no system program: its layout is
computed here (``to_svg``: layers from a topological order, each node under its
inputs, clusters side by side). Where Graphviz's ``dot`` is installed, ``draw`` lets
it lay the SVG out instead, which routes edges more neatly; ``.png`` and ``.pdf``
need it.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape, quoteattr

import networkx as nx
import torch.fx as fx
import torch.nn as nn

from mbcompile.compiler import CompiledModule
from mbcompile.errors import MbcompileError, MbcompileWarning, MixingError
from mbcompile.passes import ops, partials
from mbcompile.passes.facts import (
    FACT,
    SHAPES,
    Batched,
    BatchSize,
    Container,
    Coupled,
    Free,
    Reduced,
)
from mbcompile.passes.sources import user_stacklevel

__all__ = ["draw", "render", "to_dot", "to_svg"]

_FACT_COLOURS = (  # (fact type, fill): what the analysis found for the node
    (Batched, "#dbeafe"),  # per-sample
    (Reduced, "#fde68a"),  # a (partial) sum or mean over the batch
    (BatchSize, "#ede9fe"),  # an int equal to the batch size
    (Container, "#ffffff"),
    (Coupled, "#fbcfe8"),  # needs the whole batch: the coupled part of a two-phase step
    (Free, "#f3f4f6"),  # batch-free: parameters, constants
)
_RUNTIME_STYLE = {  # the nodes the rewrite adds, by function: shape, fill, bold
    ops.split: ("invtrapezium", "#93c5fd", True),
    ops.microbatch_loop: ("box3d", "#fcd34d", True),
    ops.two_phase_step: ("box3d", "#f9a8d4", True),
    ops.accumulate_cat: ("trapezium", "#86efac", True),
    ops.accumulate_sum: ("trapezium", "#86efac", True),
    ops.all_reduce_sums: ("trapezium", "#86efac", True),
    partials.mean_combine: ("trapezium", "#bbf7d0", False),
}
_RED = "#b91c1c"
_MIXING = {"fill": "#f87171", "bold": True, "penwidth": 3.0, "color": _RED}
_ON_PATH = {"fill": "#fecaca", "bold": True, "penwidth": 2.0, "color": _RED}
_RENDERED = ("svg", "png", "pdf")


# --------------------------------------------------------------------------- #
# The picture: what is drawn, whoever lays it out
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Box:
    """A node, styled in Graphviz's terms (its shape names, ``penwidth``)."""

    id: str
    label: str
    shape: str = "box"  # box, ellipse, trapezium, invtrapezium, box3d, note
    fill: str = "#ffffff"
    bold: bool = False
    penwidth: float | None = None
    color: str | None = None
    cluster: str = ""  # the innermost cluster that holds it; "" for none


@dataclass(frozen=True)
class _Arrow:
    src: str
    dst: str
    color: str | None = None
    penwidth: float | None = None
    style: str | None = None  # dashed, dotted
    label: str | None = None
    head: bool = True
    lhead: str | None = None  # DOT: end at this cluster's border, not at dst


@dataclass(frozen=True)
class _Cluster:
    name: str
    label: str
    style: str = "rounded"  # or "dashed,rounded"
    parent: str = ""


@dataclass
class _Picture:
    title: str | None = None
    clusters: list[_Cluster] = field(default_factory=list)
    boxes: list[_Box] = field(default_factory=list)
    arrows: list[_Arrow] = field(default_factory=list)


def _short(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _op(node: fx.Node, gm: fx.GraphModule) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return f"get_attr {node.target}"
    if node.op == "call_module":
        try:
            return type(gm.get_submodule(str(node.target))).__name__
        except AttributeError:
            return str(node.target)
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def _shape(node: fx.Node, batch: tuple[int, int] | None) -> str | None:
    """The node's shape; in the body (``batch = (gbs, mbs)``) at one microbatch."""
    info = node.meta.get(SHAPES)
    if not getattr(info, "is_tensor", False):
        return None
    shape = list(info.shape_a)
    if batch is not None:
        gbs, mbs = batch
        for d in info.batch_dims:  # a batch dim is factor * gbs long at the full batch
            shape[d] = shape[d] // gbs * mbs
    return "(" + ", ".join(map(str, shape)) + ")"


def _label(node: fx.Node, gm: fx.GraphModule, plan: Any = None,
           batch: tuple[int, int] | None = None) -> str:
    lines = [node.name, _short(_op(node, gm))]
    shape = _shape(node, batch)
    if shape is not None:
        lines.append(shape if batch is None else f"{shape} per microbatch")
    fact = node.meta.get(FACT)
    if fact is not None and not isinstance(fact, Free):
        lines.append(_short(str(fact)))
    if ops.op_of(node.target) is ops.split:
        lines.append(f"{len(node.kwargs.get('slices', ()))} non-empty microbatches")
    elif ops.op_of(node.target) is ops.microbatch_loop:
        if plan is not None:
            lines.append(f"{plan.num_microbatches} per system x {plan.num_csx} systems, "
                         f"mbs {plan.mbs}")
        if node.kwargs.get("fused_index") is not None:
            lines.append("backward per microbatch")
    elif ops.op_of(node.target) is ops.accumulate_sum:
        lines.append("sum per system, then all-reduce")
    elif ops.op_of(node.target) is ops.accumulate_cat:
        lines.append(f"concatenate along dim {node.kwargs.get('dim', 0)}")
    return "\n".join(lines)


def _style(node: fx.Node) -> dict[str, Any]:
    if node.op == "call_function" and ops.op_of(node.target) in _RUNTIME_STYLE:
        shape, fill, bold = _RUNTIME_STYLE[ops.op_of(node.target)]
        return {"shape": shape, "fill": fill, "bold": bold}
    fact = node.meta.get(FACT)
    fill = next((c for t, c in _FACT_COLOURS if isinstance(fact, t)), "#ffffff")
    if node.op in ("placeholder", "output"):
        return {"shape": "ellipse", "fill": fill, "penwidth": 2.0}
    return {"shape": "box", "fill": fill}


def _add_graph(pic: _Picture, gm: fx.GraphModule, prefix: str, cluster: str, *,
               plan: Any = None, highlight: Iterable[str] = (), mixing: str | None = None,
               skip: Iterable[fx.Node] = (), batch: tuple[int, int] | None = None) -> None:
    """The nodes and edges of ``gm`` into ``cluster``, node ids prefixed with ``prefix``."""
    on_path = list(highlight)
    path_edges = set(zip(on_path, on_path[1:]))
    skipped = set(skip)
    nodes = [n for n in gm.graph.nodes if n not in skipped]
    for node in nodes:
        box = _Box(prefix + node.name, _label(node, gm, plan, batch), cluster=cluster,
                   **_style(node))
        if node.name == mixing:  # keep the node's shape, paint it red
            box = replace(box, **_MIXING)
        elif node.name in on_path:
            box = replace(box, **_ON_PATH)
        pic.boxes.append(box)
    for node in nodes:
        for source in node.all_input_nodes:
            if source in skipped:
                continue
            red = (source.name, node.name) in path_edges
            pic.arrows.append(_Arrow(prefix + source.name, prefix + node.name,
                                     color=_RED if red else None,
                                     penwidth=2.5 if red else None))


def _add_rewritten(pic: _Picture, plan: Any, gm: fx.GraphModule, cluster: str) -> None:
    refs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in ("body", "coupled")]
    _add_graph(pic, gm, "r_", cluster, plan=plan, skip=refs)
    body = getattr(gm, "body", None)
    loop = next((n for n in gm.graph.nodes if ops.op_of(n.target) in (ops.microbatch_loop,
                                                                       ops.two_phase_step)), None)
    if isinstance(body, fx.GraphModule):
        pic.clusters.append(_Cluster("body", "body (P): runs once per microbatch",
                                     "dashed,rounded", parent=cluster))
        batch = None if plan is None else (plan.gbs, plan.max_microbatch_size)
        _add_graph(pic, body, "b_", "body", batch=batch)
        nodes = list(body.graph.nodes)
        if loop is not None and nodes:
            pic.arrows.append(_Arrow("r_" + loop.name, "b_" + nodes[0].name, style="dashed",
                                     label="each microbatch", lhead="body"))
    coupled = getattr(gm, "coupled", None)
    if isinstance(coupled, fx.GraphModule) and isinstance(body, fx.GraphModule):
        # a two-phase step: C runs once on the whole batch; the frontier F is what flows
        # from the body's outputs into C's inputs, joined over microbatches
        pic.clusters.append(_Cluster("coupled", "coupled part (C): runs once, whole batch",
                                     "dashed,rounded", parent=cluster))
        _add_graph(pic, coupled, "c_", "coupled")
        body_out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
        inputs = [n for n in coupled.graph.nodes if n.op == "placeholder"]
        for value, joined in zip(body_out.all_input_nodes, inputs):
            pic.arrows.append(_Arrow("b_" + value.name, "c_" + joined.name, style="bold",
                                     color="#be185d", label="frontier"))


def _picture(obj: Any, error: MixingError | None, title: str | None) -> _Picture:
    pic = _Picture(title)
    if isinstance(obj, CompiledModule):
        if error is not None:
            raise MbcompileError("error= is for a model that failed to compile; a "
                                 "CompiledModule compiled fine")
        name = type(obj.module).__name__
        pic.clusters.append(_Cluster(
            "original", f"original graph ({name}): nodes coloured by batch fact"))
        _add_graph(pic, obj.original_graph_module, "o_", "original")
        pic.clusters.append(_Cluster("rewritten",
                                     "rewritten: split -> microbatch loop -> accumulate"))
        _add_rewritten(pic, obj.plan, obj.graph_module, "rewritten")
    elif error is not None:
        gm = _graph_of(obj)
        mixing = getattr(error, "node", None)
        path = [p.strip() for p in str(getattr(error, "path", "") or "").split("->")
                if p.strip()]
        if mixing is not None and mixing not in {n.name for n in gm.graph.nodes}:
            raise MbcompileError(
                f"the error names node {mixing!r}, which is not in the captured graph of "
                f"{type(obj).__name__}; pass the model (or graph) that raised it")
        pic.clusters.append(_Cluster(
            "rejected", f"rejected: {type(_model_of(obj)).__name__} mixes samples"))
        _add_graph(pic, gm, "o_", "rejected", highlight=path, mixing=mixing)
        if mixing is not None:
            reason = str(getattr(error, "reason", "") or "")
            op = str(getattr(error, "op", "") or "")
            pic.boxes.append(_Box("note", f"rejected: {op}\n{_wrap(reason)}", shape="note",
                                  fill="#fff7ed", cluster="rejected"))
            pic.arrows.append(_Arrow("note", "o_" + mixing, style="dotted", head=False))
    elif isinstance(obj, (fx.GraphModule, nn.Module)):
        gm = _graph_of(obj)
        if any(ops.op_of(n.target) is ops.microbatch_loop for n in gm.graph.nodes):
            _add_rewritten(pic, None, gm, "")
        else:
            _add_graph(pic, gm, "o_", "")
    else:
        raise MbcompileError(
            f"draw() takes a CompiledModule, an fx.GraphModule or a model (with error= for a "
            f"rejected one), got {type(obj).__name__}")
    return pic


def _wrap(text: str, width: int = 60) -> str:
    words, out, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join(out + [line] if line else out)


def _model_of(obj: Any) -> Any:
    return obj.module if isinstance(obj, CompiledModule) else obj


def _graph_of(obj: Any) -> fx.GraphModule:
    if isinstance(obj, fx.GraphModule):
        return obj
    from mbcompile.passes.capture import capture

    return capture(obj).graph_module


# --------------------------------------------------------------------------- #
# DOT
# --------------------------------------------------------------------------- #


def _q(text: str) -> str:
    """A DOT string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_box(b: _Box) -> str:
    attrs = [f"label={_q(b.label)}", f"shape={b.shape}",
             f'style="filled{",bold" if b.bold else ""}"', f'fillcolor="{b.fill}"']
    if b.penwidth is not None:
        attrs.append(f"penwidth={b.penwidth:g}")
    if b.color is not None:
        attrs.append(f'color="{b.color}"')
    return f"{_q(b.id)} [{', '.join(attrs)}];"


def _dot_arrow(a: _Arrow) -> str:
    attrs = [f"lhead={_q('cluster_' + a.lhead)}"] if a.lhead else []
    if a.color is not None:
        attrs.append(f'color="{a.color}"')
    if a.penwidth is not None:
        attrs.append(f"penwidth={a.penwidth:g}")
    if a.style:
        attrs.append(f"style={a.style}")
    if a.label:
        attrs.append(f"label={_q(a.label)}")
    if not a.head:
        attrs.append("arrowhead=none")
    return f"{_q(a.src)} -> {_q(a.dst)}" + (f" [{', '.join(attrs)}]" if attrs else "") + ";"


def _dot(pic: _Picture) -> str:
    def members(cluster: str, indent: str) -> list[str]:
        lines = [indent + _dot_box(b) for b in pic.boxes if b.cluster == cluster]
        for c in pic.clusters:
            if c.parent == cluster:
                lines += [f"{indent}subgraph {_q('cluster_' + c.name)} {{",
                          f"{indent}  label={_q(c.label)}; style={_q(c.style)}; fontsize=14;",
                          *members(c.name, indent + "  "), f"{indent}}}"]
        return lines

    lines = ["digraph mbcompile {", "  rankdir=TB; compound=true; newrank=true;",
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [color="#6b7280", arrowsize=0.6];']
    if pic.title:
        lines.append(f"  label={_q(pic.title)}; labelloc=t; fontsize=16;")
    lines += members("", "  ")
    lines += ["  " + _dot_arrow(a) for a in pic.arrows]
    return "\n".join([*lines, "}"]) + "\n"


def to_dot(obj: Any, *, error: MixingError | None = None, title: str | None = None) -> str:
    """DOT text for a ``CompiledModule``, an ``fx.GraphModule``, or a rejected model.

    ``error`` (a ``MixingError`` from compiling ``obj``) highlights the mixing node
    and its path from the batched input; ``obj`` is then the model (it is captured
    again here, which gives the same node names) or its graph.
    """
    return _dot(_picture(obj, error, title))


# --------------------------------------------------------------------------- #
# SVG, laid out here: layers top to bottom, each node under its inputs
# --------------------------------------------------------------------------- #

_CHAR = 6.0  # px: an average Helvetica glyph at the 10 px of the labels
_LINE = 13  # px: a label line
_PAD = 6  # px: text to border
_GAP_X, _GAP_Y = 18.0, 30.0  # px: between the nodes of a layer; between layers
_FRAME = 12.0  # px: a cluster's border to its content
_SLANT, _DEPTH, _FOLD = 12.0, 5.0, 8.0  # px: trapezium sides, box3d depth, note corner
_GREY = "#6b7280"
_DASHES = {"dashed": "6,4", "dotted": "1.5,3"}


@dataclass
class _Block:
    """A laid-out part of the picture, its top left at (0, 0)."""

    w: float = 0.0
    h: float = 0.0
    nodes: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    frames: list[tuple[_Cluster, float, float, float, float]] = field(default_factory=list)

    def put(self, other: _Block, dx: float, dy: float) -> None:
        """Copy ``other`` in, its top left at (dx, dy)."""
        self.nodes.update({k: (x + dx, y + dy, w, h) for k, (x, y, w, h) in other.nodes.items()})
        self.frames += [(c, x + dx, y + dy, w, h) for c, x, y, w, h in other.frames]
        self.w, self.h = max(self.w, dx + other.w), max(self.h, dy + other.h)


def _box_size(b: _Box) -> tuple[float, float]:
    lines = b.label.split("\n")
    w, h = max(map(len, lines)) * _CHAR + 2 * _PAD, len(lines) * _LINE + 2 * _PAD
    if b.shape == "ellipse":  # the text's box fits inside the ellipse
        return w * 1.3, h * 1.3
    if b.shape.endswith("trapezium"):
        return w + 2 * _SLANT, h
    if b.shape == "box3d":
        return w + _DEPTH, h + _DEPTH
    return w, h


def _layered(boxes: list[_Box], arrows: list[_Arrow]) -> _Block:
    """One graph: each node a layer below its deepest input, as near under its inputs as fits.

    Nodes with no input (parameters, the note) sit just above their first user, and
    right of the nodes that have inputs, so the main chain stays a straight column.
    """
    size = {b.id: _box_size(b) for b in boxes}
    g = nx.DiGraph()
    g.add_nodes_from(size)
    g.add_edges_from((a.src, a.dst) for a in arrows if a.src in size and a.dst in size)
    layer: dict[str, int] = {}
    for n in nx.topological_sort(g):
        layer[n] = max((layer[p] + 1 for p in g.predecessors(n)), default=0)
    for n in size:
        if g.in_degree(n) == 0 and g.out_degree(n):
            layer[n] = min(layer[s] for s in g.successors(n)) - 1
    rows: list[list[str]] = [[] for _ in range(max(layer.values(), default=-1) + 1)]
    for n in size:
        rows[layer[n]].append(n)
    block, centre, y = _Block(), {}, 0.0
    for row in filter(None, rows):
        want = {}
        for n in row:  # under its inputs; under the ones that have inputs where there are any
            inputs = [p for p in g.predecessors(n) if p in centre]
            xs = [centre[p] for p in inputs if g.in_degree(p)] or [centre[p] for p in inputs]
            want[n] = sum(xs) / len(xs) if xs else math.inf
        height = max(size[n][1] for n in row)
        right: float | None = None  # where the next node of the row may start
        for n in sorted(row, key=want.__getitem__):  # stable: ties keep the graph's order
            w, h = size[n]
            x = want[n] - w / 2 if want[n] < math.inf else (right or 0.0)
            x = x if right is None else max(x, right)
            block.nodes[n] = (x, y + (height - h) / 2, w, h)
            centre[n], right = x + w / 2, x + w + _GAP_X
        y += height + _GAP_Y
    if block.nodes:
        left = min(x for x, _, _, _ in block.nodes.values())
        block.nodes = {n: (x - left, y, w, h) for n, (x, y, w, h) in block.nodes.items()}
        block.w = max(x + w for x, _, w, _ in block.nodes.values())
        block.h = y - _GAP_Y
    return block


def _place(pic: _Picture, cluster: str) -> _Block:
    """``cluster``'s own nodes in layers, with its sub-clusters side by side on their right."""
    parts = [_layered([b for b in pic.boxes if b.cluster == cluster], pic.arrows)]
    for c in pic.clusters:
        if c.parent == cluster:
            inner = _place(pic, c.name)
            head = 14 + _FRAME  # the label's line
            framed = _Block()
            framed.frames.append((c, 0.0, 0.0, max(inner.w, len(c.label) * 8.0) + 2 * _FRAME,
                                  inner.h + head + _FRAME))
            framed.put(inner, _FRAME, head)
            framed.w, framed.h = framed.frames[0][3], framed.frames[0][4]
            parts.append(framed)
    block = _Block()
    for part in parts:
        if part.nodes or part.frames:
            block.put(part, block.w + 2 * _GAP_X if block.nodes or block.frames else 0.0, 0.0)
    return block


def _clip(box: tuple[float, float, float, float], shape: str, toward: tuple[float, float]
          ) -> tuple[float, float]:
    """Where the line from the centre of ``box`` to ``toward`` leaves it."""
    x, y, w, h = box
    cx, cy = x + w / 2, y + h / 2
    dx, dy = toward[0] - cx, toward[1] - cy
    if dx == dy == 0:
        return cx, cy
    if shape == "ellipse":
        t = 1 / math.hypot(dx / (w / 2), dy / (h / 2))
    else:
        t = min(w / 2 / abs(dx) if dx else math.inf, h / 2 / abs(dy) if dy else math.inf)
    return cx + t * dx, cy + t * dy


def _crosses(p: tuple[float, float], q: tuple[float, float],
             box: tuple[float, float, float, float]) -> bool:
    """Whether the segment ``p``-``q`` passes through ``box`` (Liang-Barsky clipping)."""
    x, y, w, h = box
    lo, hi = 0.0, 1.0
    for d, p0, a, b in ((q[0] - p[0], p[0], x, x + w), (q[1] - p[1], p[1], y, y + h)):
        if d == 0:
            if not a <= p0 <= b:
                return False
            continue
        t0, t1 = sorted(((a - p0) / d, (b - p0) / d))
        lo, hi = max(lo, t0), min(hi, t1)
    return lo < hi


def _svg_box(b: _Box, x: float, y: float, w: float, h: float) -> str:
    paint = (f'fill="{b.fill}" stroke="{b.color or "#000000"}" '
             f'stroke-width="{b.penwidth or (2 if b.bold else 1):g}"')
    r, bottom = x + w, y + h
    if b.shape == "ellipse":
        outline = f'<ellipse cx="{x + w / 2:.1f}" cy="{y + h / 2:.1f}" rx="{w / 2:.1f}" ' \
                  f'ry="{h / 2:.1f}" {paint}/>'
    elif b.shape.endswith("trapezium"):  # trapezium: wide at the bottom; invtrapezium: the top
        s = _SLANT if b.shape == "trapezium" else 0.0
        t = _SLANT - s
        pts = [(x + s, y), (r - s, y), (r - t, bottom), (x + t, bottom)]
        outline = _polygon(pts, paint)
    elif b.shape == "box3d":
        d = _DEPTH
        outline = (f'<rect x="{x:.1f}" y="{y + d:.1f}" width="{w - d:.1f}" height="{h - d:.1f}" '
                   f'{paint}/>' + _polygon([(x, y + d), (x + d, y), (r, y), (r, bottom - d),
                                            (r - d, bottom), (r - d, y + d)], paint))
    elif b.shape == "note":
        f = _FOLD
        outline = _polygon([(x, y), (r - f, y), (r, y + f), (r, bottom), (x, bottom)], paint)
    else:
        outline = f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" {paint}/>'
    lines = b.label.split("\n")
    cx, top = x + w / 2, y + h / 2 - (len(lines) - 1) * _LINE / 2 + 3.5  # 3.5: half a cap
    text = "".join(f'<tspan x="{cx:.1f}" y="{top + i * _LINE:.1f}">{escape(line)}</tspan>'
                   for i, line in enumerate(lines))
    return (f'<g class="node" id={quoteattr(b.id)}><title>{escape(b.id)}</title>{outline}'
            f'<text text-anchor="middle">{text}</text></g>')


def _polygon(points: list[tuple[float, float]], paint: str) -> str:
    return f'<polygon points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}" {paint}/>'


def _svg(pic: _Picture) -> str:
    """The picture as SVG text, laid out by ``_place``."""
    block = _Block()
    top = 34.0 if pic.title else 12.0
    block.put(_place(pic, ""), 12.0, top)
    shapes = {b.id: b.shape for b in pic.boxes}
    markers: dict[str, str] = {}  # colour -> marker id: SVG 1.1 markers take no stroke colour
    edges, right = [], block.w
    for a in pic.arrows:
        if a.src not in block.nodes or a.dst not in block.nodes:
            continue
        src, dst = block.nodes[a.src], block.nodes[a.dst]
        p, q = _clip(src, shapes[a.src], _mid(dst)), _clip(dst, shapes[a.dst], _mid(src))
        if any(_crosses(p, q, box) for n, box in block.nodes.items() if n not in (a.src, a.dst)):
            # around the nodes in between, on the right
            p, q = (src[0] + src[2], _mid(src)[1]), (dst[0] + dst[2], _mid(dst)[1])
            bend = max(p[0], q[0]) + 20 + 0.1 * abs(q[1] - p[1])
            right = max(right, bend)
            d = f"M{p[0]:.1f},{p[1]:.1f} C{bend:.1f},{p[1]:.1f} {bend:.1f},{q[1]:.1f} " \
                f"{q[0]:.1f},{q[1]:.1f}"
        else:
            d = f"M{p[0]:.1f},{p[1]:.1f} L{q[0]:.1f},{q[1]:.1f}"
        colour = a.color or _GREY
        attrs = f'd="{d}" fill="none" stroke="{colour}" stroke-width="{a.penwidth or 1:g}"'
        if a.style in _DASHES:
            attrs += f' stroke-dasharray="{_DASHES[a.style]}"'
        if a.head:
            attrs += f' marker-end="url(#{markers.setdefault(colour, f"arrow{len(markers)}")})"'
        label = "" if not a.label else (
            f'<text x="{(p[0] + q[0]) / 2 + 4:.1f}" y="{(p[1] + q[1]) / 2:.1f}" '
            f'fill="{colour}">{escape(a.label)}</text>')
        edges.append(f'<g class="edge"><path {attrs}/>{label}</g>')
    width, height = max(right, block.w) + 12, block.h + 12
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" '
           'font-size="10">', "<defs>"]
    out += [f'<marker id="{m}" viewBox="0 0 8 6" refX="8" refY="3" markerWidth="8" '
            f'markerHeight="6" markerUnits="userSpaceOnUse" orient="auto">'
            f'<path d="M0,0 L8,3 L0,6 z" fill="{colour}"/></marker>'
            for colour, m in markers.items()]
    out += ["</defs>", '<rect width="100%" height="100%" fill="#ffffff"/>']
    if pic.title:
        out.append(f'<text x="{width / 2:.1f}" y="24" font-size="16" text-anchor="middle">'
                   f"{escape(pic.title)}</text>")
    for c, x, y, w, h in block.frames:
        dash = ' stroke-dasharray="6,4"' if "dashed" in c.style else ""
        out.append(f'<g class="cluster" id={quoteattr("cluster_" + c.name)}>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="8" '
                   f'fill="none" stroke="{_GREY}"{dash}/><text x="{x + w / 2:.1f}" '
                   f'y="{y + 19:.1f}" font-size="14" text-anchor="middle">{escape(c.label)}'
                   "</text></g>")
    out += edges
    out += [_svg_box(b, *block.nodes[b.id]) for b in pic.boxes]
    return "\n".join([*out, "</svg>"]) + "\n"


def _mid(box: tuple[float, float, float, float]) -> tuple[float, float]:
    return box[0] + box[2] / 2, box[1] + box[3] / 2


def to_svg(obj: Any, *, error: MixingError | None = None, title: str | None = None) -> str:
    """SVG text of the picture ``to_dot`` describes, laid out here: no Graphviz needed."""
    return _svg(_picture(obj, error, title))


# --------------------------------------------------------------------------- #
# Files
# --------------------------------------------------------------------------- #


def _graphviz() -> str | None:
    """The path of Graphviz's ``dot`` program, or None where it is not installed."""
    return shutil.which("dot")


def render(dot_path: str | Path, out_path: str | Path, fmt: str | None = None) -> Path:
    """Run Graphviz ``dot`` on ``dot_path``; raises ``MbcompileError`` if it is missing or fails."""
    out = Path(out_path)
    fmt = fmt or out.suffix.lstrip(".")
    exe = _graphviz()
    if exe is None:
        raise MbcompileError("Graphviz's 'dot' program is not installed; install graphviz "
                             "(apt-get install graphviz, brew install graphviz), or draw to "
                             ".svg, which needs no Graphviz")
    try:
        subprocess.run([exe, f"-T{fmt}", str(dot_path), "-o", str(out)], check=True,
                       capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        raise MbcompileError(f"dot failed on {dot_path}: {exc.stderr.strip()}") from None
    except subprocess.TimeoutExpired:
        raise MbcompileError(f"dot took more than 120 s on {dot_path}; open the .dot file "
                             "in a viewer instead") from None
    return out


def draw(obj: Any, path: str | Path, *, error: MixingError | None = None,
         title: str | None = None) -> list[Path]:
    """Draw ``obj`` (see ``to_dot``) to ``path``; returns the files written.

    ``.dot``/``.gv`` writes the DOT text only. ``.svg`` writes the DOT beside it and the
    SVG: laid out by Graphviz's ``dot`` where it is installed (and works), here
    otherwise, so it needs no system program. ``.png`` and ``.pdf`` need ``dot``
    (without it: a warning, and the DOT only).
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in ("dot", "gv", *_RENDERED):
        raise MbcompileError(f"draw() writes .dot, .gv, .svg, .png or .pdf files, got "
                             f"{str(path)!r}")
    pic = _picture(obj, error, title)
    target.parent.mkdir(parents=True, exist_ok=True)
    dot_path = target if fmt in ("dot", "gv") else target.with_suffix(".dot")
    dot_path.write_text(_dot(pic), encoding="utf-8")
    written = [dot_path]
    if fmt not in _RENDERED:
        return written
    if _graphviz() is not None:
        try:
            return [*written, render(dot_path, target, fmt)]
        except MbcompileError as exc:
            if fmt != "svg":
                raise
            warnings.warn(f"{exc}; {target.name} was laid out without Graphviz instead",
                          MbcompileWarning, stacklevel=user_stacklevel())
    if fmt == "svg":
        target.write_text(_svg(pic), encoding="utf-8")
        return [*written, target]
    warnings.warn(f"Graphviz's 'dot' is not installed, so only {dot_path} was written; "
                  f"install graphviz for {target.name}, or draw to .svg, which needs no "
                  "Graphviz", MbcompileWarning, stacklevel=user_stacklevel())
    return written
