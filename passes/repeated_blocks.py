"""Repeated blocks: find a graph's chain of identical layers, and cut it to fewer of them.

A transformer's layers (``model.layers.0`` .. ``model.layers.79``) are the same module
class with the same parameter shapes, and their sub-graphs are isomorphic: the same ops,
targets and shapes, each layer reading the one before it (its hidden state) and values
shared by all (rotary tables, the mask). The cost model probes a graph cut to one and two
such layers and counts the rest (``mbcompile/planning/block_probe.py``), so a deep model
costs what a shallow one does.

Example, a graph with 4 blocks::

    emb -> [blocks.0] -> [blocks.1] -> [blocks.2] -> [blocks.3] -> head -> loss
    find_blocks(gm)            # Blocks: 4 blocks of 12 nodes, each reading the one before
    truncate(gm, blocks, 2)    # emb -> [blocks.0] -> [blocks.1] -> head -> loss

The head reads the last block's values; in the cut graph it reads the same values of the
last block kept (the blocks are isomorphic, so the i-th node of one is the i-th of
another). A graph whose blocks are not such a chain (the head reads an earlier block, a
block skips one, shapes differ) has no ``Blocks``: it is probed whole.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .facts import SHAPES
from .graph_code import graph_module
from .graph_walks import arg_leaves
from .recompute import block_of
from .same_code import helpers_alike

__all__ = ["Blocks", "alike", "find_blocks", "truncate"]


@dataclass(frozen=True)
class Blocks:
    """A graph's repeated blocks, in order, each the list of its nodes (in graph order)."""

    nodes: tuple[tuple[fx.Node, ...], ...]

    @property
    def count(self) -> int:
        return len(self.nodes)

    def tags(self, keep: int) -> dict[str, int]:
        """Node name -> block index, for the first ``keep`` blocks (names survive a copy)."""
        return {n.name: i for i, block in enumerate(self.nodes[:keep]) for n in block}


def _inner_block(module: nn.Module) -> str | None:
    """The one block a split-off part (a checkpointed block's submodule) runs, if any."""
    if not isinstance(module, fx.GraphModule):
        return None
    paths = {block_of(n) for n in module.graph.nodes  # placeholders carry their source's
             if n.op not in ("placeholder", "output")} - {None}
    return paths.pop() if len(paths) == 1 else None


def _unit(gm: fx.GraphModule, node: fx.Node, units: dict[fx.Node, str | None]
          ) -> str | None:
    """The block ``node`` belongs to: its module path's, or the split-off block it calls
    (``checkpoint(submod_3, ...)``, ``getitem`` of its result)."""
    found = block_of(node)
    if found is not None:
        return found
    if node.op == "call_module":
        return _inner_block(gm.get_submodule(str(node.target)))
    if node.op == "call_function":
        first = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(first, fx.Node):
            return units.get(first)
        if isinstance(first, fx.Node) and first.op == "get_attr":
            return _inner_block(_attr(gm, first))
    return None


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    return operator.attrgetter(str(node.target))(gm)


def find_blocks(gm: fx.GraphModule, minimum: int = 2) -> Blocks | None:
    """``gm``'s chain of at least ``minimum`` isomorphic blocks, or None."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    units: dict[fx.Node, str | None] = {}
    for n in nodes:
        if n.op != "get_attr":
            units[n] = _unit(gm, n, units)
    for n in nodes:  # parameters go with their first user, as split_module does
        if n.op == "get_attr":
            units[n] = _inner_block(_attr(gm, n)) if isinstance(_attr(gm, n), nn.Module) \
                else next((units[u] for u in n.users if units.get(u) is not None), None)
    order: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if units[n] is not None:
            order.setdefault(units[n], []).append(n)
    if len(order) < minimum:
        return None
    blocks = tuple(tuple(b) for b in order.values())
    if not _contiguous(nodes, blocks, units) or not _chain(gm, blocks):
        return None
    return Blocks(blocks)


def _contiguous(nodes: list[fx.Node], blocks: tuple[tuple[fx.Node, ...], ...],
                units: dict[fx.Node, str | None]) -> bool:
    """Each block's nodes run one after the other (parameters read apart)."""
    position = {n: i for i, n in enumerate(nodes)}
    for block in blocks:
        ops = [n for n in block if n.op != "get_attr"]  # export reads them all up front
        if not ops:
            return False
        key = units[ops[0]]
        span = nodes[position[ops[0]]:position[ops[-1]] + 1]
        if any(units[n] != key and n.op != "get_attr" for n in span):
            return False
    return True


def _chain(gm: fx.GraphModule, blocks: tuple[tuple[fx.Node, ...], ...]) -> bool:
    """Block j is block 0's copy, reading block j-1 where block 0 reads what precedes it,
    and nothing outside the blocks reads any block but the last."""
    index = [{n: i for i, n in enumerate(b)} for b in blocks]
    members = {n: j for j, b in enumerate(blocks) for n in b}
    leaves = {n: _leaves(n) for n in members}  # once per node: block 0's are read n-1 times
    chain: dict[fx.Node, int] = {}  # block 0's outside input -> the node of the block before
    for j in range(1, len(blocks)):
        if len(blocks[j]) != len(blocks[0]):
            return False
        for a, b in zip(blocks[0], blocks[j]):
            if not _same_node(gm, a, b, leaves=leaves):
                return False
            for x, y in zip(leaves[a], leaves[b]):
                if isinstance(x, fx.Node) != isinstance(y, fx.Node):
                    return False
                if not isinstance(x, fx.Node):
                    if not _same_value(x, y):
                        return False
                elif x in index[0]:  # inside the block: the same place inside block j
                    if index[j].get(y) != index[0][x]:
                        return False
                elif x is not y:  # a chain input: the same place in block j-1
                    r = index[j - 1].get(y)
                    if r is None or chain.setdefault(x, r) != r:
                        return False
    last = len(blocks) - 1
    return all(u in members for n, j in members.items() if j != last for u in n.users)


def _leaves(node: fx.Node) -> list[Any]:
    return arg_leaves(node)


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return x is y
    try:
        return bool(x == y)
    except Exception:  # an object that does not compare: never the same
        return False


def _same_node(gm: fx.GraphModule, a: fx.Node, b: fx.Node,
               other: fx.GraphModule | None = None,
               leaves: dict[fx.Node, list[Any]] | None = None) -> bool:
    """The same op on the same shapes: targets equal, or attributes and layers alike
    (``other``: ``b``'s graph module, when it is not ``gm``; ``leaves``: the nodes' argument
    leaves, when they are known already)."""
    other = gm if other is None else other
    count = (lambda n: len(leaves[n])) if leaves is not None else (lambda n: len(_leaves(n)))
    if a.op != b.op or count(a) != count(b):
        return False
    if a.meta.get(SHAPES) != b.meta.get(SHAPES):
        return False
    if a.op == "get_attr":
        return alike(_attr(gm, a), _attr(other, b))
    if a.op == "call_module":
        return alike(gm.get_submodule(str(a.target)), other.get_submodule(str(b.target)))
    return a.target == b.target


def alike(x: Any, y: Any) -> bool:
    """Two tensors of one shape and dtype, or two layers of one class, submodule classes and
    parameter shapes (split-off graphs: node by node the same, up to their attributes'
    names)."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.shape, x.dtype, x.requires_grad) == (y.shape, y.dtype, y.requires_grad)
    if isinstance(x, nn.Module) and isinstance(y, nn.Module):
        graphs = isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule)
        if type(x) is not type(y) and not graphs:  # each GraphModule has a class of its own
            return False
        shapes = [[(p.shape, p.dtype, p.requires_grad) for p in m.parameters()] for m in (x, y)]
        if shapes[0] != shapes[1]:
            return False
        if not graphs and not _same_classes(list(x.modules()), list(y.modules())):
            return False  # the same parameters in other layers (a dense MLP, then an MoE)
        if graphs:
            xs, ys = list(x.graph.nodes), list(y.graph.nodes)
            return len(xs) == len(ys) and all(
                p.op in ("placeholder", "output") and p.op == q.op or _same_node(x, p, q, y)
                for p, q in zip(xs, ys))
        return True
    return x is y


def _same_classes(xs: list[nn.Module], ys: list[nn.Module]) -> bool:
    """Module by module one class, or parameter-free helpers whose classes, made afresh for
    each layer, run the same code (``same_code.helpers_alike``)."""
    return len(xs) == len(ys) and all(type(a) is type(b) or helpers_alike(a, b)
                                      for a, b in zip(xs, ys))


def truncate(gm: fx.GraphModule, blocks: Blocks, keep: int, share_meta: bool = False
             ) -> fx.GraphModule:
    """``gm`` with only its first ``keep`` blocks: what read the last block reads the last
    block kept. Nodes keep their names and meta (``share_meta``: the very dicts of ``gm``'s
    nodes, so that what a pass writes there later is the cut's too); parameters are ``gm``'s
    own (shared, not copied). The fake probe runs it node by node: its code is never made
    (``graph_code``)."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    dropped = {n for block in blocks.nodes[keep:] for n in block}
    alias = dict(zip(blocks.nodes[-1], blocks.nodes[keep - 1]))
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n not in dropped:
            env[n] = graph.node_copy(n, lambda a: env[alias.get(a, a)])
            if share_meta:
                env[n].meta = n.meta
    graph.lint()
    return graph_module(gm, graph, type(gm).__name__)
