"""A ``Picture`` laid out and written as SVG here, so a drawing needs no system program.

Layers top to bottom, each node one layer below its deepest input and as near under its
inputs as fits; clusters side by side; an arrow that would cross a node bends around
it on the right. Where Graphviz is installed, ``draw`` lets it lay the SVG out instead.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

import networkx as nx

from mbcompile.reports.picture import Arrow, Box, Cluster, Picture

__all__ = ["place", "svg_text"]

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
    frames: list[tuple[Cluster, float, float, float, float]] = field(default_factory=list)

    def put(self, other: _Block, dx: float, dy: float) -> None:
        """Copy ``other`` in, its top left at (dx, dy)."""
        self.nodes.update({k: (x + dx, y + dy, w, h) for k, (x, y, w, h) in other.nodes.items()})
        self.frames += [(c, x + dx, y + dy, w, h) for c, x, y, w, h in other.frames]
        self.w, self.h = max(self.w, dx + other.w), max(self.h, dy + other.h)


def _box_size(b: Box) -> tuple[float, float]:
    lines = b.label.split("\n")
    w, h = max(map(len, lines)) * _CHAR + 2 * _PAD, len(lines) * _LINE + 2 * _PAD
    if b.shape == "ellipse":  # the text's box fits inside the ellipse
        return w * 1.3, h * 1.3
    if b.shape.endswith("trapezium"):
        return w + 2 * _SLANT, h
    if b.shape == "box3d":
        return w + _DEPTH, h + _DEPTH
    return w, h


def _layered(boxes: list[Box], arrows: list[Arrow]) -> _Block:
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


def place(pic: Picture, cluster: str) -> _Block:
    """``cluster``'s own nodes in layers, with its sub-clusters side by side on their right."""
    parts = [_layered([b for b in pic.boxes if b.cluster == cluster], pic.arrows)]
    for c in pic.clusters:
        if c.parent == cluster:
            inner = place(pic, c.name)
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


class _Crossings:
    """Whether a segment passes through a box other than its ends': ``_crosses`` asked
    only of the boxes whose rows the segment spans (the boxes sorted by their top), so a
    graph of thousands of nodes is drawn in seconds, not in minutes of every-box checks."""

    def __init__(self, nodes: Mapping[str, tuple[float, float, float, float]]) -> None:
        self.order = sorted(nodes.items(), key=lambda item: item[1][1])
        self.tops = [box[1] for _, box in self.order]
        self.tallest = max((box[3] for _, box in self.order), default=0.0)

    def __call__(self, p: tuple[float, float], q: tuple[float, float],
                 ends: tuple[str, str]) -> bool:
        low, high = min(p[1], q[1]), max(p[1], q[1])
        start = bisect.bisect_left(self.tops, low - self.tallest)
        stop = bisect.bisect_right(self.tops, high)
        return any(_crosses(p, q, box) for n, box in self.order[start:stop] if n not in ends)


def _svg_box(b: Box, x: float, y: float, w: float, h: float) -> str:
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


def svg_text(pic: Picture) -> str:
    """The picture as SVG text, laid out by ``place``."""
    block = _Block()
    top = 34.0 if pic.title else 12.0
    block.put(place(pic, ""), 12.0, top)
    shapes = {b.id: b.shape for b in pic.boxes}
    markers: dict[str, str] = {}  # colour -> marker id: SVG 1.1 markers take no stroke colour
    edges, right = [], block.w
    crossed = _Crossings(block.nodes)
    for a in pic.arrows:
        if a.src not in block.nodes or a.dst not in block.nodes:
            continue
        src, dst = block.nodes[a.src], block.nodes[a.dst]
        p, q = _clip(src, shapes[a.src], _mid(dst)), _clip(dst, shapes[a.dst], _mid(src))
        if crossed(p, q, (a.src, a.dst)):
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
