"""Walks over an fx graph's edges: what a value is computed from, and what it feeds.

The passes ask these two questions in several forms (the nodes a body needs, the outputs
a gradient reaches, whether a value reads the samples' data); each form is one call here
with a ``through`` predicate saying which nodes the walk may pass.

Example, ``h = l(x); loss = h.sum(); n = h.size(0)``::

    ancestors([loss])                              # {loss, h, l's x, x}
    ancestors([loss], through=lambda n: n is not h)  # {loss, h}: not past h
    descendants([x], through=lambda n: n is not h)   # {x, h}: not past h
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

__all__ = ["ancestors", "arg_leaves", "descendants"]


def _walk(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]],
          through: Callable[[fx.Node], bool] | None) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(starts)
    while todo:  # iterative: graphs are thousands of nodes deep
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if through is None or through(n):
            todo.extend(step(n))
    return seen


def ancestors(roots: Iterable[fx.Node], through: Callable[[fx.Node], bool] | None = None
              ) -> set[fx.Node]:
    """The ``roots`` and every node they are computed from, not looking past the nodes
    ``through`` refuses (they are in the set; their inputs are not walked)."""
    return _walk(roots, lambda n: n.all_input_nodes, through)


def descendants(sources: Iterable[fx.Node], through: Callable[[fx.Node], bool] | None = None
                ) -> set[fx.Node]:
    """The ``sources`` and every node computed from them, not looking past the nodes
    ``through`` refuses (they are in the set; their users are not walked)."""
    return _walk(sources, lambda n: n.users, through)


_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)
_ATOMS = (fx.Node, int, float, bool, str, type(None), torch.dtype, torch.device)


def arg_leaves(node: fx.Node) -> list[Any]:
    """``pytree.tree_leaves((node.args, node.kwargs))``: the containers fx builds (tuples,
    lists, dicts, its immutable ones) and the common atoms are walked here, anything else
    (a ``torch.Size``, a namedtuple, a slice) by pytree. The passes ask for every node's
    leaves, where pytree's lookup of each value's type was half the cost."""
    return _leaves((node.args, node.kwargs), [])


def _leaves(value: Any, out: list[Any]) -> list[Any]:
    kind = type(value)
    if kind in _SEQUENCES:
        for v in value:
            _leaves(v, out)
    elif kind in _MAPPINGS:  # pytree's order: the values as inserted
        for v in value.values():
            _leaves(v, out)
    elif kind in _ATOMS:
        out.append(value)
    else:
        out.extend(pytree.tree_leaves(value))
    return out
