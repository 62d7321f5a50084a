"""Graph views: ``mbcompile.draw(cm, "graph.svg")`` writes Graphviz DOT (and SVG/PNG/PDF).

What is drawn, side by side in one picture:

- the **original** graph, each node coloured by its batch fact (per-sample blue,
  reductions amber, batch-free grey) and labelled with its op and shape;
- the **rewritten** graph: ``split`` (blue trapezium) -> ``microbatch_loop`` (gold)
  over the ``body`` (a dashed cluster: what runs once per microbatch) ->
  ``accumulate_cat`` / ``accumulate_sum`` (green) -> the tail after the loop.

For a model the analysis rejected, ``draw(model, path, error=exc)`` draws its captured
graph with the mixing op in red and the path from the batched input to it in bold red,
plus a note with the reason::

    try:
        cm = mbcompile.compile(model, gbs, num_csx, example_inputs=batch)
    except mbcompile.MixingError as exc:
        mbcompile.draw(model, "rejected.svg", error=exc)

The DOT text is written directly (no pydot); SVG and the other formats need the
Graphviz ``dot`` program, and without it only the ``.dot`` file is written, with a
warning that says how to get the rest.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.fx as fx
import torch.nn as nn

from mbcompile import partials, runtime
from mbcompile.compiler import CompiledModule
from mbcompile.errors import MbcompileError, MbcompileWarning, MixingError
from mbcompile.passes.facts import FACT, SHAPES, Batched, BatchSize, Container, Free, Reduced

__all__ = ["draw", "render", "to_dot"]

_FACT_COLOURS = (  # (fact type, fill): what the analysis found for the node
    (Batched, "#dbeafe"),  # per-sample
    (Reduced, "#fde68a"),  # a (partial) sum or mean over the batch
    (BatchSize, "#ede9fe"),  # an int equal to the batch size
    (Container, "#ffffff"),
    (Free, "#f3f4f6"),  # batch-free: parameters, constants
)
_RUNTIME_STYLE = {  # the nodes the rewrite adds, by function
    runtime.split: 'shape=invtrapezium, style="filled,bold", fillcolor="#93c5fd"',
    runtime.microbatch_loop: 'shape=box3d, style="filled,bold", fillcolor="#fcd34d"',
    runtime.accumulate_cat: 'shape=trapezium, style="filled,bold", fillcolor="#86efac"',
    runtime.accumulate_sum: 'shape=trapezium, style="filled,bold", fillcolor="#86efac"',
    partials.mean_combine: 'shape=trapezium, style="filled", fillcolor="#bbf7d0"',
}
_MIXING = 'style="filled,bold", fillcolor="#f87171", penwidth=3, color="#b91c1c"'
_ON_PATH = 'style="filled,bold", fillcolor="#fecaca", penwidth=2, color="#b91c1c"'
_RENDERED = ("svg", "png", "pdf")


def _q(text: str) -> str:
    """A DOT string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


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
    if node.target is runtime.split:
        lines.append(f"{len(node.kwargs.get('slices', ()))} non-empty microbatches")
    elif node.target is runtime.microbatch_loop:
        if plan is not None:
            lines.append(f"{plan.num_microbatches} per system x {plan.num_csx} systems, "
                         f"mbs {plan.mbs}")
        if node.kwargs.get("fused_index") is not None:
            lines.append("backward per microbatch")
    elif node.target is runtime.accumulate_sum:
        lines.append("sum per system, then all-reduce")
    elif node.target is runtime.accumulate_cat:
        lines.append(f"concatenate along dim {node.kwargs.get('dim', 0)}")
    return "\n".join(lines)


def _style(node: fx.Node) -> str:
    if node.op == "call_function" and node.target in _RUNTIME_STYLE:
        return _RUNTIME_STYLE[node.target]
    fact = node.meta.get(FACT)
    fill = next((c for t, c in _FACT_COLOURS if isinstance(fact, t)), "#ffffff")
    extra = ", penwidth=2" if node.op in ("placeholder", "output") else ""
    shape = "ellipse" if node.op in ("placeholder", "output") else "box"
    return f'shape={shape}, style="filled", fillcolor="{fill}"{extra}'


def _graph_lines(gm: fx.GraphModule, prefix: str, *, plan: Any = None,
                 highlight: Iterable[str] = (), mixing: str | None = None,
                 skip: Iterable[fx.Node] = (), batch: tuple[int, int] | None = None
                 ) -> list[str]:
    """Node and edge statements of ``gm``, node ids prefixed with ``prefix``."""
    on_path = list(highlight)
    path_edges = set(zip(on_path, on_path[1:]))
    skipped = set(skip)
    lines = []
    for node in gm.graph.nodes:
        if node in skipped:
            continue
        style = _style(node)
        shape = style.split(",")[0]  # keep the node's shape when highlighting it
        if node.name == mixing:
            style = f"{shape}, {_MIXING}"
        elif node.name in on_path:
            style = f"{shape}, {_ON_PATH}"
        label = _label(node, gm, plan, batch)
        lines.append(f"  {_q(prefix + node.name)} [label={_q(label)}, {style}];")
    for node in gm.graph.nodes:
        if node in skipped:
            continue
        for source in node.all_input_nodes:
            if source in skipped:
                continue
            attrs = ' [color="#b91c1c", penwidth=2.5]' if (source.name, node.name) in path_edges \
                else ""
            lines.append(f"  {_q(prefix + source.name)} -> {_q(prefix + node.name)}{attrs};")
    return lines


def _cluster(name: str, label: str, body: list[str], style: str = "rounded") -> list[str]:
    return [f"subgraph {_q('cluster_' + name)} {{",
            f"  label={_q(label)}; style={_q(style)}; fontsize=14;",
            *("  " + line for line in body), "}"]


def _rewritten(cm_plan: Any, gm: fx.GraphModule) -> list[str]:
    body_ref = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "body"]
    lines = _graph_lines(gm, "r_", plan=cm_plan, skip=body_ref)
    body = getattr(gm, "body", None)
    if isinstance(body, fx.GraphModule):
        loop = next((n for n in gm.graph.nodes if n.target is runtime.microbatch_loop), None)
        batch = None if cm_plan is None else (cm_plan.gbs, cm_plan.max_microbatch_size)
        body_lines = _graph_lines(body, "b_", batch=batch)
        lines += _cluster("body", "body: runs once per microbatch", body_lines, "dashed,rounded")
        nodes = list(body.graph.nodes)
        if loop is not None and nodes:
            lines.append(f"  {_q('r_' + loop.name)} -> {_q('b_' + nodes[0].name)} "
                         '[lhead="cluster_body", style=dashed, label="each microbatch"];')
    return lines


def to_dot(obj: Any, *, error: MixingError | None = None, title: str | None = None) -> str:
    """DOT text for a ``CompiledModule``, an ``fx.GraphModule``, or a rejected model.

    ``error`` (a ``MixingError`` from compiling ``obj``) highlights the mixing node
    and its path from the batched input; ``obj`` is then the model (it is captured
    again here, which gives the same node names) or its graph.
    """
    lines = ["digraph mbcompile {", "  rankdir=TB; compound=true; newrank=true;",
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [color="#6b7280", arrowsize=0.6];']
    if title:
        lines.append(f"  label={_q(title)}; labelloc=t; fontsize=16;")
    if isinstance(obj, CompiledModule):
        if error is not None:
            raise MbcompileError("error= is for a model that failed to compile; a "
                                 "CompiledModule compiled fine")
        name = type(obj.module).__name__
        lines += _cluster("original", f"original graph ({name}): nodes coloured by batch fact",
                          _graph_lines(obj.original_graph_module, "o_"))
        lines += _cluster("rewritten", "rewritten: split -> microbatch loop -> accumulate",
                          _rewritten(obj.plan, obj.graph_module))
    elif error is not None:
        gm = _graph_of(obj)
        mixing = getattr(error, "node", None)
        path = [p.strip() for p in str(getattr(error, "path", "") or "").split("->")
                if p.strip()]
        if mixing is not None and mixing not in {n.name for n in gm.graph.nodes}:
            raise MbcompileError(
                f"the error names node {mixing!r}, which is not in the captured graph of "
                f"{type(obj).__name__}; pass the model (or graph) that raised it")
        body = _graph_lines(gm, "o_", highlight=path, mixing=mixing)
        reason = str(getattr(error, "reason", "") or "")
        op = str(getattr(error, "op", "") or "")
        if mixing is not None:
            note = f"rejected: {op}\n{_wrap(reason)}"
            body.append(f'  "note" [shape=note, style="filled", fillcolor="#fff7ed", '
                        f"label={_q(note)}];")
            body.append(f'  "note" -> {_q("o_" + mixing)} [style=dotted, arrowhead=none];')
        lines += _cluster("rejected", f"rejected: {type(_model_of(obj)).__name__} mixes samples",
                          body)
    elif isinstance(obj, (fx.GraphModule, nn.Module)):
        gm = _graph_of(obj)
        rewritten = any(n.target is runtime.microbatch_loop for n in gm.graph.nodes)
        lines += _rewritten(None, gm) if rewritten else _graph_lines(gm, "o_")
    else:
        raise MbcompileError(
            f"draw() takes a CompiledModule, an fx.GraphModule or a model (with error= for a "
            f"rejected one), got {type(obj).__name__}")
    lines.append("}")
    return "\n".join(lines) + "\n"


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


def render(dot_path: str | Path, out_path: str | Path, fmt: str | None = None) -> Path:
    """Run Graphviz ``dot`` on ``dot_path``; raises ``MbcompileError`` if it is missing or fails."""
    out = Path(out_path)
    fmt = fmt or out.suffix.lstrip(".")
    exe = shutil.which("dot")
    if exe is None:
        raise MbcompileError("Graphviz's 'dot' program is not installed; install graphviz "
                             "(apt-get install graphviz, brew install graphviz) or open the "
                             ".dot file in any Graphviz viewer")
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

    ``.dot``/``.gv`` writes DOT only; ``.svg``, ``.png`` or ``.pdf`` writes the DOT
    beside it and renders it with Graphviz (a warning, and the DOT only, without it).
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    if fmt not in ("dot", "gv", *_RENDERED):
        raise MbcompileError(f"draw() writes .dot, .gv, .svg, .png or .pdf files, got "
                             f"{str(path)!r}")
    text = to_dot(obj, error=error, title=title)
    target.parent.mkdir(parents=True, exist_ok=True)
    dot_path = target if fmt in ("dot", "gv") else target.with_suffix(".dot")
    dot_path.write_text(text)
    written = [dot_path]
    if fmt in _RENDERED:
        if shutil.which("dot") is None:
            warnings.warn(f"Graphviz's 'dot' is not installed, so only {dot_path} was written; "
                          f"install graphviz to get {target.name}", MbcompileWarning,
                          stacklevel=2)
        else:
            written.append(render(dot_path, target, fmt))
    return written
