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

import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar, cast

from mbcompile.passes.errors import ArgumentTypeError, MbsAdjustedWarning, PlanError
from mbcompile.passes.sources import user_stacklevel

T = TypeVar("T")

__all__ = [
    "DEFAULT_AUTO_MICROBATCHES",
    "AutoChooser",
    "MbsPolicy",
    "MicrobatchPlan",
    "closest_supported",
    "describe_fsdp",
    "make_plan",
    "parse_mbs",
    "per_system_batch_sizes",
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

_MODES = ("auto", "explore", "none")
_EXPLORE_FORM = "{'explore': {'min': a, 'max': b}} (both optional ints >= 1, a <= b)"


# --------------------------------------------------------------------------- #
# Argument checking
# --------------------------------------------------------------------------- #


def _is_int(value: object) -> bool:
    # bool is an int subclass, but ``gbs=True`` is always a mistake; numbers.Integral
    # lets numpy integers through, which configs loaded by numpy-aware code produce.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise ArgumentTypeError(
            f"{name} must be an int, got {value!r} of type {type(value).__name__}"
        )
    value = int(value)  # type: ignore[call-overload]
    if minimum is not None and value < minimum:
        raise PlanError(f"{name} must be at least {minimum}, got {value}")
    return value


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
    n = _check_int("n", n, 0)
    parts = _check_int("parts", parts, 1)
    q, r = divmod(n, parts)
    # Larger first so that system 0 / microbatch 0 is always the biggest: the
    # first one to run is then the one that sets peak memory.
    return (q + 1,) * r + (q,) * (parts - r)


def per_system_batch_sizes(gbs: int, num_csx: int) -> tuple[int, ...]:
    """Batch size of each system: balanced, summing to ``gbs``, larger first.

    >>> per_system_batch_sizes(10, 3)
    (4, 3, 3)
    """
    gbs = _check_int("gbs", gbs, 1)
    num_csx = _check_int("num_csx", num_csx, 1)
    if gbs < num_csx:
        raise PlanError(
            f"gbs={gbs} is smaller than num_csx={num_csx}: each system needs at "
            f"least one sample; use gbs >= {num_csx} or num_csx <= {gbs}"
        )
    return split_evenly(gbs, num_csx)


def supported_mbs(pbs: int) -> tuple[int, ...]:
    """Every MBS that gives a distinct microbatch count: ``{ceil(pbs/k) : k=1..pbs}``.

    Sorted ascending.  Runs in O(sqrt(pbs)).

    >>> supported_mbs(10)  # k = 1, 2, 3, 4, 5..9, 10
    (1, 2, 3, 4, 5, 10)
    """
    pbs = _check_int("pbs", pbs, 1)
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
    mbs = _check_int("mbs", mbs)
    if not supported:
        raise PlanError("closest_supported needs at least one supported value")
    return min(supported, key=lambda s: (abs(s - mbs), s))


def _nearby(value: int, supported: tuple[int, ...], count: int = 2) -> tuple[int, ...]:
    """Up to ``count`` supported values on each side of ``value`` (for messages)."""
    below = [s for s in supported if s < value][-count:]
    above = [s for s in supported if s >= value][:count]
    return tuple(below + above)


# --------------------------------------------------------------------------- #
# The user's request
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class MbsPolicy:
    """A parsed ``mbs`` argument.

    ``mode`` is ``"auto"``, ``"explore"``, ``"none"`` or ``"int"``; ``value`` is set
    for ``"int"``; ``explore_min`` / ``explore_max`` bound an explore range (``None``
    means unbounded on that side).

    >>> parse_mbs({"explore": {"min": 2}})
    MbsPolicy(mode='explore', value=None, explore_min=2, explore_max=None)
    """

    mode: str
    value: int | None = None
    explore_min: int | None = None
    explore_max: int | None = None
    #: what the user wrote, for messages (``mbs='explore'``); not part of the policy
    request: Any = field(default=None, compare=False, repr=False)


def parse_mbs(mbs: object) -> MbsPolicy:
    """Parse the user's ``mbs``: a positive int, ``"auto"``, ``"explore"``,
    ``"none"``, or ``{"explore": {"min": a, "max": b}}``.

    >>> parse_mbs(8)
    MbsPolicy(mode='int', value=8, explore_min=None, explore_max=None)
    >>> parse_mbs("none").mode
    'none'

    ``compile()`` parses once and hands the policy on; a policy parses to itself.
    """
    if isinstance(mbs, MbsPolicy):
        return mbs
    return replace(_parse(mbs), request=mbs)


def _parse(mbs: object) -> MbsPolicy:
    if _is_int(mbs):
        value = int(mbs)  # type: ignore[call-overload]
        if value < 1:
            raise PlanError(
                f"mbs must be a positive int, got {value}; use an int >= 1, "
                f"or one of {', '.join(repr(m) for m in _MODES)}"
            )
        return MbsPolicy("int", value)
    if isinstance(mbs, str):
        if mbs in _MODES:
            return MbsPolicy(mbs)
        hint = f" (did you mean {mbs.lower()!r}?)" if mbs.lower() in _MODES else ""
        raise PlanError(
            f"unknown mbs {mbs!r}{hint}; valid strings are "
            f"{', '.join(repr(m) for m in _MODES)}, or pass a positive int or "
            f"{_EXPLORE_FORM}"
        )
    if isinstance(mbs, Mapping):
        return _parse_explore_mapping(mbs)
    raise ArgumentTypeError(
        f"mbs must be a positive int, 'auto', 'explore', 'none' or "
        f"{_EXPLORE_FORM}; got {mbs!r} of type {type(mbs).__name__}"
    )


def _parse_explore_mapping(mbs: Mapping[Any, Any]) -> MbsPolicy:
    def bad(what: str) -> PlanError:
        return PlanError(f"malformed mbs {mbs!r}: {what}; the valid form is {_EXPLORE_FORM}")

    if set(mbs) != {"explore"}:
        raise bad(f"expected the single key 'explore', got keys {sorted(map(repr, mbs))}")
    bounds = mbs["explore"]
    if not isinstance(bounds, Mapping):
        raise bad(f"mbs['explore'] must be a mapping, got {type(bounds).__name__}")
    unknown = set(bounds) - {"min", "max"}
    if unknown:
        raise bad(f"unknown key(s) {sorted(map(repr, unknown))} in mbs['explore']")
    parsed: dict[str, int | None] = {}
    for key in ("min", "max"):
        value = bounds.get(key)
        if value is None:
            parsed[key] = None
        elif not _is_int(value):
            raise bad(f"{key} must be an int, got {value!r} of type {type(value).__name__}")
        elif value < 1:
            raise bad(f"{key} must be at least 1, got {value}")
        else:
            parsed[key] = int(value)
    lo, hi = parsed["min"], parsed["max"]
    if lo is not None and hi is not None and lo > hi:
        raise bad(f"min {lo} is larger than max {hi}")
    return MbsPolicy("explore", explore_min=lo, explore_max=hi)


def _requested_form(mbs: object) -> int | str:
    # Plans are frozen and hashable, and a dict is neither; its repr prints the same.
    if _is_int(mbs):
        return int(mbs)  # type: ignore[call-overload]
    return mbs if isinstance(mbs, str) else repr(mbs)


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
        sizes = _format_sizes(self.per_system_batch_sizes)
        systems = "system" if self.num_csx == 1 else "systems"
        lines = [
            f"MicrobatchPlan: gbs {self.gbs} over {self.num_csx} {systems}",
            f"  per-system batch sizes: {sizes} (pbs {self.pbs})",
            f"  mbs: requested {self.requested_mbs}, effective {self.mbs}",
            f"  microbatches per system: {self.num_microbatches}",
        ]
        # systems with the same schedule share a line: a 64-system plan has two or three
        for first, last, mb in _same_runs(self.microbatch_sizes):
            empty = mb.count(0)
            note = f" ({empty} empty, skipped)" if empty else ""
            which = f"system {first}" if first == last else f"systems {first}-{last}"
            lines.append(f"    {which}: {_format_sizes(mb)}{note}")
        if self.tokens_per_sample is not None:
            t = self.tokens_per_sample
            per_system = _format_sizes(tuple(n * t for n in self.per_system_batch_sizes))
            lines.append(f"  tokens ({t} per sample): global {self.gbs * t}, per system "
                         f"{per_system}, per microbatch at most {self.max_microbatch_size * t}")
        if self.recompute:
            lines.append("  recompute: activation checkpointing per block")
        if self.reshard_after_forward is not None:
            lines.append(f"  fsdp: {describe_fsdp(self)}")
        lines.append(f"  reason: {self.reason}")
        if self.warnings:
            lines.append("  warnings:")
            lines.extend(f"    - {w}" for w in self.warnings)
        else:
            lines.append("  warnings: none")
        return "\n".join(lines)


def describe_fsdp(plan: MicrobatchPlan) -> str:
    """What the plan's FSDP2 settings (``reshard_after_forward``, ``gradient_sync``) mean
    for a sharded step."""
    if plan.reshard_after_forward:
        text = ("reshard_after_forward=True (each unit resharded after its forward and "
                "gathered again for its backward: one unit gathered at a time)")
    else:
        text = ("reshard_after_forward=False (each unit kept gathered from its forward to its "
                "backward: half the all-gathers, every unit gathered at the peak)")
    if plan.gradient_sync == "microbatch":
        text += ("; gradient_sync='microbatch' (gradients reduce-scattered in every "
                 "microbatch's backward: they accumulate as shards)")
    elif plan.gradient_sync == "step":
        text += ("; gradient_sync='step' (gradients reduce-scattered once, in the step's "
                 "last backward: held unsharded until then)")
    return text


def _format_sizes(sizes: tuple[int, ...], limit: int = 8) -> str:
    # A plan can have a million microbatches (or systems); run-length form keeps the
    # printout one line.  Sizes within a system (or across systems) take at most two values.
    if len(sizes) <= limit:
        return ", ".join(map(str, sizes))
    return " + ".join(f"{last - first + 1} x {size}" for first, last, size in _same_runs(sizes))


def _same_runs(values: Sequence[T]) -> list[tuple[int, int, T]]:
    """``(first, last, value)`` for each run of equal consecutive ``values``."""
    runs: list[tuple[int, int, T]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][2] == v:
            runs[-1] = (runs[-1][0], i, v)
        else:
            runs.append((i, i, v))
    return runs


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
    if not _is_int(mbs) or int(mbs) not in candidates:
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
    policy = parse_mbs(mbs)
    system_sizes = per_system_batch_sizes(gbs, num_csx)
    gbs, num_csx = int(gbs), int(num_csx)  # type: ignore[call-overload]
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
                f"mbs={_requested_form(mbs)!r} needs the cost model to compare MBS "
                f"values, and no explorer was given; run it through compile_only "
                f"(which reports the best mbs to pin), or pass mbs='auto' or an int"
            )
        effective, reason = _call_chooser("explorer", explorer, pbs, candidates)

    num_microbatches = -(-pbs // effective)
    # Every system runs the same count (lock step for the all-reduce); smaller
    # systems spread their fewer samples over it, possibly leaving empties.
    microbatch_sizes = tuple(split_evenly(size, num_microbatches) for size in system_sizes)
    return MicrobatchPlan(
        gbs=gbs,
        num_csx=num_csx,
        per_system_batch_sizes=system_sizes,
        requested_mbs=_requested_form(policy.request),
        mbs=effective,
        num_microbatches=num_microbatches,
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
