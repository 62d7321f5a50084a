"""Each call's split, from its length: microbatches cut by tokens, chosen in microseconds.

>>> split = auto_split(lengths, system, sizes=(4, 3), example_mbs=2, example_length=32, ...)
>>> split.mbs_at(16), split.mbs_at(64)      # short rows: fewer, larger microbatches
(4, 1)

A step whose sequence length is symbolic runs at every length, and what fits the memory
budget depends on it: a batch padded to 16 runs in fewer microbatches than one padded to
64, as fairseq's ``max_tokens`` cuts batches. Two policies follow the length:

- ``mbs="auto"``: the largest MBS whose modelled peak at the call's length fits the
  system (``length_cost.py``'s model, exact at every length it was checked at). Every
  MBS's longest fitting length is found once, at compile time (``limits``), so a call
  costs a comparison per supported MBS. Where memory did not bind at the example's length
  (auto chose its MBS for time), that MBS stays the largest: longer rows get fewer
  samples where memory needs it, shorter ones keep the example's split.
- ``mbs={"tokens": n}``: the most samples whose tokens fit ``n`` (``tokens_mbs``).

Both are exact: the step's arithmetic does not depend on the split. An int MBS keeps its
meaning (samples per microbatch) and does not follow the length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mbcompile.errors import DoesNotFitError, PlanError
from mbcompile.planning.bisection import first_true
from mbcompile.planning.cost import format_bytes
from mbcompile.planning.mbs_policy import tokens_mbs
from mbcompile.planning.plan import num_microbatches

__all__ = ["LengthSplit", "auto_split", "tokens_split"]

#: Lengths beyond this many steps count as "any length" (a limit of None).
_LONGEST = 1 << 20


@dataclass(frozen=True)
class LengthSplit:
    """How a call's MBS follows its length (``mode`` ``"auto"`` or ``"tokens"``), or why it
    does not (``mode`` ``"fixed"``, ``note``: the example's plan at every length).

    ``length`` is the sequence length a call is measured by: the first symbolic dim's
    size (``"auto"``; ``example_length`` at the example), or the token ids' length
    (``"tokens"``).
    """

    mode: str
    pbs: int
    supported: tuple[int, ...]
    example_mbs: int
    example_length: int
    note: str = ""
    #: auto: per supported MBS, the longest length its modelled peak fits (None: any;
    #: below ``shortest``: none)
    limits: tuple[tuple[int, int | None], ...] = ()
    #: auto: the example's MBS where memory did not bind there (auto chose it for time),
    #: the largest any length runs (None: memory bound)
    cap: int | None = None
    #: tokens: the user's budget, tokens per microbatch
    budget: int | None = None
    shortest: int = 1
    #: auto: the modelled peak of a (length, mbs) for messages and the report
    peak: Callable[[int, int], float] | None = field(default=None, compare=False, repr=False)
    capacity: float = 0.0
    system: str = ""
    #: auto: the plans checkpoint each block (the example's choice, kept at every length)
    recompute: bool = False
    _chosen: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def follows(self) -> bool:
        """Whether calls of other lengths run other splits."""
        return self.mode != "fixed"

    def mbs_at(self, length: int) -> int:
        """The MBS of a call of ``length`` (cached per length: microseconds)."""
        chosen = self._chosen.get(length)
        if chosen is None:
            chosen = self._choose(length)
            if len(self._chosen) > 4096:
                self._chosen.clear()
            self._chosen[length] = chosen
        return chosen

    def _choose(self, length: int) -> int:
        if self.mode == "fixed":
            return self.example_mbs
        if self.mode == "tokens":
            assert self.budget is not None
            return tokens_mbs(self.budget, length, self.pbs)
        fitting = [m for m, top in self.limits if top is None or length <= top]
        if not fitting:
            raise self._too_long(length)
        within = [m for m in fitting if self.cap is None or m <= self.cap]
        return max(within) if within else min(fitting)

    def _too_long(self, length: int) -> DoesNotFitError:
        smallest = self.supported[0]
        needed = self.peak(length, smallest) if self.peak is not None else 0.0
        top = self.limits[0][1] if self.limits else None
        return DoesNotFitError(
            f"a call of length {length} does not fit {self.system} at any MBS: even mbs "
            f"{smallest} needs {format_bytes(needed)} of {format_bytes(self.capacity)} (modelled); "
            f"nothing ran. Lengths up to {top} fit: cut the samples shorter (the tokenizer's "
            "max_length=, truncation=True), compile for a system with more memory"
            + ("" if self.recompute else ", or with recompute=True"),
            mbs=smallest, needed=needed, available=self.capacity)

    def rows(self) -> list[tuple[int, int | None, int, int]]:
        """``(shortest, longest, mbs, microbatches per system)`` for each range of lengths
        that runs one split (longest None: and longer), shortest first: the report's table."""
        marks = {self.shortest}
        for m in self.supported:
            if self.mode == "tokens" and self.budget is not None:
                marks |= {self.budget // m, self.budget // m + 1}
        for _, top in self.limits:
            if top is not None:
                marks |= {top, top + 1}
        out: list[tuple[int, int | None, int, int]] = []
        for length in sorted(x for x in marks if x >= self.shortest):
            try:
                mbs = self._choose(length)
            except (DoesNotFitError, PlanError):
                break
            if out and out[-1][2] == mbs:
                continue
            if out:
                out[-1] = (out[-1][0], length - 1, out[-1][2], out[-1][3])
            out.append((length, None, mbs, num_microbatches(self.pbs, mbs)))
        if out and self.mode != "fixed":
            last = max(marks)
            try:
                self._choose(last + 1)
            except (DoesNotFitError, PlanError):  # no split runs past the last range
                top = next((t for _, t in self.limits if t is not None), None) \
                    if self.mode == "auto" else self.budget
                out[-1] = (out[-1][0], top, out[-1][2], out[-1][3])
        return out

    def describe(self) -> list[str]:
        """The report's lines: how the split varies with the length."""
        if self.mode == "fixed":
            return [f"split by length: the example's plan (mbs {self.example_mbs}) at every "
                    f"length: {self.note}"]
        what = (f"mbs='auto': the largest MBS whose modelled peak at the call's length fits "
                f"{self.system} ({format_bytes(self.capacity)})"
                + (", each block checkpointed" if self.recompute else "")
                + (f", at most the example's mbs {self.cap} (chosen for time at length "
                   f"{self.example_length})" if self.cap is not None else "")
                if self.mode == "auto" else
                f"mbs={{'tokens': {self.budget}}}: the most samples whose tokens fit the budget")
        lines = [f"split by length (each call's own, {what}):"]
        if self.note:
            lines.append(f"  memory over lengths: {self.note}")
        for low, high, mbs, k in self.rows():
            span = f"{low}-{high}" if high is not None else f"{low} and longer"
            lines.append(f"  length {span}: mbs {mbs}, {k} microbatch{'es' if k != 1 else ''} "
                         "per system")
        return lines


def auto_split(fits: Callable[[int, int], bool], peak: Callable[[int, int], float], *,
               supported: Sequence[int], pbs: int, example_mbs: int, example_length: int,
               shortest: int, longest: int | None, capacity: float, system: str,
               note: str = "", recompute: bool = False) -> LengthSplit:
    """``mbs="auto"``'s split at every length: each supported MBS's longest length that
    ``fits(length, mbs)`` (a doubling search, then bisection: memory grows with the
    length), found once. ``shortest`` / ``longest``: the lengths the symbolic dims allow.

    >>> auto_split(lambda n, m: m * n <= 64, lambda n, m: m * n, supported=(1, 2, 4),
    ...            pbs=4, example_mbs=2, example_length=32, shortest=2, longest=None,
    ...            capacity=64, system="toy").mbs_at(16)
    4
    """
    limits = []
    for m in supported:
        limits.append((m, _longest_fitting(lambda n, m=m: fits(n, m), shortest, longest)))
    larger = [m for m in supported if m > example_mbs]
    bound = bool(larger) and not fits(example_length, larger[0])
    return LengthSplit("auto", pbs, tuple(supported), example_mbs, example_length,
                       note=note, limits=tuple(limits),
                       cap=None if bound or example_mbs >= max(supported) else example_mbs,
                       shortest=shortest, peak=peak, capacity=capacity, system=system,
                       recompute=recompute)


def tokens_split(budget: int, *, supported: Sequence[int], pbs: int, example_mbs: int,
                 example_length: int) -> LengthSplit:
    """A token budget's split at every length (``tokens_mbs``)."""
    return LengthSplit("tokens", pbs, tuple(supported), example_mbs, example_length,
                       budget=budget)


def _longest_fitting(fits: Callable[[int], bool], shortest: int, longest: int | None
                     ) -> int | None:
    """The longest length in ``[shortest, longest]`` that fits (``shortest - 1``: none;
    None: every length up to ``_LONGEST``), for ``fits`` monotone (true, then false)."""
    if not fits(shortest):
        return shortest - 1
    top = _LONGEST if longest is None else longest
    if fits(top):
        return None if longest is None else longest
    low, high, step = shortest, shortest + 1, 1
    while high < top and fits(high):  # doubling: the step's memory grows with the length
        low, step = high, step * 2
        high = min(top, low + step)
    # fits(low), not fits(high): the last that fits is just before the first that doesn't
    return first_true(lambda n: not fits(n), low, high) - 1
