"""The two settings of an embedding whose effect reaches past the rows each sample looks up.

- ``scale_grad_by_freq=True``: backward divides each row's gradient by how often its index
  occurs in the batch. A microbatch counts only its own ids, so each would scale the rows
  by another count: the lookup couples samples (in backward only), and runs on the whole
  batch in a two-phase step, exact, or is refused with ``coupling="reject"``.
- ``max_norm``: forward renormalises, in place, the rows of the table it looks up. The
  lookup reads only rows it renormalised itself, so it splits exactly (a second call of the
  same layer too). Another read of the table (a tied output head ``F.linear(h,
  emb.weight)``, a penalty on it) sees, in eager, every row the whole batch looked up
  renormalised, and in a microbatch only the rows looked up so far. Where every such read
  follows from the lookup's output it runs after the lookup in a two-phase step, exact;
  a read that does not (it would run before the lookup there) is refused.

Before (``logits = F.linear(self.l(self.emb(ids)), self.emb.weight)``, ``max_norm=1``)::

    each microbatch's head read rows that eager had renormalised: loss 2.81 vs 2.39

After: the lookup and the head run on the whole batch (a two-phase step), as eager.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..errors import MixingError
from ..graph_walks import descendants
from ..guards import own_class
from ..sources import source_line
from .context import MBS_NONE, RuleContext
from .spellings import is_aten, node_name

__all__ = ["check_embedding_flags"]

_NO_FREQ = "construct the embedding with scale_grad_by_freq=False"
_NO_NORM = ("construct the embedding with max_norm=None (renormalise its rows outside "
            "forward, under torch.no_grad(), if they need it)")


def check_embedding_flags(ctx: RuleContext) -> None:
    """Reject (``ctx.mix``: a two-phase step) a lookup that scales its gradient by the
    batch's counts of each id, or whose in-place renormalisation another node sees; raise a
    ``MixingError`` where even a two-phase step would let a node read the table before it."""
    max_norm, by_freq = _flags(ctx)
    layer = _layer(ctx)
    if by_freq:
        ctx.mix(f"it{layer} has scale_grad_by_freq=True: backward divides each row's "
                "gradient by how often its index occurs in the whole batch, and a microbatch "
                "would count only its own indices", _NO_FREQ)
    readers = _other_readers(ctx) if max_norm is not None else []
    if not readers:
        return
    names, s = ", ".join(repr(r.name) for r in readers), "s" if len(readers) == 1 else ""
    why = (f"it{layer} has max_norm={max_norm}: it renormalises the rows it looks up in "
           f"place, in its weight, which {names} also read{s} (a tied head such as "
           "F.linear(h, emb.weight)); in eager they see every row the whole batch looked up "
           "renormalised, in a microbatch only the rows looked up so far")
    early = [r for r in readers if r not in descendants([ctx.node])]
    if not early:
        ctx.mix(why, _NO_NORM)
    lines = "; ".join(f"{r.name!r} at {source_line(r)}" for r in early)
    raise MixingError(
        f"{_describe(ctx)} at node {ctx.node.name!r} cannot be microbatched\n"
        f"  at {source_line(ctx.node)}\n"
        f"  why: {why}; {lines} {'is' if len(early) == 1 else 'are'} not computed from "
        "its output, so even a two-phase step (the lookup and what follows from it on the "
        "whole batch) would read the table before the lookup renormalised it\n"
        f"  fix:\n    - {_NO_NORM}\n    - {MBS_NONE}")


def _flags(ctx: RuleContext) -> tuple[Any, bool]:
    """``(max_norm, scale_grad_by_freq)`` as this spelling of the lookup gives them."""
    if ctx.module is not None:  # nn.Embedding, nn.EmbeddingBag (read as guarded settings)
        return ctx.module.max_norm, bool(ctx.module.scale_grad_by_freq)
    if is_aten(ctx.node.target):  # aten.embedding(weight, ids, padding_idx, scale_grad_by_freq)
        return None, bool(ctx.arg(3, "scale_grad_by_freq", False))  # and embedding_bag's
    # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq) and
    # F.embedding_bag(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq)
    return ctx.arg(3, "max_norm"), bool(ctx.arg(5, "scale_grad_by_freq", False))


def _other_readers(ctx: RuleContext) -> list[fx.Node]:
    """The nodes other than this lookup (and other calls of the same layer, which read
    only rows they renormalise themselves) that read its table: users of the table's node
    or of any ``get_attr`` of the same tensor, and layers that hold it (a head whose weight
    is the embedding's)."""
    node, gm = ctx.node, ctx.node.graph.owning_module
    table_node = None if ctx.module is not None else ctx.arg(1, "weight")
    table = ctx.module.weight if ctx.module is not None else _attribute(gm, table_node)
    readers: dict[fx.Node, None] = {}
    for other in node.graph.nodes:
        if other is table_node or (  # the table, or another get_attr of the same tensor
                other.op == "get_attr" and table is not None and _attribute(gm, other) is table):
            readers.update(dict.fromkeys(u for u in other.users if u is not node))
        elif (other.op == "call_module" and other is not node and table is not None
              and not (node.op == "call_module" and other.target == node.target)):
            held = gm.get_submodule(other.target)
            if any(t is table for t in (*held.parameters(), *held.buffers())):
                readers[other] = None
    return list(readers)


def _attribute(gm: fx.GraphModule | None, node: Any) -> Any:
    """The tensor a ``get_attr`` node reads (None for anything else)."""
    if gm is None or not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def _layer(ctx: RuleContext) -> str:
    """`` (layer 'enc.emb')``: the layer a functional or ATen lookup runs in, as torch.export
    and torch.fx record it (empty for a ``call_module`` node, which names it already)."""
    if ctx.module is not None:
        return ""
    stack = ctx.node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):  # innermost last
        path = value[0] if isinstance(value, tuple) else key
        if isinstance(path, str) and path:
            return f" (layer {path!r})"
    return ""


def _describe(ctx: RuleContext) -> str:
    if ctx.module is not None:
        return f"torch.nn.{own_class(ctx.module).__name__} (module {ctx.node.target!r})"
    return f"torch.nn.functional.{node_name(ctx.node)}"
