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

from collections.abc import Callable
from typing import cast

from mbcompile.passes.errors import PlanError
from mbcompile.planning.mbs_policy import (
    MbsPolicy,
    check_int,
    is_int,
    parse_mbs,
)
from mbcompile.planning.microbatch_plan import (
    DEFAULT_AUTO_MICROBATCHES,
    MbsChoices,
    MicrobatchPlan,
    split_evenly,
)

__all__ = [
    "DEFAULT_AUTO_MICROBATCHES",
    "AutoChooser",
    "MbsChoices",
    "MbsPolicy",
    "MicrobatchPlan",
    "check_policy",
    "closest_supported",
    "make_plan",
    "num_microbatches",
    "parse_mbs",
    "per_system_batch_sizes",
    "plan_for",
    "split_evenly",
    "supported_mbs",
]

#: Given ``(pbs, candidates)`` return ``(mbs, reason)``; ``mbs`` must be one of
#: ``candidates``: what ``make_plan`` asks for ``"auto"`` and ``"explore"``. (``compile()``
#: asks no callback: its search chooses first and hands ``plan_for`` the choice.)
AutoChooser = Callable[[int, tuple[int, ...]], tuple[int, str]]

# --------------------------------------------------------------------------- #
# The arithmetic
# --------------------------------------------------------------------------- #


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
    for ``"explore"`` and explore ranges, which fail without one. Each is asked once,
    with the candidates (``MbsChoices.allowed``), before the plan is made.

    >>> p = make_plan(10, 3, 2)
    >>> p.per_system_batch_sizes, p.num_microbatches, p.microbatch_sizes
    ((4, 3, 3), 2, ((2, 2), (2, 1), (2, 1)))
    """
    choices = check_policy(per_system_batch_sizes(gbs, num_csx), parse_mbs(mbs),
                           planning_only=True)
    pick = {"auto": chooser, "explore": explorer}.get(choices.mode)
    return choices.plan(pick(choices.sizes[0], choices.allowed) if pick is not None else None)


def plan_for(
    system_sizes: tuple[int, ...],
    policy: MbsPolicy,
    *,
    chosen: tuple[int, str] | None = None,
) -> MicrobatchPlan:
    """:func:`make_plan` for per-system batch sizes already split (``Request``'s) and an
    ``mbs`` already parsed: ``check_policy(...).plan(chosen)`` (``compile()``'s search
    asks the request's ``MbsChoices`` directly). ``chosen``: the ``(mbs, reason)`` a
    search chose for ``"auto"`` or ``"explore"`` among ``MbsChoices.allowed``;
    ``"auto"`` without one takes the default.

    >>> plan_for((4, 3, 3), parse_mbs(2)).microbatch_sizes
    ((2, 2), (2, 1), (2, 1))
    """
    return check_policy(system_sizes, policy, planning_only=True).plan(chosen)


def _requested_form(mbs: object) -> int | str:
    """The user's ``mbs`` as the plan keeps it (``requested_mbs``)."""
    # Plans are frozen and hashable, and a dict is neither; its repr prints the same.
    if is_int(mbs):
        return int(mbs)  # type: ignore[call-overload]
    return mbs if isinstance(mbs, str) else repr(mbs)


def _where(system_sizes: tuple[int, ...]) -> str:
    """The split a message names: ``gbs 10 over 3 systems``."""
    n = len(system_sizes)
    return f"gbs {sum(system_sizes)} over {n} system{'s' if n != 1 else ''}"


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
        notes.append(message)  # warned when the plan is made (MbsChoices.plan)
    candidates = tuple(s for s in supported if clamped_lo <= s <= clamped_hi)
    if not candidates:
        raise PlanError(
            f"no supported mbs in the explore range [{clamped_lo}, {clamped_hi}] for "
            f"per-system batch size {pbs} ({where}); supported values nearby: "
            f"{', '.join(map(str, _nearby(clamped_lo, supported)))}; widen the range"
        )
    return candidates


def check_policy(system_sizes: tuple[int, ...], policy: MbsPolicy, planning_only: bool
                 ) -> MbsChoices:
    """The choices ``policy`` leaves at ``system_sizes``, and what the plan made of them
    needs (``MbsChoices.plan``). Fails fast, before any tracing, on what the arguments
    alone rule out: an int MBS above the per-system batch size, an explore range with no
    supported value in it, and ``"explore"`` without ``compile_only=True``
    (``planning_only``)."""
    pbs = system_sizes[0]
    supported = supported_mbs(pbs)
    where = _where(system_sizes)
    pinned: int | None = None
    reason, notes = "", []
    if policy.mode == "int":
        requested = cast(int, policy.value)  # parse_mbs sets it for "int"
        if requested > pbs:
            raise PlanError(
                f"mbs={requested} must be at most the per-system batch size {pbs} "
                f"({where}); use mbs={pbs} (or mbs='none') for one microbatch per "
                f"system, or a smaller mbs for more microbatches"
            )
        pinned = closest_supported(requested, supported)
        reason = f"requested mbs={requested}"
        if pinned != requested:
            notes.append(
                f"mbs={requested} is not supported for per-system batch size {pbs} "
                f"({where}): supported values are ceil({pbs} / k) for k microbatches; "
                f"using mbs={pinned}, the closest (ties go to the smaller). "
                f"Nearby supported values: "
                f"{', '.join(map(str, _nearby(requested, supported)))}"
            )
            reason += f", adjusted to the closest supported {pinned}"
    elif policy.mode == "none":
        pinned = pbs
        reason = "mbs='none': one microbatch per system (mbs = pbs)"
    allowed = supported
    if pinned is not None:
        allowed = (pinned,)
    elif policy.mode == "explore":  # range errors; a clamped range warns when it is planned
        allowed = _explore_candidates(policy, pbs, supported, where, notes)
    if policy.mode == "explore" and not planning_only:
        raise PlanError(
            f"mbs={policy.request!r} explores MBS values and reports the best one to pin; it does "
            "not build a module to train with. Run it once with compile_only=True, read "
            "cm.report() (or cm.plan.mbs), then compile again with mbs=<that value>: "
            f"compile(model, gbs, num_csx, mbs={policy.request!r}, compile_only=True, ...)")
    return MbsChoices(counts={m: num_microbatches(pbs, m) for m in supported},
                      allowed=allowed, pinned=pinned,
                      single=len(system_sizes) == 1 and allowed == (pbs,),
                      sizes=system_sizes, mode=policy.mode,
                      requested=_requested_form(policy.request), reason=reason,
                      notes=tuple(notes))
