"""The MBS search: ``"auto"`` and ``"explore"`` on the cost model, and the memory checks.

>>> choice = select_plan((32, 32), parse_mbs("auto"), cost, get_system("host"))
>>> choice.plan.mbs, choice.estimate.memory.peak

What a search evaluated and chose is ``exploration.py``'s (``Candidate``,
``Exploration``, ``Choice``); real timing is ``measure.py``'s; the memory errors' text
and fixes are ``fixes.py``'s.

Everything here works on a :class:`~mbcompile.planning.cost.CostModel` and a
:class:`~mbcompile.planning.systems.SystemSpec`.  ``compile()``'s selection stage
(``mbcompile/selection.py``) builds the cost model and calls :func:`select_sharded`
(:func:`select_plan`, and a sharded model's FSDP2 settings), which chooses among the
values the request allows (``MbsChoices``: ``"auto"`` or ``"explore"``), hands the
choice to ``MbsChoices.plan`` and then checks that the plan fits.

``"auto"`` evaluates a few candidates only, O(log n) of the n supported values
(each evaluation is arithmetic on the cost model's fit, so "few" is about an
answer one can follow, not about speed):

1. the supported MBS values whose modelled peak fits: a binary search for the
   largest (memory grows with the MBS while there are several microbatches), and
   the whole per-system batch apart (one microbatch makes its gradients only while
   its activations are freed: it may fit where a smaller MBS does not);
2. the fastest of the fitting values, by golden-section search: modelled step
   time falls while the fixed costs (per microbatch, per kernel, re-reading the
   weights) are shared by more samples, and may rise again once a microbatch's
   tensors outgrow the cache, so it is unimodal in the MBS;
3. the smallest MBS whose modelled step time is within ``AUTO_TIME_TOLERANCE``
   (2%) of the fastest, by bisection: when a larger microbatch buys almost
   nothing, memory headroom is worth more (the model ignores allocator
   fragmentation, and the user may grow the model next);
4. with ``measure=True``, the fitting values modelled within 10% of the fastest are
   timed on this host, the fastest measured taken (``tie_break.py``);
5. the answer, and why, goes into ``plan.reason``.

Its choice is thus within 2% of the fastest value ``"explore"`` finds whenever
the curve is unimodal; ``tests/test_explore.py`` checks it on a suite of
configurations.

``"explore"`` evaluates every supported MBS in the range, needs
``compile_only=True`` (explore once, pin the value, compile again), and
reports a table and a plot.  With ``measure=True`` both also time real
forward+backward passes on the model's device for every evaluated candidate
(each microbatch size, best of a few repetitions) and report the microbatch
loop they add up to beside the modelled one; only ``"auto"``'s tie-break (step 4)
lets that timing choose, and without ``measure`` the plan never depends on it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from mbcompile.errors import CostModelError, CostModelWarning, DoesNotFitError
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.bisection import first_true
from mbcompile.planning.cost import CostModel, Estimate, format_bytes, format_seconds
from mbcompile.planning.exploration import Candidate, Choice, Exploration
from mbcompile.planning.fixes import (
    describe_capacity,
    describe_memory,
    optimizer_source,
    step_fixes,
)
from mbcompile.planning.plan import (
    MbsChoices,
    MbsPolicy,
    check_policy,
    split_evenly,
)
from mbcompile.planning.progress import progress_bar
from mbcompile.planning.systems import SystemSpec
from mbcompile.planning.tie_break import AUTO_TIE_TOLERANCE, measured_tie

__all__ = ["AUTO_TIME_TOLERANCE", "SYNCS", "Selector", "select_plan", "select_sharded"]

#: ``"auto"`` takes the smallest MBS whose modelled step time is within this
#: fraction of the best it evaluated.
AUTO_TIME_TOLERANCE = 0.02
_INV_PHI = (5**0.5 - 1) / 2
class Selector:
    """Evaluates candidate MBS values of one (model, per-system batch sizes, system).

    ``auto`` and ``explore`` have :data:`mbcompile.planning.plan.AutoChooser`'s signature
    (``make_plan(chooser=..., explorer=...)`` asks them too). ``sizes`` are the per-system
    batch sizes, split once (``Request.per_system_batch_sizes``), and ``counts`` each
    supported MBS's microbatches per system (``MbsChoices.counts``; default: counted here).
    """

    def __init__(self, cost: CostModel, spec: SystemSpec, sizes: tuple[int, ...], *,
                 counts: Mapping[int, int] | None = None,
                 timer: Callable[[int], float] | None = None,
                 progress: bool | None = None) -> None:
        self.cost = cost
        self.spec = spec
        self.sizes, self.pbs = sizes, sizes[0]
        self.counts = counts if counts is not None else check_policy(
            sizes, MbsPolicy("auto"), True).counts
        self.gbs, self.num_csx = sum(sizes), len(sizes)
        self.timer = timer
        self.progress = progress
        self._seen: dict[int, Candidate] = {}
        self._estimates: dict[int, Estimate] = {}
        self.exploration: Exploration | None = None
        self._start = time.perf_counter()

    # ---------------------------------------------------------- evaluating
    def estimate(self, mbs: int) -> Estimate:
        if mbs not in self._estimates:
            self._estimates[mbs] = self.cost.estimate_split(self.sizes, mbs, self.counts[mbs],
                                                            self.spec)
        return self._estimates[mbs]

    def _measured_loop(self, mbs: int) -> float | None:
        """The largest system's microbatches, each size timed on this host."""
        if self.timer is None:
            return None
        sizes = split_evenly(self.pbs, self.counts[mbs])
        return sum(sizes.count(size) * self.timer(size) for size in set(sizes) if size > 0)

    def evaluate(self, mbs: int) -> Candidate:
        if mbs not in self._seen:
            e = self.estimate(mbs)
            self._seen[mbs] = Candidate(
                mbs=mbs, num_microbatches=e.num_microbatches, step_s=e.time.step,
                peak_bytes=e.memory.peak, fits=e.memory.fits, bound=e.time.bound,
                samples_per_s=e.time.samples_per_second,
                loop_s=e.time.compute + e.time.overhead + e.time.accumulate,
                measured_loop_s=self._measured_loop(mbs))
        return self._seen[mbs]

    def _evaluate_all(self, values: Sequence[int], what: str) -> list[Candidate]:
        slow = self.timer is not None or not self.cost.fitted
        out = []
        with progress_bar(len(values), self.progress if (slow or self.progress) else False) as bar:
            task = bar.add_task(what, total=len(values))
            for m in values:
                out.append(self.evaluate(m))
                bar.advance(task)
        return out

    def largest_fitting(self, candidates: Sequence[int]) -> int | None:
        """Binary search: the largest candidate whose modelled peak fits (None if none)."""
        if self.evaluate(candidates[-1]).fits:  # the common case on a large system
            return candidates[-1]
        if not self.evaluate(candidates[0]).fits:
            return None
        # the first index that does not fit, from (0, len]: the end stands for "none",
        # never asked, so the midpoints (the evaluations recorded) are a plain bisection's
        first_over = first_true(lambda i: not self.evaluate(candidates[i]).fits,
                                0, len(candidates))
        return candidates[first_over - 1]

    def fitting(self, candidates: Sequence[int]) -> list[int]:
        """The candidates whose modelled peak fits. Memory grows with the MBS while a
        system runs several microbatches (``largest_fitting`` bisects them); one
        microbatch of the whole batch is apart, as its gradients are made only while its
        activations are freed, so it may fit where a smaller MBS does not."""
        rest, whole = list(candidates), []
        if len(rest) > 1 and rest[-1] == self.pbs:
            rest, whole = rest[:-1], [self.pbs] if self.evaluate(self.pbs).fits else []
        top = self.largest_fitting(rest)
        return [m for m in rest if top is not None and m <= top] + whole

    def _record(self, mode: str, supported: int, best: int | None) -> None:
        self.exploration = Exploration(
            mode=mode, system=self.spec.name, gbs=self.gbs, num_csx=self.num_csx, pbs=self.pbs,
            candidates=tuple(self._seen[m] for m in sorted(self._seen)), supported=supported,
            best=best, seconds=time.perf_counter() - self._start,
            capacity=self.spec.usable_bytes, fit_note=self.cost.fit_note,
            measured=self.timer is not None)

    # ------------------------------------------------------------- choosers
    def _fastest(self, values: Sequence[int]) -> Candidate:
        """Golden-section search for the fastest of ``values``, assuming step time is
        unimodal in the MBS: it falls while fixed costs are shared by more samples
        and may rise again once a microbatch outgrows a cache.  O(log n) evaluations.
        """
        def t(i: int) -> float:
            return self.evaluate(values[i]).step_s

        lo, hi = 0, len(values) - 1
        while hi - lo > 3:
            c = hi - round((hi - lo) * _INV_PHI)
            d = lo + round((hi - lo) * _INV_PHI)
            if c >= d:
                c, d = (lo + hi) // 2, (lo + hi) // 2 + 1
            if t(c) <= t(d):
                hi = d
            else:
                lo = c
        for i in range(lo, hi + 1):
            t(i)
        return min((self._seen[m] for m in values if m in self._seen),
                   key=lambda c: (c.step_s, c.mbs))

    def auto(self, pbs: int, candidates: tuple[int, ...]) -> tuple[int, str]:
        """The ``"auto"`` chooser (see the module docstring)."""
        fitting = self.fitting(candidates)
        if not fitting:
            raise self.does_not_fit(candidates[0], "auto")
        top = fitting[-1]
        best = self._fastest(fitting)
        limit = best.step_s * (1 + AUTO_TIME_TOLERANCE)
        # The smallest MBS within the tolerance: bisect between the largest evaluated
        # value that is too slow and the smallest that is fast enough (time falls
        # towards the fastest, so the boundary is unique there).
        upto = fitting[:fitting.index(best.mbs) + 1]
        seen = [i for i, m in enumerate(upto) if m in self._seen]
        hi = min(i for i in seen if self._seen[upto[i]].step_s <= limit)
        lo = max((i for i in seen if i < hi and self._seen[upto[i]].step_s > limit),
                 default=-1)
        hi = first_true(lambda i: self.evaluate(upto[i]).step_s <= limit, lo, hi)
        chosen = self._seen[upto[hi]]
        timed = measured_tie(self, fitting, best)
        if timed is not None:
            chosen = timed
        self._record("auto", len(candidates), chosen.mbs)
        e = self.estimate(chosen.mbs)
        top_c = self._seen[top]
        why = (f"auto on {self.spec.name}: the largest MBS that fits is {top} (modelled peak "
               f"{format_bytes(top_c.peak_bytes)} of {format_bytes(self.spec.usable_bytes)}); "
               f"the fastest that fits is {best.mbs} (modelled step "
               f"{format_seconds(best.step_s)})")
        if timed is not None:
            why += (f"; measured on this host among those within {AUTO_TIE_TOLERANCE:.0%} of "
                    f"it, mbs={chosen.mbs} was fastest")
        elif chosen.mbs != best.mbs:
            why += (f"; mbs={chosen.mbs} is the smallest within {AUTO_TIME_TOLERANCE:.0%} of it "
                    f"({format_seconds(chosen.step_s)}) and leaves "
                    f"{format_bytes(e.memory.headroom)} free")
        else:
            why += f"; nothing smaller is within {AUTO_TIME_TOLERANCE:.0%} of it"
        why += f"; evaluated {len(self._seen)} of {len(candidates)} supported values"
        return chosen.mbs, why

    def explore(self, pbs: int, candidates: tuple[int, ...]) -> tuple[int, str]:
        """The ``"explore"`` explorer: every candidate, the fastest that fits."""
        rows = self._evaluate_all(candidates, f"exploring {len(candidates)} MBS values")
        fitting = [c for c in rows if c.fits]
        if not fitting:
            smallest = self.evaluate(candidates[0])
            self._record("explore", len(self.counts), None)
            raise self.does_not_fit(smallest.mbs, "explore")
        best = min(fitting, key=lambda c: (c.step_s, c.peak_bytes))
        self._record("explore", len(self.counts), best.mbs)
        why = (f"explore on {self.spec.name}: evaluated all {len(candidates)} supported MBS "
               f"values in [{candidates[0]}, {candidates[-1]}]; the fastest that fits is "
               f"mbs={best.mbs} (modelled step {format_seconds(best.step_s)}, peak "
               f"{format_bytes(best.peak_bytes)} of {format_bytes(self.spec.usable_bytes)}); "
               f"pin it with mbs={best.mbs}")
        measured = self.exploration.measured_best if self.exploration else None
        if measured is not None and measured != best.mbs:
            why += f" (measured on this host, mbs={measured} was fastest)"
        return best.mbs, why

    # --------------------------------------------------------------- errors
    def does_not_fit(self, mbs: int, mode: str) -> DoesNotFitError:
        e = self.estimate(mbs)
        m = e.memory
        pbs = self.pbs
        if mbs == 1:
            what = "even mbs=1 does not fit"
        elif mode == "explore":
            what = f"no MBS in the explore range fits (not even the smallest, mbs={mbs})"
        elif mode == "none":
            what = f"mbs='none' (one microbatch of the whole per-system batch, {pbs}) " \
                   "does not fit"
        else:
            what = f"mbs={mbs} does not fit"
        smaller = self.largest_fitting([m for m in self.counts if m <= mbs]) if mbs > 1 \
            else None
        fixes = step_fixes(self.cost, self.spec, self.sizes, smaller)
        message = (f"{what} on system {self.spec.name!r} (gbs {self.gbs} over {self.num_csx} "
                   f"system{'s' if self.num_csx != 1 else ''}, pbs {pbs}): it needs "
                   f"{format_bytes(m.peak)} but the system has "
                   f"{describe_capacity(self.spec)}\n"
                   f"  {describe_memory(m)}\n"
                   f"  optimizer state: {optimizer_source(self.spec)}\n"
                   f"  fix: " + "; or ".join(dict.fromkeys(fixes)))
        return DoesNotFitError(message, mbs=mbs, needed=m.peak, available=m.capacity,
                               fixes=tuple(fixes))


def select_plan(sizes: tuple[int, ...], policy: MbsPolicy, cost: CostModel | None,
                spec: SystemSpec, *, timer: Callable[[int], float] | None = None,
                progress: bool | None = None, cost_error: str | None = None,
                unsplit: bool = False, choices: MbsChoices | None = None,
                compile_only: bool = False) -> Choice:
    """Plan per-system batches of ``sizes`` (``Request.per_system_batch_sizes``) with
    ``policy`` and the cost model, and check that it fits. ``choices``: what the policy
    leaves to choose at ``sizes`` (``Request.choices``; default: worked out here).

    ``cost=None`` (``cost_error`` says why), or a deferred model whose build fails on its
    first question (``CostModel.build_error``): ints and ``"none"`` are planned as asked,
    ``"auto"`` falls back to the plan's default with a :class:`CostModelWarning` (a
    ``compile_only`` answer is never an MBS unchecked against memory: it raises
    :class:`CostModelError`), ``"explore"`` fails.  Otherwise every mode
    raises :class:`DoesNotFitError` with the numbers when even MBS 1 does not fit,
    and ints and ``"none"`` when their MBS does not fit.  ``unsplit``: the request
    runs the whole per-system batch as one microbatch (the analysis's ``"unsplit"``
    mode), so only that size is checked.
    """
    if cost is not None:
        try:
            return _checked(sizes, policy, cost, spec, timer, progress, unsplit, choices)
        except CostModelError:
            if cost.build_error is None:  # the model was built: a later question failed
                raise
            cost_error = cost.build_error
    return _unchecked(choices or check_policy(sizes, policy, True), policy, spec, cost_error,
                      compile_only)


def _unchecked(choices: MbsChoices, policy: MbsPolicy, spec: SystemSpec,
               cost_error: str | None, compile_only: bool) -> Choice:
    """The plan without a cost model (``select_plan``'s ``cost=None``)."""
    if policy.mode == "auto" and compile_only:  # read as an answer: nothing says it fits
        raise CostModelError(
            f"compile_only=True with mbs='auto' needs the cost model to check an MBS against "
            f"{spec.name}'s memory, and it could not run: {cost_error}")
    if policy.mode == "explore":
        raise CostModelError(f"mbs={policy.request!r} needs the cost model, which failed: "
                             f"{cost_error}")
    if policy.mode == "auto":
        warnings.warn(f"the cost model could not run ({cost_error}); mbs='auto' uses the "
                      "default of about 4 microbatches per system, unchecked against "
                      "memory. Pass an int mbs to silence this.", CostModelWarning,
                      stacklevel=user_stacklevel())
    plan = choices.plan()
    if policy.mode == "auto":
        plan = replace(plan, reason=f"{plan.reason} (cost model unavailable: {cost_error})")
    return Choice(plan, None, None, None, cost_error)


def _checked(sizes: tuple[int, ...], policy: MbsPolicy, cost: CostModel, spec: SystemSpec,
             timer: Callable[[int], float] | None, progress: bool | None, unsplit: bool,
             choices: MbsChoices | None) -> Choice:
    """The plan chosen and checked with the cost model (``select_plan``)."""
    choices = choices if choices is not None else check_policy(sizes, policy, True)
    selector = Selector(cost, spec, sizes, counts=choices.counts, timer=timer,
                        progress=progress)
    pinned = choices.pinned is not None  # its size alone is probed, unless it fails
    if not (unsplit or pinned) and not selector.evaluate(1).fits:  # nothing runs
        raise selector.does_not_fit(1, policy.mode)
    choose = None if pinned else selector.auto if policy.mode == "auto" else selector.explore
    chosen = choose(selector.pbs, choices.allowed) if choose is not None else None
    plan = choices.plan(chosen)  # the choice handed on
    if not selector.evaluate(plan.mbs).fits:
        if pinned and not unsplit and plan.mbs > 1 and not selector.evaluate(1).fits:
            raise selector.does_not_fit(1, policy.mode)  # whatever was asked, nothing runs
        raise selector.does_not_fit(plan.mbs, policy.mode)
    if selector.exploration is None:  # an int or "none": record what was checked
        selector._record(policy.mode, len(plan.supported_mbs), plan.mbs)
    return Choice(plan, selector.estimate(plan.mbs), selector.exploration, cost)


def select_sharded(sizes: tuple[int, ...], policy: MbsPolicy, cost: CostModel | None,
                   spec: SystemSpec, *, reshard: bool | str = "auto", sync: str = "auto",
                   **kwargs: Any) -> Choice:
    """:func:`select_plan`, and for a model sharded with FSDP2 (``cost.shard``) its
    ``reshard_after_forward`` and ``gradient_sync`` chosen with the MBS.

    ``reshard``: True or False pins the setting; ``sync``: ``"step"`` or ``"microbatch"``
    pins that one; ``"auto"`` plans each value, and the faster plan that fits is kept.
    Keeping units gathered from forward to backward halves their all-gathers but holds
    every unit's parameters at the peak; reduce-scattering gradients once per step
    makes one round of collectives but holds every gradient unsharded while the
    microbatches accumulate, which a large model cannot (a 70B's bf16 gradients are
    140 GB per rank). Either can force a smaller MBS, so the plans are compared whole
    (MBS and settings jointly); on equal time the one with less memory is kept. Without
    a cost model the model runs with the settings it was sharded with (the plan's
    fields stay None here; ``mbcompile/selection.py`` writes in the values the user pinned). Each
    combination is costed by its own copy of the model (``with_shard``), its probes
    shared.
    """
    shard = cost.shard if cost is not None else None
    if shard is None:
        return select_plan(sizes, policy, cost, spec, **kwargs)
    assert cost is not None
    try:  # its copies share one build
        cost.ready()
    except CostModelError:
        if cost.build_error is None:
            raise
        return select_plan(sizes, policy, None, spec, **{**kwargs, "cost_error": cost.build_error})
    reshards = (reshard,) if isinstance(reshard, bool) else (True, False)
    syncs = (sync,) if sync in SYNCS else SYNCS
    # the least memory first: it is the one whose refusal is reported when none fits
    tried: list[tuple[bool, str, Choice | DoesNotFitError]] = []
    for value in reshards:
        for when in reversed(syncs):
            sharded = cost.with_shard(replace(shard, reshard_after_forward=value,
                                              gradient_sync=when))
            try:
                found: Choice | DoesNotFitError = select_plan(sizes, policy, sharded, spec,
                                                              **kwargs)
            except DoesNotFitError as exc:
                found = exc
            tried.append((value, when, found))
    fitting = [(v, w, f) for v, w, f in tried if isinstance(f, Choice)]
    if not fitting:
        raise next(f for _, _, f in tried if isinstance(f, DoesNotFitError))

    def key(entry: tuple[bool, str, Choice]) -> tuple[float, float, bool]:
        e = entry[2].estimate
        assert e is not None
        return (e.time.step, e.memory.peak, entry[1] != "step")  # one microbatch: a tie

    value, when, chosen = min(fitting, key=key)
    plan = replace(chosen.plan, reshard_after_forward=value, gradient_sync=when)
    if len(tried) == 1:
        return replace(chosen, plan=plan)
    return replace(chosen, plan=plan).noted(_fsdp_note(value, when, chosen, tried))


#: FSDP2's gradient reduce-scatter: once per step, or in every microbatch's backward.
SYNCS = ("step", "microbatch")


def _fsdp_note(value: bool, when: str, chosen: Choice,
               tried: list[tuple[bool, str, Choice | DoesNotFitError]]) -> str:
    """Why these FSDP2 settings: the chosen plan's modelled step and peak, then each other
    setting's, or the memory it would need."""
    def settings(v: bool, w: str) -> str:
        return f"reshard_after_forward={v}, gradient_sync={w!r}"

    def figures(found: Choice | DoesNotFitError) -> str:
        if isinstance(found, DoesNotFitError):
            return (f"does not fit (mbs {found.mbs} would need {format_bytes(found.needed)} "
                    f"of {format_bytes(found.available)})")
        e = found.estimate
        assert e is not None
        return (f"{format_seconds(e.time.step)} at mbs {e.mbs} "
                f"(peak {format_bytes(e.memory.peak)})")

    how = "kept gathered from forward to backward" if not value else "resharded after forward"
    sync = ("gradients reduce-scattered in every microbatch" if when == "microbatch"
            else "gradients reduce-scattered once per step")
    others = "; ".join(f"{figures(f)} with {settings(v, w)}" for v, w, f in tried
                       if (v, w) != (value, when))
    return (f"FSDP2 units {how}, {sync} ({settings(value, when)}): modelled step "
            f"{figures(chosen)}, against {others}")


