"""Plan arithmetic: how a global batch is split over systems and microbatches.

Pure Python on purpose (it never imports torch): every rank of a distributed job
computes the same plan on its own from the configuration alone, and the rules can
be tested exhaustively in milliseconds.

The rules, walked through one running example (gbs 10 over 3 systems, mbs 2):

1. Systems get sizes that differ by at most one, larger first: ``(4, 3, 3)``.
2. The per-system batch size is the largest of them: ``pbs = ceil(10 / 3) = 4``.
3. Supported MBS values are ``{ceil(pbs / k) : k = 1..pbs} = (1, 2, 4)``; a
   requested integer outside that set is replaced by the closest supported one.
4. Every system runs ``ceil(pbs / mbs) = 2`` microbatches, so the systems stay in
   lock step; each splits its own samples evenly over them:
   ``((2, 2), (2, 1), (2, 1))``.  A small system may get empty microbatches,
   which the runtime skips (gbs 5 over 4 systems, mbs 1: ``((1, 1), (1, 0), ...)``).

>>> plan = make_plan(10, 3, 2)
>>> plan.per_system_batch_sizes, plan.mbs, plan.num_microbatches
((4, 3, 3), 2, 2)
>>> plan.microbatch_sizes
((2, 2), (2, 1), (2, 1))
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, cast

from mbcompile.passes.errors import MbsAdjustedWarning, PlanError
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.mbs_policy import (
    MbsPolicy,
    check_int,
    is_int,
    parse_mbs,
    requested_form,
)
from mbcompile.planning.plan_text import format_plan

__all__ = [
    "DEFAULT_AUTO_MICROBATCHES",
    "AutoChooser",
    "MbsPolicy",
    "MicrobatchPlan",
    "check_policy",
    "closest_supported",
    "make_plan",
    "num_microbatches",
    "parse_mbs",
    "per_system_batch_sizes",
    "plan_for",
    "single_microbatch",
    "split_evenly",
    "supported_mbs",
]

#: Given ``(pbs, candidates)`` return ``(mbs, reason)``; ``mbs`` must be one of
#: ``candidates``.  The cost model plugs in here for ``"auto"`` and ``"explore"``.
AutoChooser = Callable[[int, tuple[int, ...]], tuple[int, str]]

#: Without a cost model, ``"auto"`` aims for this many microbatches per system:
#: enough to cut activation memory about fourfold, few enough that the fixed
#: per-microbatch cost stays small.
DEFAULT_AUTO_MICROBATCHES = 4

# --------------------------------------------------------------------------- #
# The arithmetic
# --------------------------------------------------------------------------- #


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


def per_system_batch_sizes(gbs: int, num_csx: int) -> tuple[int, ...]:
    """Batch size of each system: balanced, summing to ``gbs``, larger first.

    >>> per_system_batch_sizes(10, 3)
    (4, 3, 3)
    """
    gbs = check_int("gbs", gbs, 1)
    num_csx = check_int("num_csx", num_csx, 1)
    if gbs < num_csx:
        raise PlanError(
            f"gbs={gbs} is smaller than num_csx={num_csx}: each system needs at "
            f"least one sample; use gbs >= {num_csx} or num_csx <= {gbs}"
        )
    return split_evenly(gbs, num_csx)


def num_microbatches(pbs: int, mbs: int) -> int:
    """Microbatches per system at MBS ``mbs``: ``ceil(pbs / mbs)``, the same on every
    system (they run in lock step; smaller systems' microbatches are smaller).

    >>> num_microbatches(10, 4)
    3
    """
    return -(-pbs // mbs)


def supported_mbs(pbs: int) -> tuple[int, ...]:
    """Every MBS that gives a distinct microbatch count: ``{ceil(pbs/k) : k=1..pbs}``.

    Sorted ascending.  Runs in O(sqrt(pbs)).

    >>> supported_mbs(10)  # k = 1, 2, 3, 4, 5..9, 10
    (1, 2, 3, 4, 5, 10)
    """
    pbs = check_int("pbs", pbs, 1)
    # ceil(pbs/k) == (pbs-1)//k + 1, and floor(m/k) takes O(sqrt m) distinct
    # values, constant on blocks of k: for quotient q = m//k the block ends at
    # k = m//q.  Jumping block to block visits each distinct value once.
    m = pbs - 1
    values = {1}  # k = pbs (and k > m in general) gives ceil(pbs/k) == 1
    k = 1
    while k <= m:
        q = m // k
        values.add(q + 1)
        k = m // q + 1
    return tuple(sorted(values))


def closest_supported(mbs: int, supported: tuple[int, ...]) -> int:
    """The value of ``supported`` nearest to ``mbs``; ties go to the smaller.

    The smaller wins a tie because it never uses more memory than was asked for.

    >>> closest_supported(4, supported_mbs(9))  # (1, 2, 3, 5, 9): 3 and 5 tie
    3
    """
    mbs = check_int("mbs", mbs)
    if not supported:
        raise PlanError("closest_supported needs at least one supported value")
    return min(supported, key=lambda s: (abs(s - mbs), s))


def _nearby(value: int, supported: tuple[int, ...], count: int = 2) -> tuple[int, ...]:
    """Up to ``count`` supported values on each side of ``value`` (for messages)."""
    below = [s for s in supported if s < value][-count:]
    above = [s for s in supported if s >= value][:count]
    return tuple(below + above)


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #


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


def _warn_user(message: str) -> None:
    # at the first frame outside mbcompile and torch, however deep the call into the package
    # was (compile() -> select() -> make_plan() -> here)
    warnings.warn(message, MbsAdjustedWarning, stacklevel=user_stacklevel())


def _default_auto(pbs: int, supported: tuple[int, ...]) -> tuple[int, str]:
    k = min(DEFAULT_AUTO_MICROBATCHES, pbs)
    mbs = -(-pbs // k)
    return mbs, (
        f"auto (no cost model): about {k} microbatches per system, "
        f"mbs = ceil(pbs / min({DEFAULT_AUTO_MICROBATCHES}, pbs)) = ceil({pbs} / {k}) = {mbs}"
    )


def _call_chooser(
    name: str, chooser: AutoChooser, pbs: int, candidates: tuple[int, ...]
) -> tuple[int, str]:
    # A chooser is our own cost model, but a wrong answer from it must not turn
    # into a silently different plan: reject anything outside the candidates.
    mbs, reason = chooser(pbs, candidates)
    if not is_int(mbs) or int(mbs) not in candidates:
        raise PlanError(
            f"the {name} returned mbs={mbs!r}, which is not one of the "
            f"{len(candidates)} candidate values ({candidates[0]}..{candidates[-1]}, "
            f"supported for per-system batch size {pbs}); fix the {name}"
        )
    return int(mbs), str(reason)


def make_plan(
    gbs: int,
    num_csx: int,
    mbs: object = "auto",
    *,
    chooser: AutoChooser | None = None,
    explorer: AutoChooser | None = None,
) -> MicrobatchPlan:
    """Plan ``gbs`` samples over ``num_csx`` systems with the MBS policy ``mbs``.

    ``chooser`` picks the MBS for ``"auto"`` (default: about
    ``DEFAULT_AUTO_MICROBATCHES`` microbatches per system); ``explorer`` picks it
    for ``"explore"`` and explore ranges, which fail without one.

    >>> p = make_plan(10, 3, 2)
    >>> p.per_system_batch_sizes, p.num_microbatches, p.microbatch_sizes
    ((4, 3, 3), 2, ((2, 2), (2, 1), (2, 1)))
    """
    return plan_for(per_system_batch_sizes(gbs, num_csx), parse_mbs(mbs), chooser=chooser,
                    explorer=explorer)


def plan_for(
    system_sizes: tuple[int, ...],
    policy: MbsPolicy,
    *,
    chooser: AutoChooser | None = None,
    explorer: AutoChooser | None = None,
) -> MicrobatchPlan:
    """:func:`make_plan` for per-system batch sizes already split (``Request``'s) and an
    ``mbs`` already parsed: what ``compile()``'s stages call.

    >>> plan_for((4, 3, 3), parse_mbs(2)).microbatch_sizes
    ((2, 2), (2, 1), (2, 1))
    """
    gbs, num_csx = sum(system_sizes), len(system_sizes)
    pbs = system_sizes[0]  # larger first, so this is ceil(gbs / num_csx)
    supported = supported_mbs(pbs)
    where = f"gbs {gbs} over {num_csx} system{'s' if num_csx != 1 else ''}"
    notes: list[str] = []

    if policy.mode == "int":
        requested = cast(int, policy.value)  # parse_mbs sets it for "int"
        if requested > pbs:
            raise PlanError(
                f"mbs={requested} must be at most the per-system batch size {pbs} "
                f"({where}); use mbs={pbs} (or mbs='none') for one microbatch per "
                f"system, or a smaller mbs for more microbatches"
            )
        effective = closest_supported(requested, supported)
        if effective == requested:
            reason = f"requested mbs={requested}"
        else:
            message = (
                f"mbs={requested} is not supported for per-system batch size {pbs} "
                f"({where}): supported values are ceil({pbs} / k) for k microbatches; "
                f"using mbs={effective}, the closest (ties go to the smaller). "
                f"Nearby supported values: "
                f"{', '.join(map(str, _nearby(requested, supported)))}"
            )
            notes.append(message)
            _warn_user(message)
            reason = f"requested mbs={requested}, adjusted to the closest supported {effective}"
    elif policy.mode == "none":
        effective = pbs
        reason = "mbs='none': one microbatch per system (mbs = pbs)"
    elif policy.mode == "auto":
        if chooser is None:
            effective, reason = _default_auto(pbs, supported)
        else:
            effective, reason = _call_chooser("auto chooser", chooser, pbs, supported)
    else:  # explore, whole range or bounded
        candidates = _explore_candidates(policy, pbs, supported, where, notes)
        if explorer is None:
            raise PlanError(
                f"mbs={requested_form(policy.request)!r} needs the cost model to compare MBS "
                f"values, and no explorer was given; run it through compile_only "
                f"(which reports the best mbs to pin), or pass mbs='auto' or an int"
            )
        effective, reason = _call_chooser("explorer", explorer, pbs, candidates)

    count = num_microbatches(pbs, effective)
    # Every system runs the same count (lock step for the all-reduce); smaller
    # systems spread their fewer samples over it, possibly leaving empties.
    microbatch_sizes = tuple(split_evenly(size, count) for size in system_sizes)
    return MicrobatchPlan(
        gbs=gbs,
        num_csx=num_csx,
        per_system_batch_sizes=system_sizes,
        requested_mbs=requested_form(policy.request),
        mbs=effective,
        num_microbatches=count,
        microbatch_sizes=microbatch_sizes,
        supported_mbs=supported,
        warnings=tuple(notes),
        reason=reason,
    )


def _explore_candidates(
    policy: MbsPolicy, pbs: int, supported: tuple[int, ...], where: str, notes: list[str]
) -> tuple[int, ...]:
    lo = 1 if policy.explore_min is None else policy.explore_min
    hi = pbs if policy.explore_max is None else policy.explore_max
    clamped_lo, clamped_hi = min(lo, pbs), min(hi, pbs)  # bounds are >= 1 already
    if (clamped_lo, clamped_hi) != (lo, hi):
        # Not an error (a range is a search hint), but not silent either.
        message = (
            f"explore range [{lo}, {'pbs' if policy.explore_max is None else hi}] "
            f"clamped to [{clamped_lo}, {clamped_hi}]: "
            f"mbs can be at most the per-system batch size {pbs} ({where})"
        )
        notes.append(message)
        _warn_user(message)
    candidates = tuple(s for s in supported if clamped_lo <= s <= clamped_hi)
    if not candidates:
        raise PlanError(
            f"no supported mbs in the explore range [{clamped_lo}, {clamped_hi}] for "
            f"per-system batch size {pbs} ({where}); supported values nearby: "
            f"{', '.join(map(str, _nearby(clamped_lo, supported)))}; widen the range"
        )
    return candidates


def check_policy(system_sizes: tuple[int, ...], policy: MbsPolicy, planning_only: bool) -> None:
    """Fail fast, before any tracing, on what the arguments alone rule out: an int MBS
    above the per-system batch size, an explore range with no supported value in it,
    and ``"explore"`` without ``compile_only=True`` (``planning_only``)."""
    if policy.mode == "int" and (policy.value or 0) > system_sizes[0]:
        plan_for(system_sizes, policy)  # raises the plan's own "must be at most" error
    if policy.mode == "explore":
        with warnings.catch_warnings():  # a clamped range warns once, when it is planned
            warnings.simplefilter("ignore")
            plan_for(system_sizes, policy, explorer=lambda _, c: (c[0], ""))  # range errors
    if policy.mode == "explore" and not planning_only:
        raise PlanError(
            f"mbs={policy.request!r} explores MBS values and reports the best one to pin; it does "
            "not build a module to train with. Run it once with compile_only=True, read "
            "cm.report() (or cm.plan.mbs), then compile again with mbs=<that value>: "
            f"compile(model, gbs, num_csx, mbs={policy.request!r}, compile_only=True, ...)")


def single_microbatch(system_sizes: tuple[int, ...], policy: MbsPolicy) -> bool:
    """True when the request can only mean one system running one microbatch.

    Such a plan splits nothing, so a graph the batch analysis rejects still runs
    (the fix its errors suggest: ``num_csx=1, mbs='none'``).

    >>> single_microbatch((10,), parse_mbs(9))  # the closest supported value is 10
    True
    """
    if len(system_sizes) != 1:
        return False
    pbs = system_sizes[0]
    if policy.mode == "none" or pbs == 1:
        return True
    if policy.mode == "int":
        return closest_supported(min(policy.value or 1, pbs), supported_mbs(pbs)) == pbs
    return False
