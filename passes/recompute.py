"""Activation checkpointing per block: the other way to trade compute for memory.

A model's repeated blocks (``blocks.0``, ``blocks.1``, ..., ``model.layers.11``: the
children of an ``nn.ModuleList`` or ``nn.Sequential``, read off each node's
``nn_module_stack``) each become a submodule called through non-reentrant
``torch.utils.checkpoint``: only a block's inputs are kept for backward, and its
activations are recomputed, block by block, during backward (with the RNG state of
the forward, so dropout draws the same masks: the result is unchanged; a block that
draws from a generator of the model's own replays it too, ``passes/generators.py``).

Before (a body)::

    blocks_0_ln = self.blocks_0_ln(x); ...; add_2 = add_1 + blocks_0_down
    blocks_1_ln = self.blocks_1_ln(add_2); ...

After::

    submod_1 = torch.utils.checkpoint.checkpoint(self.submod_1, x, use_reentrant=False)
    submod_2 = torch.utils.checkpoint.checkpoint(self.submod_2, submod_1, use_reentrant=False)

``torch.fx.passes.split_module`` cuts the graph; what lies outside the blocks
(embeddings, the head, the loss) runs as before.
"""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx.passes.split_module import split_module

from .generators import checkpoint_replaying, generators_of

__all__ = ["block_of", "checkpoint_blocks"]

_INDEXED = re.compile(r"(^|\.)\d+$")  # a child of a ModuleList / Sequential


def block_of(node: fx.Node) -> str | None:
    """The outermost repeated block ``node`` runs in (``"blocks.0"``), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():  # outermost first
        path = value[0] if isinstance(value, tuple) else key
        if isinstance(path, str) and _INDEXED.search(path):
            return path
    return None


def _attribute(gm: fx.GraphModule, arg: object) -> object:
    """The value a ``get_attr`` argument reads (None for any other argument)."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return operator.attrgetter(str(arg.target))(gm)
    return None


def checkpoint_blocks(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` with each repeated block run under activation checkpointing; None when it
    has fewer than two blocks (nothing worth recomputing)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    blocks = {n: block_of(n) for n in nodes}
    if len({b for b in blocks.values() if b is not None}) < 2:
        return None
    ids: dict[fx.Node, int] = {}
    is_block: dict[int, bool] = {}
    current, part = object(), -1
    for n in nodes:
        key = blocks[n]
        if n.op == "get_attr":  # parameters go with their first user (split_module's way)
            key = next((blocks[u] for u in n.users if u in blocks), key)
        if key != current:
            part, current = part + 1, key
            is_block[part] = key is not None
        ids[n] = part
    split = split_module(gm, gm, lambda n: ids[n], keep_original_order=True)
    for n in list(split.graph.nodes):
        if n.op != "call_module" or not n.target.startswith("submod_"):
            continue
        if not is_block.get(int(n.target.removeprefix("submod_")), False):
            continue
        generators = generators_of(getattr(split, n.target)) + tuple(  # or passed in
            g for g in (_attribute(split, a) for a in n.args) if isinstance(g, torch.Generator))
        with split.graph.inserting_before(n):
            fn = split.graph.get_attr(n.target)
            if generators:  # the model's own generators are replayed too
                call = split.graph.call_function(checkpoint_replaying(generators),
                                                 (fn, *n.args))
            else:
                call = split.graph.call_function(torch.utils.checkpoint.checkpoint,
                                                 (fn, *n.args), {"use_reentrant": False})
        call.meta = dict(n.meta)
        n.replace_all_uses_with(call)
        split.graph.erase_node(n)
    split.graph.lint()
    split.recompile()
    return split
