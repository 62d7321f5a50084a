"""Graph modules whose Python code is generated when it is needed, once.

torch.fx generates a ``GraphModule``'s Python code when the module is made, and again for
every ``GraphModule`` child each time a parent is made around it (``recompile`` walks the
children). The lowering made the body (the whole model's code) three times over, in the
cut, the rewrite's top module and ``ops.bind``'s, and the graphs cut to a few repeated
blocks (``repeated_blocks.truncate``) had their code made although only the fake probe
runs them, node by node. ``graph_module`` makes fx's lazy kind instead
(``_LazyGraphModule``, what torch's own compiler makes for the same reason): there
``recompile`` marks the code stale, and it is generated at the module's first call, at
``.code`` or when printed, from the graph as it is then. ``code_now`` generates it for a
module about to run, parent first (a parent's generation marks its children stale, fx's
rule: its children are made after it, each once).

>>> body = graph_module(gm, body_graph, "MicrobatchBody")      # no code made
>>> top = graph_module({"body": body}, top_graph, "Top")      # none made for the body
>>> code_now(top)                                              # top's, then body's: once each
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

try:  # torch's lazy GraphModule (torch >= 2.2)
    from torch.fx._lazy_graph_module import _LazyGraphModule as _Lazy
except ImportError:  # pragma: no cover - an older torch makes the code at once
    _Lazy = fx.GraphModule  # type: ignore[assignment, misc]

__all__ = ["code_now", "graph_module"]


def graph_module(root: Any, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose code is made when first needed."""
    return _Lazy(root, graph, class_name)


def code_now(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the stale code of ``gm`` and of the graph modules under it, parents first (a
    module that runs makes it at its first call: made here, compile() pays for it, not the
    first step). Returns ``gm``."""
    for module in gm.modules():
        if isinstance(module, _Lazy) and _Lazy is not fx.GraphModule:
            module.real_recompile()
    return gm
