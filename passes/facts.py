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
                          so microbatch outputs can be concatenated in order.
``BatchSize(factor)``     a Python int equal to ``factor * B`` (``x.size(0)``).
``Reduced(count)``        linear in sums over the batch (a sum, or a mean with
                          a known weight). Lives after the microbatch loop.
                          ``count`` marks sums of inputs only (no parameters):
                          denominators such as non-padding token counts.
``Free()``                batch-free: parameters, buffers, constants and what
                          is computed from them alone.
``Container(items)``      a tuple/list/dict input whose leaves have facts.
========================  ====================================================

Mixing values have no fact: the analysis raises ``MixingError`` instead.

The other ``node.meta`` keys mbcompile writes (all namespaced ``mbcompile.``):

- ``SHAPES``: ``ValueInfo`` of the node's value at two batch sizes (shape pass);
- ``REDUCTION``: how a reduction node splits into per-microbatch partials;
- ``PARAMS``: whether the value depends on parameters (analysis).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Union

__all__ = [
    "FACT",
    "PARAMS",
    "REDUCTION",
    "SHAPES",
    "Batched",
    "BatchSize",
    "Container",
    "Fact",
    "Free",
    "Reduced",
    "ReductionSpec",
    "ValueInfo",
]

FACT = "mbcompile.fact"
SHAPES = "mbcompile.shapes"
REDUCTION = "mbcompile.reduction"
PARAMS = "mbcompile.params"


@dataclass(frozen=True)
class Batched:
    """Per-sample along ``dim``; ``factor`` samples' worth of rows per sample."""

    dim: int
    factor: int = 1
    major: bool = True

    def __str__(self) -> str:
        merged = "" if self.factor == 1 else f", merged x{self.factor}"
        order = "" if self.major else ", interleaved"
        return f"per-sample(dim {self.dim}{merged}{order})"


@dataclass(frozen=True)
class BatchSize:
    """A Python int that equals ``factor`` times the batch size."""

    factor: int = 1

    def __str__(self) -> str:
        return f"batch-size x{self.factor}"


@dataclass(frozen=True)
class Reduced:
    """Linear in sums over the batch; ``count`` if it depends on inputs only."""

    count: bool = False

    def __str__(self) -> str:
        return "batch-count" if self.count else "batch-reduction"


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
        for k, fact in self.items:
            if k == key:
                return fact
        raise KeyError(key)

    def __str__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {f}" for k, f in self.items) + "}"


Fact = Union[Batched, BatchSize, Reduced, Free, Container]


@dataclass(frozen=True)
class ValueInfo:
    """A node's value seen at two batch sizes (``a`` = gbs, ``b`` = gbs + 1).

    For tensors ``shape_a``/``shape_b`` are the shapes; for ints ``int_a``/
    ``int_b`` the values. Comparing the two tells which dims scale with the batch.
    """

    is_tensor: bool
    shape_a: tuple[int, ...] = ()
    shape_b: tuple[int, ...] = ()
    dtype: Any = None
    int_a: int | None = None
    int_b: int | None = None
    value_a: Any = field(default=None, compare=False, repr=False)

    @property
    def batch_dims(self) -> tuple[int, ...]:
        """Dims whose size changes with the batch size."""
        return tuple(i for i, (x, y) in enumerate(zip(self.shape_a, self.shape_b)) if x != y)

    @property
    def ndim(self) -> int:
        return len(self.shape_a)


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
