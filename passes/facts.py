"""Batch facts: what each fx node's value is with respect to the batch.

Every node of a captured graph gets exactly one fact, written by the batch
analysis pass to ``node.meta[FACT]``:

========================  ====================================================
fact                      meaning
========================  ====================================================
``Batched(dim)``          per-sample: sample ``i`` of the output depends only on
                          sample ``i`` of the inputs, along ``dim``. ``factor``
                          > 1 means the batch dim was merged with neighbours
                          (``(B, T) -> (B*T)``); ``major`` says it is batch-major,
                          so microbatch outputs can be concatenated in order;
                          ``positions`` that the values are each row's index in
                          the batch (``torch.arange(B)``), usable only as an index.
``BatchSize(factor)``     a Python int equal to ``factor * B`` (``x.size(0)``);
                          ``multiple=False``: a number computed from B that is not
                          a multiple of it (``1 / B``), usable only after reductions.
``Reduced(count)``        linear in sums over the batch (a sum, or a mean with
                          a known weight). Lives after the microbatch loop.
                          ``count`` marks sums that carry no gradient (of inputs,
                          or of argmax-style values): denominators such as
                          non-padding token counts, accuracy counts.
``Free()``                batch-free: parameters, buffers, constants and what
                          is computed from them alone.
``Container(items)``      a tuple/list/dict input, or the several outputs of an
                          op (``split``, ``max(dim)``, ``LSTM``), one fact each.
``Coupled(reason)``       needs the whole batch: an op that mixes samples (softmax
                          over the batch, ``x @ x.T``, ``loss.sqrt()``) and all it
                          feeds. It runs once, on the whole batch, in the coupled
                          part of a two-phase step (``passes/coupling.py``).
========================  ====================================================

The first mixing op makes the analysis's ``rejected`` error (what a strict
``coupling="reject"`` compile raises); it and everything downstream are ``Coupled``.

The other ``node.meta`` keys mbcompile writes (all namespaced ``mbcompile.``):

- ``SHAPES``: ``ValueInfo`` of the node's value at two batch sizes (shape pass);
- ``REDUCTION``: how a reduction node splits into per-microbatch partials;
- ``PARAMS``: whether the value depends on parameters through something
  differentiable (analysis): argmax, comparisons and counts do not;
- ``GRAD_ENABLED``: the grad mode a node was traced under (fx capture; False inside a
  ``torch.no_grad()`` region of forward, see ``passes/forward_modes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "input_fact",
    "at_analysed_batch_only",
    "FACT",
    "GRAD_ENABLED",
    "PARAMS",
    "REDUCTION",
    "SHAPES",
    "Batched",
    "BatchSize",
    "Container",
    "Coupled",
    "Fact",
    "Free",
    "InfoTuple",
    "Reduced",
    "ReductionSpec",
    "ValueInfo",
]

FACT = "mbcompile.fact"
SHAPES = "mbcompile.shapes"
REDUCTION = "mbcompile.reduction"
PARAMS = "mbcompile.params"
GRAD_ENABLED = "mbcompile.grad_enabled"


@dataclass(frozen=True)
class Batched:
    """Per-sample along ``dim``; ``factor`` samples' worth of rows per sample."""

    dim: int
    factor: int = 1
    major: bool = True
    positions: bool = False  # values are the rows' positions in the batch: arange(B)

    def __str__(self) -> str:
        merged = "" if self.factor == 1 else f", merged x{self.factor}"
        order = "" if self.major else ", interleaved"
        pos = ", positions" if self.positions else ""
        return f"per-sample(dim {self.dim}{merged}{order}{pos})"


@dataclass(frozen=True)
class BatchSize:
    """A Python int that equals ``factor`` times the batch size (or, with
    ``multiple=False``, any number computed from it)."""

    factor: int = 1
    multiple: bool = True

    def __str__(self) -> str:
        return f"batch-size x{self.factor}" if self.multiple else "derived from batch size"


def at_analysed_batch_only(meta: Mapping[str, Any]) -> bool:
    """Whether a node (its ``meta``) holds a number computed non-linearly from the batch
    size (``1 / x.size(0)``, ``x.size(0) - 1``): its value is the analysed batch's, so it
    holds at that batch only (``analysis.reusable``, ``microbatch_rewrite.constants_at``).

    >>> at_analysed_batch_only({FACT: BatchSize(multiple=False)}), at_analysed_batch_only({})
    (True, False)
    """
    fact = meta.get(FACT)
    return isinstance(fact, BatchSize) and not fact.multiple


@dataclass(frozen=True)
class Reduced:
    """Linear in sums over the batch; ``count`` if it depends on inputs only."""

    count: bool = False

    def __str__(self) -> str:
        return "batch-count" if self.count else "batch-reduction"


@dataclass(frozen=True)
class Coupled:
    """Needs the whole batch: a mixing op (``reason`` says why), or fed by one."""

    reason: str = ""

    def __str__(self) -> str:
        return "coupled (whole batch)"


@dataclass(frozen=True)
class Free:
    """Independent of the batch."""

    def __str__(self) -> str:
        return "batch-free"


@dataclass(frozen=True)
class Container:
    """A tuple, list or dict whose leaves have their own facts."""

    items: tuple[tuple[Any, Fact], ...]  # (key or index, fact) pairs

    def get(self, key: Any) -> Fact:
        if isinstance(key, int) and key < 0 and all(k == i for i, (k, _) in enumerate(self.items)):
            key += len(self.items)  # x.shape[-1]: a sequence counts from its end
        for k, fact in self.items:
            if k == key:
                return fact
        raise KeyError(key)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {f}" for k, f in self.items) + "}"


Fact = Batched | BatchSize | Reduced | Free | Container | Coupled


@dataclass(frozen=True)
class ValueInfo:
    """A node's value seen at two batch sizes (``a`` = gbs, ``b`` = gbs + 1).

    For tensors ``shape_a``/``shape_b`` are the shapes; for Python numbers
    ``int_a``/``int_b`` the values (ints, or floats computed from sizes).
    Comparing the two tells which dims scale with the batch.
    """

    is_tensor: bool
    shape_a: tuple[int, ...] = ()
    shape_b: tuple[int, ...] = ()
    dtype: Any = None
    int_a: int | float | None = None
    int_b: int | float | None = None
    value_a: Any = field(default=None, compare=False, repr=False)

    def shape_grown(self, samples: int) -> tuple[int, ...]:
        """The shape at ``samples`` more than ``a`` (fewer, if negative): each dim grown as
        it grew from ``a`` to ``b`` (a batch-size variant's, from the analysis's values)."""
        return tuple(x + samples * (y - x) for x, y in zip(self.shape_a,
                                                           self.shape_b or self.shape_a))

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """Dims whose size changes with the batch size."""
        return tuple(i for i, (x, y) in enumerate(zip(self.shape_a, self.shape_b)) if x != y)

    @property
    def ndim(self) -> int:
        return len(self.shape_a)


class InfoTuple(tuple):
    """The ``ValueInfo`` s of an op returning several values; ``fields`` names them
    for namedtuple results (``torch.max(x, 1)``: ``("values", "indices")``)."""

    fields: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ReductionSpec:
    """How a reduction over the batch splits across microbatches.

    ``partial`` is a function with the op's own signature that returns the
    microbatch's partial sum (``kind="sum"``) or ``(sum, count)`` (``kind="mean"``);
    after the loop partials are added up, and a mean is divided once by the
    global count.
    """

    kind: str  # "sum" | "mean"
    partial: Callable[..., Any] | None = None  # None: the op itself is the partial sum


def input_fact(value: Any, dim: int | None) -> Fact:
    """The fact of a graph input whose tensors are batched along ``dim`` (None: unbatched);
    nested inputs (dicts, tuples, lists) get a ``Container`` of their leaves' facts."""
    if dim is None:
        return Free()
    if isinstance(value, torch.Tensor):
        return Batched(dim)
    if isinstance(value, Mapping):
        return Container(tuple((k, input_fact(v, dim)) for k, v in value.items()))
    if isinstance(value, (tuple, list)):
        return Container(tuple((i, input_fact(v, dim)) for i, v in enumerate(value)))
    return Free()
