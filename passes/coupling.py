"""Where the per-sample part of an analysed graph ends: the tail, and a two-phase split.

The rewrite runs the per-sample part P of the graph once per microbatch (the body)
and what follows it once, on whole-batch values (the tail). :func:`partition` walks
back from the outputs and stops at the values the loop hands over:

- a reduction over the batch: its partial sums, added over microbatches and systems;
- a per-sample value: the microbatches' pieces, joined in batch order (the frontier);
- a batch size, or a Python number read off a batched tensor's shape: a constant,
  its value at the full batch, so that the tail never pulls a batched intermediate
  out of the loop just to read its size.

When the batch analysis found ops that mix samples (``Coupled`` facts, see
``facts.py``), they are in the tail too: the tail is then the coupled part C, run once
on the whole batch, and the frontier F is what flows from P into C. A two-phase step
runs P without grad per microbatch, C with grad on the joined F (the loss, C's own
gradients and dL/dF), then P again per microbatch with grad, backpropagating its
slice of dL/dF (docs/concepts.md, "Losses that couple samples"; GradCache, by hand).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from .facts import FACT, REDUCTION, SHAPES, Batched, BatchSize, Coupled, Free, ValueInfo
from .graph_walks import ancestors, descendants

__all__ = ["Partition", "partition"]


@dataclass
class Partition:
    """The tail of an analysed graph and what it reads from the loop.

    ``tail``: nodes run once after the loop, in graph order (the coupled part C when
    ``coupled``); ``frontier``: per-sample values the tail reads, joined over
    microbatches (output leaves included); ``reductions``: reductions over the batch
    it reads; ``constants``: numbers the tail reads as their full-batch value.
    """

    tail: list[fx.Node] = field(default_factory=list)
    frontier: list[fx.Node] = field(default_factory=list)
    reductions: list[fx.Node] = field(default_factory=list)
    constants: dict[fx.Node, int | float] = field(default_factory=dict)

    @property
    def coupled(self) -> bool:
        """Whether the tail holds ops that mix samples (a two-phase step)."""
        return any(isinstance(n.meta.get(FACT), Coupled) for n in self.tail)

    def frontier_bytes(self, grown: int = 0) -> float:
        """Bytes of the joined frontier at the full batch (the shape pass's values), or at
        ``grown`` samples more (fewer, if negative): a batch of another size than the
        analysis saw, each dim grown as it grew from its batch ``a`` to ``b = a + 1``."""
        total = 0.0
        for n in self.frontier:
            info = n.meta.get(SHAPES)
            if isinstance(info, ValueInfo) and info.is_tensor and info.dtype is not None:
                total += math.prod(info.shape_grown(grown)) * info.dtype.itemsize
        return total


def partition(graph: fx.Graph, extra_roots: Iterable[fx.Node] = (),
              roots: Iterable[fx.Node] | None = None,
              inputs: Collection[fx.Node] = ()) -> Partition:
    """Walk back from the outputs (``roots``: those kept; default all) and ``extra_roots``
    to the values the loop provides.

    A per-sample value whose pieces cannot be joined in batch order (samples
    interleaved with another dim, or each row's position in the batch, which restarts
    in every microbatch) is not a frontier value: the tail recomputes it from values
    further up, at the full batch. So is one made from the batch size alone, not from
    the samples (``torch.randperm(B)``, ``torch.zeros(B, d)``): its pieces would be
    made per microbatch (a permutation of each microbatch, not of the batch).

    ``inputs``: nodes computed before the loop and handed in like the graph's inputs (the
    random draws of ``draws.py``): a per-sample one is a frontier value (the tail reads the
    very numbers the body read, joined from its pieces), any other one the tail reads whole.
    """
    if roots is None:
        roots = next(n for n in reversed(graph.nodes) if n.op == "output").all_input_nodes
    part = Partition()
    samples = _reads_samples(graph)
    seen: set[fx.Node] = set()
    in_tail: set[fx.Node] = set()
    todo = [*roots, *extra_roots]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        fact = n.meta.get(FACT)
        if REDUCTION in n.meta:
            part.reductions.append(n)
        elif isinstance(fact, Batched) and (n.op == "placeholder" or n in inputs or (
                fact.major and not fact.positions and samples(n))):
            part.frontier.append(n)
        elif n.op == "placeholder" or n in inputs:
            continue  # an unbatched input: the tail reads it as it is
        elif (isinstance(fact, BatchSize) or _shape_number(n)) and not _reads_number_input(n):
            part.constants[n] = n.meta[SHAPES].int_a
        else:
            in_tail.add(n)
            todo.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    part.tail = sorted(in_tail, key=order.__getitem__)
    part.frontier.sort(key=order.__getitem__)
    part.reductions.sort(key=order.__getitem__)
    return part


def _reads_samples(graph: fx.Graph) -> Callable[[fx.Node], bool]:
    """Whether a node's value is computed from a batched input's data: reached from one,
    not through a batch size (a size carries no data)."""
    sources = [n for n in graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get(FACT), Batched)]
    reached = descendants(sources, through=lambda n: not isinstance(n.meta.get(FACT), BatchSize))
    return lambda n: n in reached and not isinstance(n.meta.get(FACT), BatchSize)


def _shape_number(n: fx.Node) -> bool:
    """A batch-free Python number computed from a batched tensor's shape (``h.size(-1)``)."""
    info = n.meta.get(SHAPES)
    if not isinstance(n.meta.get(FACT), Free) or not isinstance(info, ValueInfo) \
            or info.is_tensor or isinstance(info.int_a, bool) \
            or not isinstance(info.int_a, (int, float)) or info.int_a != info.int_b:
        return False
    return _reads_batched(n.all_input_nodes)


def _reads_number_input(n: fx.Node) -> bool:
    """Computed from a number the graph reads at run time (``guards.read_number``: a counter
    fed each call): no constant of compile time (``self.seen += x.shape[0]`` was fixed at
    the third step's 14 + 7, and the counter stopped). The tail computes it each call."""
    from .guards import read_number  # the guards import the capture's whole reading side

    return any(a.op == "call_function" and a.target is read_number for a in ancestors([n]))


def _reads_batched(nodes: Sequence[fx.Node]) -> bool:
    def through(n: fx.Node) -> bool:  # sizes and shape tuples, not tensors
        info = n.meta.get(SHAPES)
        return isinstance(n.meta.get(FACT), Free) and not (isinstance(info, ValueInfo)
                                                           and info.is_tensor)
    return any(isinstance(n.meta.get(FACT), (Batched, Coupled))
               for n in ancestors(nodes, through))
