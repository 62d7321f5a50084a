"""The plan record: how one global batch is split, per system and per microbatch.

>>> plan = make_plan(10, 3, 2)           # planning/plan.py makes it; nothing else does
>>> plan.microbatch_sizes, plan.microbatch_slices[1]
(((2, 2), (2, 1), (2, 1)), ((4, 6), (6, 7)))

The record, what it derives from its own fields, and ``MbsChoices``: what a policy
leaves to choose, worked out by ``plan.py``'s ``check_policy`` (the rules), which makes
the record once the MBS is chosen (``MbsChoices.plan``). Its text is ``plan_text.py``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mbcompile.passes.errors import MbsAdjustedWarning, PlanError
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.mbs_policy import check_int, is_int
from mbcompile.planning.plan_text import format_plan

__all__ = ["DEFAULT_AUTO_MICROBATCHES", "MbsChoices", "MicrobatchPlan", "split_evenly"]

#: Without a cost model, ``"auto"`` aims for this many microbatches per system:
#: enough to cut activation memory about fourfold, few enough that the fixed
#: per-microbatch cost stays small.
DEFAULT_AUTO_MICROBATCHES = 4


def split_evenly(n: int, parts: int) -> tuple[int, ...]:
    """Split ``n`` into ``parts`` sizes that differ by at most one, larger first.

    Sizes may be zero when ``n < parts``.

    >>> split_evenly(10, 3)
    (4, 3, 3)
    >>> split_evenly(1, 2)
    (1, 0)
    """
    n = check_int("n", n, 0)
    parts = check_int("parts", parts, 1)
    q, r = divmod(n, parts)
    # Larger first so that system 0 / microbatch 0 is always the biggest: the
    # first one to run is then the one that sets peak memory.
    return (q + 1,) * r + (q,) * (parts - r)


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


@dataclass(frozen=True)
class MbsChoices:
    """What an MBS policy leaves to choose at given per-system batch sizes, worked out
    once, before any tracing (``plan.check_policy``, from ``make_request``), handed to the
    stages that choose, and made into the plan once the MBS is chosen (``plan``).

    >>> c = check_policy((10,), parse_mbs(9), planning_only=False)
    >>> c.allowed, c.pinned, c.single, c.counts[5]   # 9 is not supported: 10 is closest
    ((10,), 10, True, 2)
    """

    #: every supported MBS -> microbatches per system at it, ascending
    counts: Mapping[int, int]
    #: the values the selection chooses among: the one a pinned policy runs (an int's
    #: closest supported value, ``"none"``'s whole batch), every supported value for
    #: ``"auto"``, those in range for ``"explore"``
    allowed: tuple[int, ...]
    #: the MBS a pinned policy (an int or ``"none"``) runs; None when it is chosen
    pinned: int | None
    #: whatever is chosen, one system runs one microbatch: nothing is split, so a graph the
    #: batch analysis rejects still runs (the fix its errors suggest: ``num_csx=1,
    #: mbs='none'``)
    single: bool
    #: the per-system batch sizes, larger first (``Request.per_system_batch_sizes``)
    sizes: tuple[int, ...]
    #: the policy's mode and the user's ``mbs`` as the plan keeps it (``requested_mbs``)
    mode: str
    requested: int | str
    #: why a pinned policy runs ``pinned``; the warnings the plan carries (an int adjusted
    #: to the closest supported value, a clamped explore range), warned when it is made
    reason: str
    notes: tuple[str, ...]

    def plan(self, chosen: tuple[int, str] | None = None) -> MicrobatchPlan:
        """The plan: the pinned MBS, or ``chosen`` (``(mbs, reason)``, one of ``allowed``,
        from a search or a chooser); ``"auto"`` without one takes the default (about
        ``DEFAULT_AUTO_MICROBATCHES`` microbatches per system).

        >>> check_policy((4, 3, 3), parse_mbs(2), True).plan().microbatch_sizes
        ((2, 2), (2, 1), (2, 1))
        """
        pbs = self.sizes[0]  # larger first, so this is ceil(gbs / num_csx)
        for note in self.notes:  # at the first frame outside mbcompile and torch
            warnings.warn(note, MbsAdjustedWarning, stacklevel=user_stacklevel())
        if self.pinned is not None:
            mbs, reason = self.pinned, self.reason
        elif chosen is not None:
            mbs, reason = _checked_choice("auto chooser" if self.mode == "auto" else "explorer",
                                          chosen, pbs, self.allowed)
        elif self.mode == "auto":
            k = min(DEFAULT_AUTO_MICROBATCHES, pbs)
            mbs = -(-pbs // k)
            reason = (f"auto (no cost model): about {k} microbatches per system, mbs = "
                      f"ceil(pbs / min({DEFAULT_AUTO_MICROBATCHES}, pbs)) = ceil({pbs} / {k}) "
                      f"= {mbs}")
        else:
            raise PlanError(
                f"mbs={self.requested!r} needs the cost model to compare MBS "
                f"values, and no explorer was given; run it through compile_only "
                f"(which reports the best mbs to pin), or pass mbs='auto' or an int"
            )
        count = self.counts[mbs]
        # Every system runs the same count (lock step for the all-reduce); smaller
        # systems spread their fewer samples over it, possibly leaving empties.
        return MicrobatchPlan(
            gbs=sum(self.sizes), num_csx=len(self.sizes), per_system_batch_sizes=self.sizes,
            requested_mbs=self.requested, mbs=mbs, num_microbatches=count,
            microbatch_sizes=tuple(split_evenly(size, count) for size in self.sizes),
            supported_mbs=tuple(self.counts), warnings=self.notes, reason=reason)


def _checked_choice(name: str, chosen: tuple[int, str], pbs: int,
                    candidates: tuple[int, ...]) -> tuple[int, str]:
    # A choice is our own cost model's, but a wrong answer from it must not turn
    # into a silently different plan: reject anything outside the candidates.
    mbs, reason = chosen
    if not is_int(mbs) or int(mbs) not in candidates:
        raise PlanError(
            f"the {name} returned mbs={mbs!r}, which is not one of the "
            f"{len(candidates)} candidate values ({candidates[0]}..{candidates[-1]}, "
            f"supported for per-system batch size {pbs}); fix the {name}"
        )
    return int(mbs), str(reason)
