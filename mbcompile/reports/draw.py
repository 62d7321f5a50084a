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

The picture is built once (``picture.py``: boxes, arrows, clusters) and written two
ways: as DOT text (``to_dot``, here), and as SVG. The SVG needs no system program: its
layout is computed in ``svg.py`` (``to_svg``: layers from a topological order, each node
under its inputs, clusters side by side). Where Graphviz's ``dot`` is installed, ``draw`` lets
it lay the SVG out instead, which routes edges more neatly; ``.png`` and ``.pdf``
need it.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Any

from mbcompile.errors import MbcompileError, MbcompileWarning, MixingError
from mbcompile.passes.sources import user_stacklevel
from mbcompile.reports.picture import Arrow, Box, Picture, picture
from mbcompile.reports.svg import svg_text

__all__ = ["draw", "render", "to_dot", "to_svg"]

_RENDERED = ("svg", "png", "pdf")


# --------------------------------------------------------------------------- #
# DOT
# --------------------------------------------------------------------------- #


def _q(text: str) -> str:
    """A DOT string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_box(b: Box) -> str:
    attrs = [f"label={_q(b.label)}", f"shape={b.shape}",
             f'style="filled{",bold" if b.bold else ""}"', f'fillcolor="{b.fill}"']
    if b.penwidth is not None:
        attrs.append(f"penwidth={b.penwidth:g}")
    if b.color is not None:
        attrs.append(f'color="{b.color}"')
    return f"{_q(b.id)} [{', '.join(attrs)}];"


def _dot_arrow(a: Arrow) -> str:
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


def _dot(pic: Picture) -> str:
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
    return _dot(picture(obj, error, title))


def to_svg(obj: Any, *, error: MixingError | None = None, title: str | None = None) -> str:
    """SVG text of the picture ``to_dot`` describes, laid out by ``svg.py``: no Graphviz
    needed."""
    return svg_text(picture(obj, error, title))


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
    pic = picture(obj, error, title)
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
        target.write_text(svg_text(pic), encoding="utf-8")
        return [*written, target]
    warnings.warn(f"Graphviz's 'dot' is not installed, so only {dot_path} was written; "
                  f"install graphviz for {target.name}, or draw to .svg, which needs no "
                  "Graphviz", MbcompileWarning, stacklevel=user_stacklevel())
    return written
