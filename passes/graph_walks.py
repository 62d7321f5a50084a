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

import torch.fx as fx

__all__ = ["ancestors", "descendants"]


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
