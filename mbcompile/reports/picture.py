"""What a drawing shows, whoever lays it out: ``picture(obj)`` builds a ``Picture``.

A ``Picture`` is boxes, arrows and clusters, styled in Graphviz's terms: the original
graph with each node coloured by its batch fact, the rewritten graph (split -> loop ->
accumulate, or a two-phase step with its frontier), or a rejected model with the mixing
op and its path from the input in red. ``draw.py`` writes it as DOT, ``svg.py`` lays it
out as SVG.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx as fx
import torch.nn as nn

from mbcompile.errors import MbcompileError, MixingError
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

__all__ = ["Arrow", "Box", "Cluster", "Picture", "is_compiled", "picture"]

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


def is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is a ``CompiledModule``, told by what a drawing reads of it (its
    class has ``original_graph_module``), not by the class itself: the compiler imports
    ``reports/`` for its report, so ``reports/`` must not import the compiler. The class is
    asked, not the object, so that no graph is compiled to answer."""
    return hasattr(type(obj), "original_graph_module")


@dataclass(frozen=True)
class Box:
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
class Arrow:
    src: str
    dst: str
    color: str | None = None
    penwidth: float | None = None
    style: str | None = None  # dashed, dotted
    label: str | None = None
    head: bool = True
    lhead: str | None = None  # DOT: end at this cluster's border, not at dst


@dataclass(frozen=True)
class Cluster:
    name: str
    label: str
    style: str = "rounded"  # or "dashed,rounded"
    parent: str = ""


@dataclass
class Picture:
    title: str | None = None
    clusters: list[Cluster] = field(default_factory=list)
    boxes: list[Box] = field(default_factory=list)
    arrows: list[Arrow] = field(default_factory=list)


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


def _add_graph(pic: Picture, gm: fx.GraphModule, prefix: str, cluster: str, *,
               plan: Any = None, highlight: Iterable[str] = (), mixing: str | None = None,
               skip: Iterable[fx.Node] = (), batch: tuple[int, int] | None = None) -> None:
    """The nodes and edges of ``gm`` into ``cluster``, node ids prefixed with ``prefix``."""
    on_path = list(highlight)
    path_edges = set(zip(on_path, on_path[1:]))
    skipped = set(skip)
    nodes = [n for n in gm.graph.nodes if n not in skipped]
    for node in nodes:
        box = Box(prefix + node.name, _label(node, gm, plan, batch), cluster=cluster,
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
            pic.arrows.append(Arrow(prefix + source.name, prefix + node.name,
                                     color=_RED if red else None,
                                     penwidth=2.5 if red else None))


def _add_rewritten(pic: Picture, plan: Any, gm: fx.GraphModule, cluster: str) -> None:
    refs = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in ("body", "coupled")]
    _add_graph(pic, gm, "r_", cluster, plan=plan, skip=refs)
    body = getattr(gm, "body", None)
    loop = next((n for n in gm.graph.nodes if ops.op_of(n.target) in (ops.microbatch_loop,
                                                                       ops.two_phase_step)), None)
    if isinstance(body, fx.GraphModule):
        pic.clusters.append(Cluster("body", "body (P): runs once per microbatch",
                                     "dashed,rounded", parent=cluster))
        batch = None if plan is None else (plan.gbs, plan.max_microbatch_size)
        _add_graph(pic, body, "b_", "body", batch=batch)
        nodes = list(body.graph.nodes)
        if loop is not None and nodes:
            pic.arrows.append(Arrow("r_" + loop.name, "b_" + nodes[0].name, style="dashed",
                                     label="each microbatch", lhead="body"))
    coupled = getattr(gm, "coupled", None)
    if isinstance(coupled, fx.GraphModule) and isinstance(body, fx.GraphModule):
        # a two-phase step: C runs once on the whole batch; the frontier F is what flows
        # from the body's outputs into C's inputs, joined over microbatches
        pic.clusters.append(Cluster("coupled", "coupled part (C): runs once, whole batch",
                                     "dashed,rounded", parent=cluster))
        _add_graph(pic, coupled, "c_", "coupled")
        body_out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
        inputs = [n for n in coupled.graph.nodes if n.op == "placeholder"]
        for value, joined in zip(body_out.all_input_nodes, inputs):
            pic.arrows.append(Arrow("b_" + value.name, "c_" + joined.name, style="bold",
                                     color="#be185d", label="frontier"))


def picture(obj: Any, error: MixingError | None, title: str | None) -> Picture:
    pic = Picture(title)
    if is_compiled(obj):
        if error is not None:
            raise MbcompileError("error= is for a model that failed to compile; a "
                                 "CompiledModule compiled fine")
        name = type(obj.module).__name__
        pic.clusters.append(Cluster(
            "original", f"original graph ({name}): nodes coloured by batch fact"))
        _add_graph(pic, obj.original_graph_module, "o_", "original")
        pic.clusters.append(Cluster("rewritten",
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
        pic.clusters.append(Cluster(
            "rejected", f"rejected: {type(_model_of(obj)).__name__} mixes samples"))
        _add_graph(pic, gm, "o_", "rejected", highlight=path, mixing=mixing)
        if mixing is not None:
            reason = str(getattr(error, "reason", "") or "")
            op = str(getattr(error, "op", "") or "")
            pic.boxes.append(Box("note", f"rejected: {op}\n{_wrap(reason)}", shape="note",
                                  fill="#fff7ed", cluster="rejected"))
            pic.arrows.append(Arrow("note", "o_" + mixing, style="dotted", head=False))
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
    return obj.module if is_compiled(obj) else obj


def _graph_of(obj: Any) -> fx.GraphModule:
    if isinstance(obj, fx.GraphModule):
        return obj
    from mbcompile.passes.capture import capture

    return capture(obj).graph_module
