"""Choosing the MBS: ``"auto"``, ``"explore"``, the memory checks, and measured timing.

Everything here works on a :class:`~mbcompile.planning.cost.CostModel` and a
:class:`~mbcompile.planning.systems.SystemSpec`.  ``compile()`` calls :func:`check_request`
before tracing and :func:`plan_for` after the batch analysis; that builds the
cost model and calls :func:`select_plan`, which hands
:func:`~mbcompile.planning.plan.make_plan` a chooser (``"auto"``) or an explorer
(``"explore"``) and then checks that the plan fits.

``"auto"`` evaluates a few candidates only, O(log n) of the n supported values
(each evaluation is arithmetic on the cost model's fit, so "few" is about an
answer one can follow, not about speed):

1. the largest supported MBS whose modelled peak memory fits: the largest
   value itself, else a binary search (memory grows with the MBS);
2. the fastest of the fitting values, by golden-section search: modelled step
   time falls while the fixed costs (per microbatch, per kernel, re-reading the
   weights) are shared by more samples, and may rise again once a microbatch's
   tensors outgrow the cache, so it is unimodal in the MBS;
3. the smallest MBS whose modelled step time is within ``AUTO_TIME_TOLERANCE``
   (2%) of the fastest, by bisection: when a larger microbatch buys almost
   nothing, memory headroom is worth more (the model ignores allocator
   fragmentation, and the user may grow the model next);
4. the answer, and why, goes into ``plan.reason``.

Its choice is thus within 2% of the fastest value ``"explore"`` finds whenever
the curve is unimodal; ``tests/test_explore.py`` checks it on a suite of
configurations.

``"explore"`` evaluates every supported MBS in the range, needs
``compile_only=True`` (explore once, pin the value, compile again), and
reports a table and a plot.  With ``measure=True`` both also time real
forward+backward passes on the model's device for every evaluated candidate
(each microbatch size, best of a few repetitions) and report the microbatch
loop they add up to beside the modelled one; the plan itself never depends
on timing.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbcompile.errors import ArgumentTypeError, MbcompileError, MbcompileWarning, PlanError
from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.errors import MixingError
from mbcompile.passes.recompute import checkpoint_blocks
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.cost import (
    CostModel,
    CostModelError,
    DoesNotFitError,
    Estimate,
    MemoryEstimate,
    ShardSpec,
    analyse_cost,
    format_bytes,
    format_seconds,
)
from mbcompile.planning.plan import (
    MbsPolicy,
    MicrobatchPlan,
    closest_supported,
    make_plan,
    parse_mbs,
    per_system_batch_sizes,
    supported_mbs,
)
from mbcompile.planning.systems import SystemSpec
from mbcompile.planning.two_phase_cost import (
    COUPLED_SHARE_WARNING,
    TwoPhaseCostModel,
    analyse_two_phase_cost,
    two_phase_reason,
)

__all__ = [
    "AUTO_TIME_TOLERANCE",
    "Candidate",
    "CompileOnlyError",
    "CostModelWarning",
    "Exploration",
    "HostTimer",
    "Selection",
    "Selector",
    "check_request",
    "compile_only_error",
    "describe_memory",
    "measure_peak_bytes",
    "plan_for",
    "select_plan",
    "single_microbatch_request",
]

#: ``"auto"`` takes the smallest MBS whose modelled step time is within this
#: fraction of the best it evaluated.
AUTO_TIME_TOLERANCE = 0.02
_INV_PHI = (5**0.5 - 1) / 2
#: Show a progress bar (on a terminal) when more than this many candidates need
#: real measurement or an exact probe each.
PROGRESS_THRESHOLD = 4


class CompileOnlyError(MbcompileError, RuntimeError):
    """A module compiled with ``compile_only=True`` (or ``mbs="explore"``) was called."""


class CostModelWarning(MbcompileWarning):
    """The cost model could not run; the plan was made without it."""


# --------------------------------------------------------------------------- #
# Results
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Candidate:
    """One MBS as the model (and, with ``measure=True``, the clock) sees it."""

    mbs: int
    num_microbatches: int
    step_s: float
    peak_bytes: float
    fits: bool
    bound: str
    samples_per_s: float
    loop_s: float  # the modelled microbatch loop: step minus all-reduce and optimizer
    measured_loop_s: float | None = None  # the same loop, timed on this host
    recompute: bool = False  # with activation checkpointing per block

    def to_dict(self) -> dict[str, Any]:
        return {"mbs": self.mbs, "num_microbatches": self.num_microbatches,
                "step_s": self.step_s, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "bound": self.bound, "samples_per_s": self.samples_per_s,
                "loop_s": self.loop_s, "measured_loop_s": self.measured_loop_s,
                "recompute": self.recompute}


@dataclass(frozen=True)
class Exploration:
    """The candidates one selection evaluated, and its answer."""

    mode: str  # "auto", "explore", "int", "none"
    system: str
    gbs: int
    num_csx: int
    pbs: int
    candidates: tuple[Candidate, ...]  # sorted by mbs
    supported: int  # how many supported values there were to choose from
    best: int | None  # the chosen / recommended MBS
    seconds: float  # wall time of the selection (probes included)
    capacity: float
    fit_note: str = ""
    measured: bool = False
    best_recompute: bool = False  # the best runs with activation checkpointing

    def candidate(self, mbs: int, recompute: bool = False) -> Candidate:
        for c in self.candidates:
            if c.mbs == mbs and c.recompute == recompute:
                return c
        raise KeyError(mbs)

    @property
    def joint(self) -> bool:
        """Whether candidates with activation checkpointing were evaluated too."""
        return any(c.recompute for c in self.candidates)

    @property
    def measured_best(self) -> int | None:
        timed = [c for c in self.candidates if c.fits and c.measured_loop_s is not None]
        return min(timed, key=lambda c: (c.measured_loop_s, c.mbs)).mbs if timed else None

    def table(self) -> str:
        """A fixed-width table: one row per evaluated MBS."""
        head = f"{'mbs':>6} " + (f"{'recompute':>9} " if self.joint else "") + \
            f"{'micro':>6} {'step (model)':>14} {'samples/s':>11} " \
            f"{'peak memory':>12} {'fits':>5} {'bound':>16}"
        if self.measured:
            head += f" {'loop (model)':>13} {'loop (measured)':>16} {'meas/model':>10}"
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            mark = " *" if (c.mbs, c.recompute) == (self.best, self.best_recompute) else ""
            recompute = (f"{'yes' if c.recompute else 'no':>9} " if self.joint else "")
            row = (f"{c.mbs:>6} {recompute}{c.num_microbatches:>6} {format_seconds(c.step_s):>14} "
                   f"{c.samples_per_s:>11.4g} {format_bytes(c.peak_bytes):>12} "
                   f"{'yes' if c.fits else 'NO':>5} {c.bound:>16}")
            if self.measured:
                row += f" {format_seconds(c.loop_s):>13}"
                if c.measured_loop_s is None:
                    row += f" {'-':>16} {'-':>10}"
                else:
                    row += (f" {format_seconds(c.measured_loop_s):>16} "
                            f"{c.measured_loop_s / c.loop_s:>10.2f}")
            lines.append(row + mark)
        evaluated = (f"{len(self.candidates)} (MBS, recompute) pairs over {self.supported} "
                     "supported values evaluated" if self.joint else
                     f"{len(self.candidates)} of {self.supported} supported values evaluated")
        lines.append(f"(* = {'chosen' if self.mode == 'auto' else 'best'}; {evaluated} "
                     f"in {self.seconds:.2f} s; memory capacity {format_bytes(self.capacity)})")
        return "\n".join(lines)

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Save a PNG of modelled step time and peak memory against the MBS."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        path = Path(path)
        plain = [c for c in self.candidates if not c.recompute]
        ticked = [c for c in self.candidates if c.recompute]
        xs = [c.mbs for c in plain]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.plot(xs, [c.step_s for c in plain], "o-", color="tab:blue",
                label="step time (model)")
        if ticked:
            ax.plot([c.mbs for c in ticked], [c.step_s for c in ticked], "o--",
                    color="tab:purple", label="step time, recompute (model)")
        if self.measured:
            pts = [(c.mbs, c.measured_loop_s, c.loop_s) for c in self.candidates
                   if c.measured_loop_s is not None]
            if pts:
                xs_m, measured, loop = zip(*pts)
                ax.plot(xs_m, loop, "x:", color="tab:blue", label="microbatch loop (model)")
                ax.plot(xs_m, measured, "s--", color="tab:cyan",
                        label="microbatch loop (measured)")
        ax.set_xlabel("micro batch size (MBS)")
        ax.set_ylabel("step time (s)", color="tab:blue")
        ax.set_xscale("log", base=2)
        ax2 = ax.twinx()
        ax2.plot(xs, [c.peak_bytes / 1e9 for c in plain], "^-", color="tab:red",
                 label="peak memory (model)")
        if ticked:
            ax2.plot([c.mbs for c in ticked], [c.peak_bytes / 1e9 for c in ticked], "^--",
                     color="tab:orange", label="peak memory, recompute (model)")
        ax2.axhline(self.capacity / 1e9, color="tab:red", ls=":", label="memory capacity")
        ax2.set_ylabel("peak memory (GB)", color="tab:red")
        if self.best is not None:
            ax.axvline(self.best, color="tab:green", ls="--", label=f"best: mbs {self.best}")
        handles = ax.get_legend_handles_labels()
        handles2 = ax2.get_legend_handles_labels()
        ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper center",
                  fontsize=8)
        ax.set_title(title or f"MBS exploration: gbs {self.gbs} over {self.num_csx} x "
                     f"{self.system}")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "system": self.system, "gbs": self.gbs,
                "num_csx": self.num_csx, "pbs": self.pbs, "supported": self.supported,
                "best": self.best, "measured_best": self.measured_best,
                "seconds": self.seconds, "capacity": self.capacity,
                "fit_note": self.fit_note, "measured": self.measured,
                "best_recompute": self.best_recompute,
                "candidates": [c.to_dict() for c in self.candidates]}


@dataclass(frozen=True)
class Selection:
    """What :func:`select_plan` decided: the plan, its estimate, what it evaluated."""

    plan: MicrobatchPlan
    system: SystemSpec
    estimate: Estimate | None
    exploration: Exploration | None
    cost: CostModel | None = field(repr=False, default=None)
    cost_error: str | None = None


# --------------------------------------------------------------------------- #
# Measuring on the host
# --------------------------------------------------------------------------- #


def _tile(value: Any, dim: int | None, m: int) -> Any:
    """``value`` with ``m`` samples along ``dim``, repeating its samples as needed."""
    if dim is None:
        return value

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        index = torch.arange(m, device=t.device) % t.shape[dim]
        return t.index_select(dim, index)
    return pytree.tree_map(one, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostTimer:
    """Times real forward+backward of one microbatch of ``m`` samples, best of ``reps``.

    Runs ``module`` (the captured graph) on the example inputs tiled to ``m``
    samples and takes gradients with ``torch.autograd.grad``, so the user's
    ``.grad`` slots are never touched.  One warm-up run per size.
    """

    def __init__(self, module: torch.nn.Module, values: Sequence[Any],
                 in_dims: Sequence[int | None], reps: int = 3) -> None:
        self.module = module
        self.values = list(values)
        self.in_dims = list(in_dims)
        self.reps = max(1, int(reps))
        self.params = [p for p in module.parameters() if p.requires_grad]
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._cache: dict[int, float] = {}

    def _once(self, args: Sequence[Any]) -> float:
        from mbcompile.planning.cost import _loss_of

        _sync(self.device)
        start = time.perf_counter()
        out = self.module(*args)
        loss = _loss_of(pytree.tree_leaves(out), None)
        if loss is not None and self.params:
            torch.autograd.grad(loss, self.params, allow_unused=True)
        _sync(self.device)
        return time.perf_counter() - start

    def __call__(self, m: int) -> float:
        if m not in self._cache:
            args = [_tile(v, d, m) for v, d in zip(self.values, self.in_dims)]
            self._once(args)
            self._cache[m] = min(self._once(args) for _ in range(self.reps))
        return self._cache[m]


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    """Peak bytes the allocator handed out while ``fn`` ran, above what was live before.

    CUDA: ``torch.cuda.max_memory_allocated``.  CPU: the allocator's events
    recorded by ``torch.profiler`` with ``profile_memory=True`` (every
    allocation and free, in order), so it is the allocator's own count, not an
    estimate.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        total += e.nbytes()
        peak = max(peak, total)
    return float(peak)


# --------------------------------------------------------------------------- #
# Selecting
# --------------------------------------------------------------------------- #


def _progress(total: int, show: bool | None) -> Any:
    """A rich progress bar on stderr, or a disabled one.

    ``show=None``: only for more than ``PROGRESS_THRESHOLD`` items and on a
    terminal (it then vanishes when done); ``True``: always, and it stays (logs).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    forced = show is True
    if show is None:
        show = total > PROGRESS_THRESHOLD and sys.stderr.isatty()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True, force_terminal=forced or None),
                    transient=not forced, disable=not show)


class Selector:
    """Evaluates candidate MBS values of one (model, gbs, num_csx, system).

    ``auto`` and ``explore`` have :data:`mbcompile.planning.plan.AutoChooser`'s signature,
    so they plug into ``make_plan(chooser=..., explorer=...)``.
    """

    def __init__(self, cost: CostModel, spec: SystemSpec, gbs: int, num_csx: int, *,
                 timer: Callable[[int], float] | None = None,
                 progress: bool | None = None) -> None:
        self.cost = cost
        self.spec = spec
        self.gbs, self.num_csx = gbs, num_csx
        self.timer = timer
        self.progress = progress
        self._seen: dict[int, Candidate] = {}
        self._estimates: dict[int, Estimate] = {}
        self.exploration: Exploration | None = None
        self._start = time.perf_counter()

    # ---------------------------------------------------------- evaluating
    def estimate(self, mbs: int) -> Estimate:
        if mbs not in self._estimates:
            self._estimates[mbs] = self.cost.estimate(self.gbs, self.num_csx, mbs, self.spec)
        return self._estimates[mbs]

    def _measured_loop(self, mbs: int) -> float | None:
        """The largest system's microbatches, each size timed on this host."""
        if self.timer is None:
            return None
        pbs = -(-self.gbs // self.num_csx)
        k = -(-pbs // mbs)
        q, r = divmod(pbs, k)
        total = 0.0
        for size, count in ((q + 1, r), (q, k - r)):
            if size > 0 and count > 0:
                total += count * self.timer(size)
        return total

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
        with _progress(len(values), self.progress if (slow or self.progress) else False) as bar:
            task = bar.add_task(what, total=len(values))
            for m in values:
                out.append(self.evaluate(m))
                bar.advance(task)
        return out

    def largest_fitting(self, candidates: Sequence[int]) -> int | None:
        """Binary search: the largest candidate whose modelled peak fits (None if none)."""
        lo, hi = 0, len(candidates) - 1
        if self.evaluate(candidates[-1]).fits:  # the common case on a large system
            return candidates[-1]
        if not self.evaluate(candidates[0]).fits:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.evaluate(candidates[mid]).fits:
                lo = mid
            else:
                hi = mid - 1
        return candidates[lo]

    def _record(self, mode: str, pbs: int, supported: int, best: int | None) -> None:
        self.exploration = Exploration(
            mode=mode, system=self.spec.name, gbs=self.gbs, num_csx=self.num_csx, pbs=pbs,
            candidates=tuple(self._seen[m] for m in sorted(self._seen)), supported=supported,
            best=best, seconds=time.perf_counter() - self._start,
            capacity=self.spec.memory_bytes, fit_note=self.cost.fit_note,
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
        top = self.largest_fitting(candidates)
        if top is None:
            raise self.does_not_fit(candidates[0], "auto")
        fitting = [m for m in candidates if m <= top]
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
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.evaluate(upto[mid]).step_s <= limit:
                hi = mid
            else:
                lo = mid
        chosen = self._seen[upto[hi]]
        self._record("auto", pbs, len(candidates), chosen.mbs)
        e = self.estimate(chosen.mbs)
        top_c = self._seen[top]
        why = (f"auto on {self.spec.name}: the largest MBS that fits is {top} (modelled peak "
               f"{format_bytes(top_c.peak_bytes)} of {format_bytes(self.spec.memory_bytes)}); "
               f"the fastest that fits is {best.mbs} (modelled step "
               f"{format_seconds(best.step_s)})")
        if chosen.mbs != best.mbs:
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
            self._record("explore", pbs, len(supported_mbs(pbs)), None)
            raise self.does_not_fit(smallest.mbs, "explore")
        best = min(fitting, key=lambda c: (c.step_s, c.peak_bytes))
        self._record("explore", pbs, len(supported_mbs(pbs)), best.mbs)
        why = (f"explore on {self.spec.name}: evaluated all {len(candidates)} supported MBS "
               f"values in [{candidates[0]}, {candidates[-1]}]; the fastest that fits is "
               f"mbs={best.mbs} (modelled step {format_seconds(best.step_s)}, peak "
               f"{format_bytes(best.peak_bytes)} of {format_bytes(self.spec.memory_bytes)}); "
               f"pin it with mbs={best.mbs}")
        measured = self.exploration.measured_best if self.exploration else None
        if measured is not None and measured != best.mbs:
            why += f" (measured on this host, mbs={measured} was fastest)"
        return best.mbs, why

    # --------------------------------------------------------------- errors
    def does_not_fit(self, mbs: int, mode: str) -> DoesNotFitError:
        e = self.estimate(mbs)
        m = e.memory
        pbs = -(-self.gbs // self.num_csx)
        if mbs == 1:
            what = "even mbs=1 does not fit"
        elif mode == "explore":
            what = f"no MBS in the explore range fits (not even the smallest, mbs={mbs})"
        elif mode == "none":
            what = f"mbs='none' (one microbatch of the whole per-system batch, {pbs}) " \
                   "does not fit"
        else:
            what = f"mbs={mbs} does not fit"
        fix: list[str] = []
        if mbs > 1:
            top = self.largest_fitting(_supported_upto(pbs, mbs))
            if top is not None:
                fix.append(f"use mbs={top} (the largest that fits) or mbs='auto'")
        if m.static > 0.5 * m.capacity:
            fix.append("a system with more memory, or a smaller model/optimizer state "
                       "(static memory alone is "
                       f"{format_bytes(m.static)})")
        if m.outputs > 0.25 * m.capacity:
            fix.append("return fewer per-sample outputs (the model returns "
                       f"{format_bytes(self.cost.static.output_bytes_per_sample)} per sample, "
                       "kept for the whole per-system batch)")
        if pbs > 1 and mbs == 1:
            fix.append("more systems (num_csx) to shrink the per-system batch")
        fix.append("a larger system via system=SystemSpec(...)")
        message = (f"{what} on system {self.spec.name!r} (gbs {self.gbs} over {self.num_csx} "
                   f"system{'s' if self.num_csx != 1 else ''}, pbs {pbs}): it needs "
                   f"{format_bytes(m.peak)} but the system has {format_bytes(m.capacity)}\n"
                   f"  {describe_memory(m)}\n"
                   f"  fix: " + "; or ".join(dict.fromkeys(fix)))
        return DoesNotFitError(message, mbs=mbs, needed=m.peak, available=m.capacity)


def _supported_upto(pbs: int, limit: int) -> tuple[int, ...]:
    return tuple(m for m in supported_mbs(pbs) if m <= limit)


def describe_memory(m: MemoryEstimate) -> str:
    """``peak = static ... + inputs ... + ...`` on one line."""
    parts = [f"parameters {format_bytes(m.params)}", f"gradients {format_bytes(m.grads)}",
             f"optimizer state {format_bytes(m.optimizer)}"]
    if m.buffers:
        parts.append(f"buffers {format_bytes(m.buffers)}")
    parts += [f"inputs {format_bytes(m.inputs)}", f"outputs {format_bytes(m.outputs)}",
              f"activations {format_bytes(m.activations)} (saved for backward "
              f"{format_bytes(m.saved)} + largest transient {format_bytes(m.transient)})"]
    if m.update:
        parts.append(f"optimizer update temporaries {format_bytes(m.update)}")
    if m.gathered:  # FSDP2: the units alive unsharded at the peak
        parts.append(f"gathered parameters and FSDP buffers {format_bytes(m.gathered)}")
    if m.frontier or m.coupled:  # a two-phase step's whole-batch terms
        parts += [f"frontier and its gradient {format_bytes(m.frontier)}",
                  f"coupled part at the whole batch {format_bytes(m.coupled)}"]
    return f"peak {format_bytes(m.peak)} ({m.phase}) = " + " + ".join(parts)


# --------------------------------------------------------------------------- #
# compile()'s entry points
# --------------------------------------------------------------------------- #


def check_request(gbs: int, num_csx: int, mbs: MbsPolicy | object, compile_only: bool) -> None:
    """Fail fast, before any tracing, on what the arguments alone rule out.

    Bad ``gbs``/``num_csx``/``mbs`` values, an int ``mbs`` above the per-system
    batch size, and ``"explore"`` without ``compile_only=True``.
    """
    policy = parse_mbs(mbs)  # a policy already parsed by compile() is returned as it is
    pbs = per_system_batch_sizes(gbs, num_csx)[0]
    if policy.mode == "int" and (policy.value or 0) > pbs:
        make_plan(gbs, num_csx, mbs)  # raises the plan's own "must be at most" error
    if policy.mode == "explore":
        with warnings.catch_warnings():  # a clamped range warns once, when it is planned
            warnings.simplefilter("ignore")
            make_plan(gbs, num_csx, mbs, explorer=lambda _, c: (c[0], ""))  # range errors
    if policy.mode == "explore" and not compile_only:
        raise PlanError(
            f"mbs={policy.request!r} explores MBS values and reports the best one to pin; it does "
            "not build a module to train with. Run it once with compile_only=True, read "
            "cm.report() (or cm.plan.mbs), then compile again with mbs=<that value>: "
            f"compile(model, gbs, num_csx, mbs={policy.request!r}, compile_only=True, ...)")


def single_microbatch_request(gbs: int, num_csx: int, mbs: MbsPolicy | object) -> bool:
    """True when the request can only mean one system running one microbatch.

    Such a plan splits nothing, so a graph the batch analysis rejects still runs
    (the fix its errors suggest: ``num_csx=1, mbs='none'``).
    """
    if num_csx != 1:
        return False
    policy = parse_mbs(mbs)  # a policy already parsed by compile() is returned as it is
    pbs = per_system_batch_sizes(gbs, num_csx)[0]
    if policy.mode == "none" or pbs == 1:
        return True
    if policy.mode == "int":
        return closest_supported(min(policy.value or 1, pbs), supported_mbs(pbs)) == pbs
    return False


def select_plan(gbs: int, num_csx: int, mbs: MbsPolicy | object, cost: CostModel | None,
                spec: SystemSpec, *, timer: Callable[[int], float] | None = None,
                progress: bool | None = None, cost_error: str | None = None,
                unsplit: bool = False) -> Selection:
    """Plan ``(gbs, num_csx, mbs)`` with the cost model, and check that it fits.

    ``cost=None`` (the model could not run; ``cost_error`` says why): ints and
    ``"none"`` are planned as asked, ``"auto"`` falls back to the plan's default
    with a :class:`CostModelWarning`, ``"explore"`` fails.  Otherwise every mode
    raises :class:`DoesNotFitError` with the numbers when even MBS 1 does not fit,
    and ints and ``"none"`` when their MBS does not fit.  ``unsplit``: the request
    runs the whole per-system batch as one microbatch (see
    :func:`single_microbatch_request`), so only that size is checked.
    """
    policy = parse_mbs(mbs)  # a policy already parsed by compile() is returned as it is
    pbs = per_system_batch_sizes(gbs, num_csx)[0]
    if cost is None:
        if policy.mode == "explore":
            raise CostModelError(f"mbs={policy.request!r} needs the cost model, which failed: "
                                 f"{cost_error}")
        if policy.mode == "auto":
            warnings.warn(f"the cost model could not run ({cost_error}); mbs='auto' uses the "
                          "default of about 4 microbatches per system, unchecked against "
                          "memory. Pass an int mbs to silence this.", CostModelWarning,
                          stacklevel=user_stacklevel())
        plan = make_plan(gbs, num_csx, mbs)
        if policy.mode == "auto":
            plan = _with_reason(plan, f"{plan.reason} (cost model unavailable: {cost_error})")
        return Selection(plan, spec, None, None, None, cost_error)
    selector = Selector(cost, spec, gbs, num_csx, timer=timer, progress=progress)
    if not unsplit and not selector.evaluate(1).fits:  # whatever was asked, nothing runs
        raise selector.does_not_fit(1, policy.mode)
    plan = make_plan(gbs, num_csx, mbs, chooser=selector.auto, explorer=selector.explore)
    if not selector.evaluate(plan.mbs).fits:
        raise selector.does_not_fit(plan.mbs, policy.mode)
    if selector.exploration is None:  # an int or "none": record what was checked
        selector._record(policy.mode, pbs, len(plan.supported_mbs), plan.mbs)
    return Selection(plan, spec, selector.estimate(plan.mbs), selector.exploration, cost)


def _with_reason(plan: MicrobatchPlan, reason: str) -> MicrobatchPlan:
    return replace(plan, reason=reason)


def select_sharded(gbs: int, num_csx: int, mbs: MbsPolicy | object, cost: CostModel | None,
                   spec: SystemSpec, *, reshard: bool | str = "auto", **kwargs: Any
                   ) -> Selection:
    """:func:`select_plan`, and for a model sharded with FSDP2 (``cost.shard``) its
    ``reshard_after_forward`` chosen with the MBS.

    ``reshard``: True or False pins the setting; ``"auto"`` plans both and keeps the
    faster plan that fits. Keeping units gathered from forward to backward halves their
    all-gathers but holds every unit's parameters at the peak, which can force a smaller
    MBS: the two plans are compared whole (MBS and setting jointly). Without a cost model
    the model runs with the setting it was sharded with (``plan.reshard_after_forward``
    stays None).
    """
    shard = cost.shard if cost is not None else None
    if shard is None:
        return select_plan(gbs, num_csx, mbs, cost, spec, **kwargs)
    assert cost is not None
    if isinstance(reshard, bool):
        cost.shard = replace(shard, reshard_after_forward=reshard)
        selection = select_plan(gbs, num_csx, mbs, cost, spec, **kwargs)
        return replace(selection, plan=replace(selection.plan, reshard_after_forward=reshard))
    cost.shard = replace(shard, reshard_after_forward=True)
    resharded = select_plan(gbs, num_csx, mbs, cost, spec, **kwargs)  # the least memory
    cost.shard = replace(shard, reshard_after_forward=False)
    try:
        gathered: Selection | None = select_plan(gbs, num_csx, mbs, cost, spec, **kwargs)
    except DoesNotFitError as exc:
        gathered, unfit = None, exc
    a = resharded.estimate
    assert a is not None
    if gathered is None:
        chosen, note = resharded, (
            f"FSDP2 units resharded after forward: kept gathered to their backward even mbs "
            f"{unfit.mbs} would need {format_bytes(unfit.needed)} of "
            f"{format_bytes(unfit.available)}")
    else:
        b = gathered.estimate
        assert b is not None
        keep = b.time.step < a.time.step
        chosen = gathered if keep else resharded
        c, o = (b, a) if keep else (a, b)
        how = "kept gathered from forward to backward" if keep else "resharded after forward"
        note = (f"FSDP2 units {how} (reshard_after_forward={not keep}): modelled step "
                f"{format_seconds(c.time.step)} at mbs {c.mbs} (peak "
                f"{format_bytes(c.memory.peak)}), against {format_seconds(o.time.step)} at mbs "
                f"{o.mbs} (peak {format_bytes(o.memory.peak)}) with reshard_after_forward={keep}")
    value = chosen is resharded
    cost.shard = replace(shard, reshard_after_forward=value)
    plan = replace(chosen.plan, reshard_after_forward=value,
                   reason=f"{chosen.plan.reason}; {note}")
    return replace(chosen, plan=plan)


def plan_for(analysis: BatchAnalysis, values: Sequence[Any], in_dims: Sequence[int | None],
             gbs: int, num_csx: int, mbs: MbsPolicy | object, system: SystemSpec, *,
             measure: bool | int = False, progress: bool | None = None,
             name: str | None = None, two_phase: bool = False,
             kept: frozenset[int] | None = None, recompute: bool | str = False,
             shard: ShardSpec | None = None, reshard: bool | str = "auto") -> Selection:
    """``compile()``'s planning step: cost model of the analysed graph, then :func:`select_plan`.

    ``analysis`` is the batch analysis of the captured graph (it says which outputs
    are trained losses), ``values`` the example inputs in placeholder order.  A cost
    model that cannot run is reported through ``Selection.cost_error`` (see
    :func:`select_plan`).  ``measure``: True (3 repetitions) or a repetition
    count, to time real forward+backward on the model's device per candidate.
    When the analysis rejected a split (and the request runs one microbatch on one
    system), only that size is probed and checked, unless it runs as a ``two_phase`` step.
    ``kept``: the output leaves a training step returns (``compile(outputs=...)``).
    ``recompute``: activation checkpointing per block: True, False, or ``"auto"`` (only
    when no MBS fits without it; the plan then says so). ``shard``: the model is sharded
    with FSDP2; memory and time are one rank's (``ShardSpec``), and ``reshard`` is its
    ``reshard_after_forward``: True, False, or ``"auto"`` (chosen with the MBS, see
    :func:`select_sharded`).
    """
    unsplit = analysis.rejected is not None and not two_phase
    gm = analysis.graph_module
    if isinstance(measure, bool) or not isinstance(measure, int):
        if not isinstance(measure, bool):
            raise ArgumentTypeError(f"measure must be a bool or a repetition count, got "
                                    f"{measure!r}")
        reps = 3 if measure else 0
    else:
        if measure < 0:
            raise PlanError(f"measure must be a bool or a repetition count >= 1, got {measure}")
        reps = measure
    pbs = per_system_batch_sizes(gbs, num_csx)[0]
    try:
        if two_phase:
            cost: CostModel | None = analyse_two_phase_cost(analysis, values, in_dims, pbs=pbs,
                                                            name=name)
        else:
            cost = analyse_cost(analysis, values, in_dims, pbs=pbs, name=name, fit=not unsplit,
                                kept_outputs=kept)
        error = None
    except CostModelError as exc:
        cost, error = None, str(exc)
    if cost is not None:
        cost.shard = shard
    timer = HostTimer(gm, values, in_dims, reps) if reps else None
    checkpointed = None if two_phase or unsplit or recompute is False \
        else checkpoint_blocks(analysis.graph_module)
    if recompute is True and checkpointed is not None:
        return _with_recompute(analysis, checkpointed, values, in_dims, gbs, num_csx, mbs,
                               system, pbs, name, kept, progress, None, shard=shard,
                               reshard=reshard)
    try:
        selection = select_sharded(gbs, num_csx, mbs, cost, system, reshard=reshard,
                                   timer=timer, progress=progress, cost_error=error,
                                   unsplit=unsplit)
    except DoesNotFitError as exc:
        if two_phase and isinstance(cost, TwoPhaseCostModel):
            raise _two_phase_too_big(analysis, cost, exc, values, in_dims, pbs, system) from exc
        if checkpointed is not None:  # "auto": the other way to trade compute for memory
            try:
                return _with_recompute(analysis, checkpointed, values, in_dims, gbs, num_csx,
                                       mbs, system, pbs, name, kept, progress, exc, shard=shard,
                                       reshard=reshard)
            except DoesNotFitError:
                pass
        raise
    if two_phase and isinstance(cost, TwoPhaseCostModel) and selection.estimate is not None:
        selection = _two_phase_selection(selection, cost)
    elif two_phase:  # no cost model to size its terms with: still say what runs
        plan = selection.plan
        selection = replace(selection, plan=replace(plan, reason=(
            f"{plan.reason}; two-phase step (a loss that couples samples; its memory "
            "unchecked: the cost model could not run)")))
    selection = _sharded_selection(selection)
    if checkpointed is not None and _may_gain(selection, parse_mbs(mbs).mode):
        try:  # the second knob: a larger MBS that only fits with activation checkpointing
            other = _with_recompute(analysis, checkpointed, values, in_dims, gbs, num_csx, mbs,
                                    system, pbs, name, kept, progress, None, asked=False,
                                    shard=shard, reshard=reshard)
        except DoesNotFitError:
            return selection
        selection = _joint(selection, other, parse_mbs(mbs).mode)
    return selection


def _sharded_selection(selection: Selection) -> Selection:
    """The plan says what sharding costs and saves per rank (unsharded: as it is)."""
    e, shard = selection.estimate, getattr(selection.cost, "shard", None)
    if e is None or shard is None:
        return selection
    grads = ("one unit's gradient shard" if e.num_microbatches == 1
             else "gradients accumulated unsharded")
    note = (f"sharded with FSDP2 over {shard.world} ranks: parameters and optimizer "
            f"state are one rank's shards ({format_bytes(e.memory.params)} of parameters), "
            f"{grads} at the peak ({format_bytes(e.memory.grads)}), {format_bytes(shard.gathered)} "
            f"gathered (the root and {'the largest' if shard.reshard_after_forward else 'all'}"
            f" of {len(shard.unit_bytes) - 1} units) and "
            f"{format_bytes(e.memory.gathered - shard.gathered)} of FSDP's flat buffers, "
            "all-gathers "
            f"{format_seconds(e.time.allgather)} per step")
    plan = selection.plan
    return replace(selection, plan=replace(plan, reason=f"{plan.reason}; {note}"))


def _may_gain(selection: Selection, mode: str) -> bool:
    """Whether activation checkpointing could give a faster plan: ``explore`` shows both;
    ``auto`` only when memory, not the batch, stopped the MBS from growing (at the same
    MBS, recomputing only costs time)."""
    x = selection.exploration
    if x is None or mode not in ("auto", "explore"):
        return False
    return mode == "explore" or not x.candidate(max(c.mbs for c in x.candidates)).fits


def _joint(plain: Selection, ticked: Selection, mode: str) -> Selection:
    """One selection over (MBS, recompute): the faster plan, and every candidate seen."""
    px, tx = plain.exploration, ticked.exploration
    assert px is not None and tx is not None and plain.estimate is not None \
        and ticked.estimate is not None
    candidates = tuple(sorted([*px.candidates,
                               *(replace(c, recompute=True) for c in tx.candidates)],
                              key=lambda c: (c.mbs, c.recompute)))
    faster = ticked.estimate.time.step < plain.estimate.time.step
    chosen = ticked if faster else plain
    other = plain if faster else ticked
    note = (f"; {'with' if faster else 'without'} activation checkpointing per block it is "
            f"faster: modelled step {format_seconds(chosen.estimate.time.step)} at mbs "
            f"{chosen.plan.mbs}, against {format_seconds(other.estimate.time.step)} at mbs "
            f"{other.plan.mbs} {'without' if faster else 'with'} it")
    exploration = replace(px, mode=mode, candidates=candidates, best=chosen.plan.mbs,
                          best_recompute=faster, seconds=px.seconds + tx.seconds)
    if mode == "explore":
        note += f"; pin it with mbs={chosen.plan.mbs}, recompute={faster}"
    plan = replace(chosen.plan, reason=chosen.plan.reason + note)
    return replace(chosen, plan=plan, exploration=exploration)


def _with_recompute(analysis: BatchAnalysis, checkpointed: Any, values: Sequence[Any],
                    in_dims: Sequence[int | None], gbs: int, num_csx: int, mbs: Any,
                    system: SystemSpec, pbs: int, name: str | None,
                    kept: frozenset[int] | None, progress: bool | None,
                    without: DoesNotFitError | None, asked: bool = True,
                    shard: ShardSpec | None = None, reshard: bool | str = "auto") -> Selection:
    """The plan with activation checkpointing per block, its cost probed as it runs
    (``asked``: recompute=True; else chosen beside the plan without it)."""
    cost = analyse_cost(replace(analysis, graph_module=checkpointed), values, in_dims, pbs=pbs,
                        name=name, kept_outputs=kept)
    cost.shard = shard
    selection = select_sharded(gbs, num_csx, mbs, cost, system, reshard=reshard,
                               progress=progress)
    why = (f"activation checkpointing per block{' (recompute=True)' if asked else ''}"
           if without is None else
           f"activation checkpointing per block: without it even mbs {without.mbs} needs "
           f"{format_bytes(without.needed)} of {format_bytes(without.available)}")
    peak = selection.estimate.memory.peak if selection.estimate is not None else 0.0
    plan = replace(selection.plan, recompute=True,
                   reason=f"{selection.plan.reason}; {why}; with it the modelled peak is "
                          f"{format_bytes(peak)}")
    return _sharded_selection(replace(selection, plan=plan))


def _two_phase_selection(selection: Selection, cost: TwoPhaseCostModel) -> Selection:
    """The plan says it is two-phase, and warns when the coupled part holds most memory."""
    plan = selection.plan
    share = cost.coupled_share(plan.mbs)
    notes = plan.warnings
    if share > COUPLED_SHARE_WARNING:
        note = (f"two-phase step: the coupled part holds {share:.0%} of the activation memory "
                "at the whole batch, so microbatching saves little memory here")
        warnings.warn(note, TwoPhaseWarning, stacklevel=user_stacklevel())
        notes = (*notes, note)
    reason = f"{plan.reason}; {two_phase_reason(cost, selection.estimate)}"
    return replace(selection, plan=replace(plan, reason=reason, warnings=notes))


def _two_phase_too_big(analysis: BatchAnalysis, cost: TwoPhaseCostModel, exc: DoesNotFitError,
                       values: Sequence[Any], in_dims: Sequence[int | None], pbs: int,
                       system: SystemSpec) -> MixingError:
    """The rejection, with why a two-phase step does not fit either (the numbers)."""
    rejected = analysis.rejected
    plain_text = ""
    for m in dict.fromkeys(x for x in (exc.mbs, 2) if x <= pbs):  # BatchNorm needs 2 samples
        try:  # what one microbatch of a plain (wrong) split would need, for comparison
            plain = analyse_cost(analysis.graph_module, values, in_dims, pbs=m, fit=False)
        except CostModelError:
            continue
        plain_peak = plain.memory(pbs, m, -(-pbs // m), system).peak
        plain_text = (f"; one microbatch of {m} in a plain split would need "
                      f"{format_bytes(plain_peak)}")
        break
    mem = cost.memory(pbs, exc.mbs, -(-pbs // exc.mbs), system)
    message = (f"{rejected}\n  a two-phase step would run it exactly, but does not fit "
               f"{system.name}: it needs {format_bytes(exc.needed)} at mbs {exc.mbs} (frontier "
               f"and its gradient {format_bytes(mem.frontier)}, the coupled part at the whole "
               f"batch {format_bytes(mem.coupled)}) of {format_bytes(exc.available)}"
               f"{plain_text}")
    err = type(rejected)(message) if rejected is not None else MixingError(message)
    if rejected is not None:
        err.__dict__.update(rejected.__dict__)
    err.two_phase_peak, err.capacity = exc.needed, exc.available  # type: ignore[attr-defined]
    return err


class TwoPhaseWarning(MbcompileWarning):
    """A two-phase step whose coupled part holds most of the memory: little is saved."""


def compile_only_error(plan: MicrobatchPlan, exploration: Exploration | None) -> CompileOnlyError:
    """The error a compile-only module raises when called."""
    pin = exploration.best if exploration is not None and exploration.mode == "explore" \
        else plan.mbs
    return CompileOnlyError(
        "this module was compiled with compile_only=True: it was traced, analysed, planned "
        f"and estimated (mbs={plan.mbs}), and does not run. Read cm.report() for the plan "
        f"and the estimates; to train, compile again without compile_only, e.g. with "
        f"mbs={pin}")
