"""``mbs="auto"`` against the fastest MBS measured: five transformers architectures.

    OMP_NUM_THREADS=1 python benchmarks/bench_auto_time.py [--arch gpt2 llama ...]
        [--outputs loss] [--reps 2] [--warmup 1] [--rounds N] [--measure]

For GPT-2, Llama, BERT (masked LM), T5 and ViT (4 layers, width 256, sequence 128,
each config's own vocabulary, float32, dropout 0; ``common.build_hf``),
gbs 16 on one system, Adam, memory not binding (the host's): ``compile(mbs="auto")``
picks an MBS from the cost model; then every supported MBS (1, 2, 3, 4, 6, 8, 16) is
compiled and its training step (``cm(**batch)``, ``backward()``, ``opt.step()``,
``zero_grad()``) timed one MBS after another, as a training run uses one: ``--warmup``
steps, then the best of ``--reps`` steps, in process CPU time (one torch thread: other
processes' load does not count in it), with the pages it faulted in. ``--rounds N``
instead compiles every MBS first and times N rounds of one step each, the order rotated
every round, and takes each MBS's median: the allocator's page faults, which move a step
by 10-20% with the heap's history, then fall on every MBS alike. About 4 minutes
per architecture on the shared 2-core machine: run a few at a time (``--arch``).
Printed per architecture: the modelled and the measured step at each MBS, auto's pick,
the fastest measured, and the ratio of auto's measured step to the fastest's;
``--measure`` also compiles with ``measure=True`` (a flat curve's tie broken by timing
on this host: ``planning/tie_break.py``) and rates its pick too.

Target (issue 34): every ratio <= 1.05.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import HF_GBS, bench_main, build_hf, hf_parser  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile.planning.plan import supported_mbs  # noqa: E402

TARGET = 1.05  # auto's step over the fastest measured (issue 34)


def _step(cm: Any, batch: dict[str, torch.Tensor], opt: torch.optim.Optimizer) -> None:
    out = cm(**batch)
    loss = out.loss if hasattr(out, "loss") else out[0]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _timed_step(cm: Any, batch: dict[str, torch.Tensor], opt: torch.optim.Optimizer
                ) -> tuple[float, float]:
    """``(seconds, fresh MB)`` of one step in process CPU time, and the pages it faulted
    in (what the allocator mapped afresh; glibc's choices depend on the heap's history,
    so they vary run to run)."""
    gc.collect()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.process_time()
    _step(cm, batch, opt)
    seconds = time.process_time() - start
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return seconds, faults * resource.getpagesize() / 2**20


def _cpu_seconds(cm: Any, batch: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
                 warmup: int, reps: int) -> tuple[float, float]:
    """``(seconds, fresh MB)`` of the best of ``reps`` steps, after ``warmup`` steps."""
    for _ in range(warmup):
        _step(cm, batch, opt)
    return min(_timed_step(cm, batch, opt) for _ in range(reps))


def _round_robin(cms: dict[int, Any], batch: dict[str, torch.Tensor],
                 opt: torch.optim.Optimizer, warmup: int, rounds: int
                 ) -> dict[int, tuple[float, float]]:
    """Per MBS, the median ``(seconds, fresh MB)`` of ``rounds`` steps taken round robin
    over the compiled modules ``cms``, each round starting one MBS later."""
    sizes = list(cms)
    for mbs in sizes:
        for _ in range(warmup):
            _step(cms[mbs], batch, opt)
    runs: dict[int, list[tuple[float, float]]] = {mbs: [] for mbs in sizes}
    for r in range(rounds):
        for mbs in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            runs[mbs].append(_timed_step(cms[mbs], batch, opt))
    return {mbs: (statistics.median(t for t, _ in got), statistics.median(f for _, f in got))
            for mbs, got in runs.items()}


def _compiled(model: torch.nn.Module, batch: dict[str, torch.Tensor], mbs: int, outputs: str
              ) -> Any:
    return mbcompile.compile(model, HF_GBS, 1, mbs, example_kwargs=batch, outputs=outputs,
                             recompute=False, cost_model=False)


def run(args: argparse.Namespace, out: list[str]) -> dict[str, Any]:
    """The section and its figures: per architecture, auto's pick and the fastest measured."""
    outputs, warmup, reps = args.outputs, args.warmup, args.reps
    rows, summary, worst, fig = [], [], 0.0, {}
    for arch in args.arch:
        t0 = time.perf_counter()
        model, batch = build_hf(arch)
        if arch == "vit":  # set on its first call otherwise: each module compiles again then
            model.config.problem_type = "single_label_classification"
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        auto = mbcompile.compile(model, HF_GBS, 1, "auto", example_kwargs=batch, outputs=outputs,
                                 recompute=False)
        cost, spec = auto.selection.cost, auto.selection.system
        picks = {"auto": auto.plan.mbs}
        if args.measure:  # the tie of a flat modelled curve broken by timing here
            picks["auto, measure=True"] = mbcompile.compile(
                model, HF_GBS, 1, "auto", example_kwargs=batch, outputs=outputs,
                recompute=False, measure=True).plan.mbs
        measured: dict[int, float] = {}
        sizes = sorted({*(args.mbs or supported_mbs(HF_GBS)), *picks.values()})
        timed = {}
        if args.rounds:
            timed = _round_robin({mbs: _compiled(model, batch, mbs, outputs) for mbs in sizes},
                                 batch, opt, warmup, args.rounds)
        for mbs in sizes:
            if args.rounds:
                measured[mbs], fresh = timed[mbs]
            else:
                cm = _compiled(model, batch, mbs, outputs)
                measured[mbs], fresh = _cpu_seconds(cm, batch, opt, warmup, reps)
                del cm
            modelled = cost.estimate(HF_GBS, 1, mbs, spec).time.step
            rows.append(f"| {arch} | {mbs} | {-(-HF_GBS // mbs)} | {modelled:.3f} | "
                        f"{measured[mbs]:.3f} | {fresh:.0f} |"
                        f"{' auto' if mbs == auto.plan.mbs else ''} |")
            print(rows[-1], flush=True)
        del timed
        fastest = min(measured, key=measured.__getitem__)
        fig[arch] = {"fastest": fastest, "measured": measured}
        for how, mbs in picks.items():
            ratio = measured[mbs] / measured[fastest]
            worst = max(worst, ratio)
            fig[arch][how] = {"mbs": mbs, "ratio": ratio}
            summary.append(f"| {arch} | {how} | {mbs} | {fastest} | {ratio:.3f}"
                           f"{'' if ratio <= TARGET else ' **out**'} |")
            print(summary[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del auto, model, opt
    fig["worst"] = worst
    out += ["# bench_auto_time", "",
            f"## `auto` against the fastest measured MBS (outputs={outputs!r})", "",
            f"gbs {HF_GBS} on one system, 4 layers, width 256, sequence 128, float32, Adam, one "
            f"torch thread; step in process CPU seconds, "
            + (f"median of {args.rounds} rounds round robin" if args.rounds else f"best of {reps}")
            + f" after {warmup} warm-up.",
            "", "| model | MBS | microbatches | modelled | measured | page faults (MiB) | |",
            "|---|---:|---:|---:|---:|---:|---|", *rows, "",
            "| model | picked by | MBS | fastest measured | picked / fastest |",
            "|---|---|---:|---:|---:|",
            *summary, "",
            f"Worst ratio {worst:.3f} (target <= {TARGET}): "
            f"{'holds' if worst <= TARGET else 'DOES NOT HOLD'}.", ""]
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = hf_parser(__doc__.split("\n")[0])
    parser.add_argument("--outputs", default="loss", choices=("loss", "all"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=0,
                        help="compile every MBS first, then time this many rounds of one step "
                             "each, round robin, and take the medians (default: one MBS after "
                             "another, best of --reps)")
    parser.add_argument("--measure", action="store_true",
                        help="also compile with measure=True (a flat curve's tie broken by "
                             "timing) and set its pick beside the fastest")
    parser.add_argument("--mbs", type=int, nargs="+",
                        help="time these MBS values and auto's pick only (default: every "
                             "supported one)")
    return bench_main(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
