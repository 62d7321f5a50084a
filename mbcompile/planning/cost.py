"""Cost model: memory and time of one training step, per micro batch size, from the graph.

Nothing here runs real compute.  A *probe* runs the captured graph's forward and
backward once on fake tensors (``FakeTensorMode``: shapes and dtypes, no data) at
microbatch size ``m``; the forward is ``passes/fake_probe.py``'s ``FakeProbe``, the
interpreter the shape pass runs too, under the dispatch modes here.  It records,
per ATen op:

- FLOPs, from torch's ``FlopCounterMode`` (plus formulas for the CPU flash
  attention kernels it lacks);
- bytes read and written (the op's input and output tensors; parameters apart,
  so that weights re-read every microbatch are visible);
- the live activation bytes after the op (storages created during the probe,
  freed when autograd or Python drops them; parameter gradients apart, they
  are static memory);

and, through ``torch.autograd.graph.saved_tensors_hooks``, the bytes saved for
backward.

**Affine fit.** For the models this project targets every one of those per-op
figures is affine in ``m`` (``a + b*m``): the op sequence does not change with
the batch size, only the batch dim of the shapes.  So :func:`analyse_cost`
probes ``m = 1`` and ``m = 2``, fits ``a`` and ``b`` per op, and *verifies* the fit
against an exact probe at ``m = pbs``: three fake probes, after which every MBS
costs a few vector operations (that is what makes exploring every MBS cheap).
When ``m = 1`` is special (a size-1 dim broadcasts, a reshape copies) the fit is
rebuilt from ``m = 2, pbs``, checked at ``m = 3``, and ``m = 1`` keeps its own probe;
when no fit holds every size is probed exactly.  Peak memory stays exact under
the fit: the peak is the max over ops of affine functions, evaluated at ``m``.

**Memory** is ``memory_model.py``'s (``MemoryModel``, which this class extends).

**Time** is ``time_model.py``'s (``TimeModel``, which this class extends).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mbcompile.errors import CostModelError
from mbcompile.planning.estimates import (
    Estimate,
    MemoryEstimate,
    MicrobatchFigures,
    ShardSpec,
    StaticFigures,
    TimeEstimate,
    format_bytes,
    format_seconds,
)
from mbcompile.planning.fit import FIT_TOLERANCE, Fit, fit, reproduces, scaled
from mbcompile.planning.memory_model import MemoryModel, split_counts
from mbcompile.planning.plan import num_microbatches, per_system_batch_sizes
from mbcompile.planning.precision import Precision, probe_precision
from mbcompile.planning.probe import Probe
from mbcompile.planning.systems import SystemSpec
from mbcompile.planning.time_model import TimeModel

__all__ = [
    "CostModel",
    "Estimate",
    "MemoryEstimate",
    "MicrobatchFigures",
    "ShardSpec",
    "StaticFigures",
    "TimeEstimate",
    "format_bytes",
    "format_seconds",
]


class CostModel(MemoryModel, TimeModel):
    """Per-MBS figures of one captured graph, and memory/time estimates for a system.

    Build it with ``cost_analysis.analyse_cost``.  ``figures(m)`` answers from the verified
    affine fit where it holds, from an exact (cached) probe otherwise;
    ``estimate(gbs, num_csx, mbs, spec)`` applies the module docstring's formulas.
    """

    def __init__(self, prober: Callable[[int], Probe] | None, static: StaticFigures,
                 name: str = "model", shard: ShardSpec | None = None,
                 precision: Precision | None = None) -> None:
        self._prober = prober
        # the autocast every probe runs under (None: whatever is in force when it runs)
        self.precision = precision
        self._static = static
        self.name = name
        self._exact: dict[int, Probe] = {}
        self._fit: Fit | None = None
        self._fit_from = 1  # smallest size the fit serves
        self.fit_note = "not built: every size is probed exactly"
        self.probes_run = 0
        self.shard = shard  # FSDP2: parameters sharded over ranks (None: not sharded)
        self._pinned: int | None = None  # the size ``pin`` probed
        # the affine fit through ``pin``'s two probes: a variant's other sizes (None: none)
        self._pin_fit: Fit | None = None
        self._pin_below = False  # the size below the pinned one is left to the first need
        # the build left to the first question (``defer``), and why it failed, if it did
        self._pending: tuple[str, int] | None = None
        self.build_error: str | None = None

    @property
    def static(self) -> StaticFigures:
        """The figures that do not depend on the MBS (the per-sample outputs from the probes:
        asking for them runs a deferred build)."""
        self.ready()
        return self._static

    @static.setter
    def static(self, value: StaticFigures) -> None:
        self._static = value

    def defer(self, how: str, m: int) -> None:
        """Leave the probes to the first question, so that the model is built where it is
        asked (the search) and only if it is: ``how`` is ``"pin"`` (``pin(m)``),
        ``"pin variants"`` (``pin(m, variants=True)``), ``"fit"`` (``build_fit(m)``) or
        ``"whole"`` (``probe_whole(m)``)."""
        self._pending = (how, m)

    def ready(self) -> None:
        """Run the deferred build, if any; a ``CostModelError`` it raises is kept in
        ``build_error`` (the search then plans without the model, as ``select_plan`` says)."""
        pending = self.__dict__.get("_pending")
        if pending is None:
            return
        self._pending = None
        how, m = pending
        try:
            {"pin": self.pin, "pin variants": lambda m: self.pin(m, variants=True),
             "fit": self.build_fit, "whole": self.probe_whole}[how](m)
        except CostModelError as exc:
            self.build_error = str(exc)
            raise

    def with_shard(self, shard: ShardSpec | None) -> CostModel:
        """The same model costed with ``shard`` (another ``reshard_after_forward``): a copy
        that shares this one's probes and fit, so nothing is probed twice."""
        self.ready()
        other = object.__new__(type(self))  # not copy.copy: __getstate__ drops the prober
        other.__dict__.update(self.__dict__)  # (the length model probes other lengths with it)
        other.shard = shard
        return other

    # ------------------------------------------------------------- probes
    def probe(self, m: int) -> Probe:
        """The exact probe at ``m`` (run once, then cached)."""
        if m not in self._exact:
            if self._prober is None:
                raise CostModelError(
                    f"this cost model was copied or unpickled without its graph, so it cannot "
                    f"probe microbatch size {m}; its fit and earlier probes still answer. "
                    "Compile again for a new configuration")
            with probe_precision(self.precision, self._prober):
                self._exact[m] = self._prober(m)
            self.probes_run += 1
        return self._exact[m]

    def __getstate__(self) -> dict[str, Any]:
        # Fake tensors and the graph stay behind: a copy answers from the fit and
        # the probes already run (what a compiled module's report needs), the pinned
        # size's second probe included (a copy cannot run it later).
        if self.__dict__.get("_pin_below") and self._prober is not None:
            self._probe_below()
        state = dict(self.__dict__)
        state["_prober"] = None
        return state

    def build_fit(self, pbs: int) -> bool:
        """Fit every per-op figure as ``a + b*m`` and verify it; True if a fit holds.

        Fits at ``m = 1, 2`` and checks the exact probe at ``m = pbs``.  When that
        fails (size-1 dims broadcast, or a reshape copies at one size and not at
        another) it refits at ``m = 2, pbs``, checks at ``m = 3`` and serves
        ``m = 1`` from its own exact probe.  When that fails too, every size is
        probed exactly.  Common case: 3 probes.
        """
        if pbs <= 2:
            for m in range(1, pbs + 1):
                self.probe(m)
            self._fit, self.fit_note = None, f"pbs {pbs}: every size probed exactly"
            self._set_outputs()
            return False
        fitted = fit(self.probe(1), self.probe(2))
        if fitted is not None and reproduces(fitted, self.probe(pbs)):
            self._fit, self._fit_from = fitted, 1
            self.fit_note = (f"affine in m: fitted at m=1,2, reproduces the exact probe at "
                             f"m={pbs} to {FIT_TOLERANCE:g}")
        else:
            fitted = fit(self.probe(2), self.probe(pbs))
            check = 3 if pbs > 3 else None
            if fitted is not None and (check is None or reproduces(fitted, self.probe(check))):
                self._fit, self._fit_from = fitted, 2
                self.fit_note = (f"affine in m from m=2: fitted at m=2,{pbs}"
                                 + (f", reproduces the exact probe at m={check}" if check else "")
                                 + "; m=1 differs and uses its own exact probe")
            else:
                self._fit = None
                self.fit_note = ("not affine in m (the op sequence or the figures change with "
                                 "the batch size): every size is probed exactly")
        self._set_outputs()
        return self._fit is not None

    def pin(self, mbs: int, variants: bool = False) -> None:
        """Probe ``mbs``: the MBS is pinned (an int, or ``"none"``), so the plan runs that
        size and, on an uneven split, a smaller one; no search, no fit checked at a third
        size. A smaller microbatch's time is scaled from the probe (``fit.scaled``).

        ``variants``: the module may run other batch sizes (``batch_sizes="any"``, not
        compile-only), so the first question about another size (an uneven plan's
        trailing microbatch, a variant's plan: ``variants.for_batch``) probes ``mbs - 1``
        and makes the affine fit through the two (``fit.fit``) that answers every other
        size: one probe in all, and none at a compile whose plan runs ``mbs`` only.
        Without it, or where the two do not fit (the op sequence changes with the size),
        any other size asked for is probed exactly.

        >>> cost.pin(2, variants=True)
        >>> cost.probes_run, cost.figures(1).exact, cost.figures(3).exact, cost.probes_run
        (1, True, False, 2)
        """
        self.probe(mbs)
        self._pinned = mbs
        self._pin_below = variants and mbs > 1 and self._static.training
        self.fit_note = f"the MBS is pinned: probed at m={mbs}" + (
            f" (m={mbs - 1} too at the first other size: other sizes affine in m from the "
            "two)" if self._pin_below else " only") + \
            " (a smaller microbatch's time scaled from it)"
        self._set_outputs()

    def _below_for(self, m: int) -> None:
        """``pin``'s second probe, where a size it has not probed is asked for first."""
        if m not in self._exact and self.__dict__.get("_pin_below") and \
                self._prober is not None:
            self._probe_below()

    def _probe_below(self) -> None:
        """``pin``'s second probe, at the size below the pinned one, and the fit."""
        self._pin_below = False
        mbs = self._pinned
        assert mbs is not None
        self._pin_fit = fit(self.probe(mbs - 1), self._exact[mbs])
        self.fit_note = f"the MBS is pinned: probed at m={mbs}" + (
            f",{mbs - 1}, other sizes affine in m from them" if self._pin_fit is not None
            else " only") + " (a smaller microbatch's time scaled from it)"
        self._set_outputs()

    def probe_whole(self, pbs: int) -> None:
        """Probe ``pbs`` only: the plan runs the whole per-system batch as one microbatch
        (a graph run unsplit, where smaller sizes may not even run)."""
        self.probe(pbs)
        self.fit_note = "one microbatch of the whole per-system batch: probed at that size only"
        self._set_outputs()

    def _set_outputs(self) -> None:
        # Per-sample outputs (logits) are the slope of the output bytes in m.
        sizes = sorted(self._exact)
        if self._fit is not None:
            slope = self._fit.outputs[1]
        elif len(sizes) >= 2:
            p, q = self._exact[sizes[-2]], self._exact[sizes[-1]]
            slope = (q.outputs - p.outputs) / (q.m - p.m)
        else:
            p = self._exact[sizes[0]]
            slope = p.outputs / p.m
        self.static = replace(self.static, output_bytes_per_sample=max(0.0, slope))

    @property
    def fitted(self) -> bool:
        self.ready()
        return self._fit is not None

    def verify_fit(self, sizes: Sequence[int]) -> dict[int, bool]:
        """Whether the fit reproduces a fresh exact probe at each size (not cached).

        For tests and benchmarks: this is the check ``build_fit`` runs at ``pbs``,
        at any sizes you like.
        """
        self.ready()
        if self._fit is None or self._prober is None:
            return {m: False for m in sizes}
        return {m: reproduces(self._fit, self._prober(m)) for m in sizes}

    def _at(self, m: int) -> tuple[Probe, bool]:
        self._below_for(m)
        if m in self._exact:
            return self._exact[m], True
        if self._pinned is not None:  # another size after all (a variant's, an error's fix):
            if self._pin_fit is not None:  # from the two probes, or probed exactly, or,
                return self._pin_fit.at(m), False  # copied to a rank, scaled
            if self._prober is None:
                return scaled(self._exact[self._pinned], m), False
            return self.probe(m), True
        if self._fit is not None and m >= self._fit_from:
            return self._fit.at(m), False
        return self.probe(m), True

    def _timed(self, m: int) -> Probe:
        """The probe whose ops time a microbatch of ``m`` samples."""
        self._below_for(m)
        if self._pinned is not None and m not in self._exact:
            return scaled(self._exact[self._pinned], m)
        return self._at(m)[0]

    # ------------------------------------------------------------ figures
    def figures(self, m: int) -> MicrobatchFigures:
        self.ready()
        p, exact = self._at(m)
        fwd = ~p.backward
        first_peak, pending = p.first_live()
        return MicrobatchFigures(
            m=m, flops_forward=float(p.flops[fwd].sum()),
            flops_backward=float(p.flops[p.backward].sum()),
            activation_bytes_moved=float(p.act_bytes.sum()),
            weight_bytes_read=float(p.weight_bytes.sum()),
            saved_bytes=float(p.saved),
            activation_peak_bytes=float(p.live.max(initial=0.0)),
            kernels=int(p.kernel.sum()), exact=exact, first_peak_bytes=first_peak,
            first_grads_pending=pending)

    # ----------------------------------------------------------- estimate
    def estimate(self, gbs: int, num_csx: int, mbs: int, spec: SystemSpec) -> Estimate:
        """Memory and step time of the plan ``make_plan(gbs, num_csx, mbs)`` on ``spec``."""
        sizes = per_system_batch_sizes(gbs, num_csx)
        return self.estimate_split(sizes, mbs, num_microbatches(sizes[0], mbs), spec)

    def estimate_split(self, sizes: Sequence[int], mbs: int, k: int, spec: SystemSpec
                       ) -> Estimate:
        """Memory and step time on ``spec`` of per-system batches of ``sizes`` (larger
        first) run as ``k`` microbatches of at most ``mbs`` each: the numbers the request
        split and the plan arithmetic counted (``MbsChoices.counts``), handed in by the
        search rather than worked out again."""
        gbs, num_csx, pbs = sum(sizes), len(sizes), sizes[0]
        systems = [(size, sizes.count(size)) for size in dict.fromkeys(sizes)]
        accumulate = self._accumulate_seconds(spec)
        worst = (0.0, 0.0, 0.0, 0.0)
        bound_votes: dict[str, float] = {}
        for size, count in systems:
            if size <= 0 or count <= 0:
                continue
            total = roof = over = 0.0
            nonempty = 0
            for m, c in split_counts(size, k):
                t, body, o, bound = self.microbatch_seconds(m, spec)
                total += c * t
                roof += c * body
                over += c * o
                nonempty += c
                bound_votes[bound] = bound_votes.get(bound, 0.0) + c * t
            acc = max(0, nonempty - 1) * accumulate
            if total + acc > worst[0]:
                worst = (total + acc, roof, over, acc)
        allreduce = self.allreduce_seconds(num_csx, spec)
        optimizer = self.optimizer_seconds(spec)
        allgather = 0.0
        rounds = 1
        if self.shard is not None and self.shard.world > 1:
            w = self.shard.world
            # gradients are reduce-scattered, half a ring all-reduce; units are gathered
            # in every microbatch (``ShardSpec.gathers_per_microbatch``), on the same links
            allreduce /= 2
            optimizer /= w
            rounds = self.shard.reduce_scatters(k)
            gathered, gathers = self.shard.gathers_per_microbatch()
            bandwidth, latency = spec.ring_link(w)
            allgather = k * ((w - 1) / w * gathered / bandwidth + gathers * latency)
        # the last microbatch (the smallest of the largest system) runs its backward while
        # the first buckets are reduced
        last = min(size for size, _ in split_counts(pbs, k))
        hidden = self.hidden_seconds(allreduce, self.backward_seconds(last, spec)) \
            if allreduce > 0 else 0.0
        if self.shard is not None and self.shard.world > 1 and rounds > 1:
            # a reduce-scatter round in every microbatch's backward, each hidden alike
            each = self.hidden_seconds(allreduce, self.backward_seconds(mbs, spec))
            allreduce, hidden = rounds * allreduce, hidden + (rounds - 1) * each
        join = self.join_seconds(pbs, k, spec)
        step = worst[0] + join + allreduce - hidden + optimizer + allgather
        first = self.microbatch_seconds(mbs, spec)[0]
        bound = max(bound_votes, key=bound_votes.get) if bound_votes else "compute"
        time = TimeEstimate(
            microbatch=first, compute=worst[1], overhead=worst[2], accumulate=worst[3],
            allreduce=allreduce, optimizer=optimizer, step=step, allreduce_hidden=hidden,
            samples_per_second=gbs / step if step > 0 else math.inf, bound=bound,
            allgather=allgather, join=join)
        return Estimate(spec.name, mbs, k, self.memory(pbs, mbs, k, spec), time,
                        self.figures(mbs))

    def describe(self) -> str:
        s = self.static  # builds a deferred model
        return (f"{self.name}: {s.num_params:,} parameters ({format_bytes(s.param_bytes)}), "
                f"{'one loss, backward per microbatch' if s.fused else 'no single loss'}; "
                f"{self.fit_note}; {self.probes_run} fake probes")
