"""The plan record: how one global batch is split, per system and per microbatch.

>>> plan = make_plan(10, 3, 2)           # planning/plan.py makes it; nothing else does
>>> plan.microbatch_sizes, plan.microbatch_slices[1]
(((2, 2), (2, 1), (2, 1)), ((4, 6), (6, 7)))

Only the record and what it derives from its own fields; the rules that make it are
``plan.py``'s, its text ``plan_text.py``'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mbcompile.planning.plan_text import format_plan

__all__ = ["MicrobatchPlan"]


@dataclass(frozen=True)
class MicrobatchPlan:
    """How one global batch is split: per system, then per microbatch.

    Build it with :func:`make_plan`; its invariants hold by construction.

    >>> plan = make_plan(10, 3, 2)
    >>> plan.microbatch_sizes
    ((2, 2), (2, 1), (2, 1))
    >>> plan.microbatch_slices[1]
    ((4, 6), (6, 7))
    """

    gbs: int
    num_csx: int
    per_system_batch_sizes: tuple[int, ...]
    requested_mbs: int | str  # the user's value; a mapping is kept as its repr
    mbs: int  # the effective MBS
    num_microbatches: int  # per system; the same on every system
    microbatch_sizes: tuple[tuple[int, ...], ...]  # per system, per microbatch
    supported_mbs: tuple[int, ...]
    warnings: tuple[str, ...]
    reason: str  # why this mbs
    #: Tokens per sample when the inputs have a sequence dim (set by compile), else None.
    tokens_per_sample: int | None = None
    #: Activation checkpointing per block (``passes/recompute.py``), chosen by the plan.
    recompute: bool = False
    #: FSDP2's ``reshard_after_forward`` for a sharded model's units, chosen with the MBS
    #: (None: the model is not sharded, or runs with the setting it was sharded with).
    reshard_after_forward: bool | None = None
    #: When a sharded model's gradients are reduce-scattered, chosen with the MBS:
    #: ``"step"`` (once, in the step's last backward) or ``"microbatch"`` (in every
    #: backward: they accumulate sharded); None as for ``reshard_after_forward``.
    gradient_sync: str | None = None
    #: The autocast the plan sized activations for (``precision.py``'s names: ``"32"``,
    #: ``"bf16-mixed"``, ``"fp16-mixed"``); set by compile, None for a bare ``make_plan``.
    precision: str | None = None

    @property
    def pbs(self) -> int:
        """The per-system batch size: the largest system's share."""
        return max(self.per_system_batch_sizes)

    @property
    def num_nonempty_microbatches(self) -> int:
        """Microbatches that actually run, summed over systems (empty ones are skipped)."""
        return sum(1 for sizes in self.microbatch_sizes for s in sizes if s)

    @property
    def max_microbatch_size(self) -> int:
        """The largest microbatch anywhere; it sets peak activation memory."""
        return max(max(sizes) for sizes in self.microbatch_sizes)

    @property
    def microbatch_slices(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """``(start, stop)`` of every microbatch in global batch order.

        System 0 takes the first samples; within a system, microbatches are
        contiguous and in order; an empty one has ``start == stop``.
        """
        out = []
        start = 0
        for sizes in self.microbatch_sizes:
            system = []
            for size in sizes:
                system.append((start, start + size))
                start += size
            out.append(tuple(system))
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: the fields as lists, plus ``pbs``."""
        d = asdict(self)
        for key, value in d.items():
            if isinstance(value, tuple):
                d[key] = [list(v) if isinstance(v, tuple) else v for v in value]
        d["pbs"] = self.pbs
        d["num_nonempty_microbatches"] = self.num_nonempty_microbatches
        if self.tokens_per_sample is not None:
            t = self.tokens_per_sample
            d["tokens"] = {"global": self.gbs * t,
                           "per_system": [n * t for n in self.per_system_batch_sizes],
                           "per_microbatch": [[n * t for n in mb]
                                              for mb in self.microbatch_sizes]}
        return d

    def __str__(self) -> str:
        return format_plan(self)
