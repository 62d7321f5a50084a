"""mbcompile with ``torch_compile=True`` against a hand loop over ``torch.compile(model)``.

    python benchmarks/bench_torch_compile.py [--rounds 20] [--gbs 30] [--mbs 8] [--threads 1]
                                             [--outputs all|loss]

A tiny GPT (vocab 512, width 128, 2 layers, seq 64; float32), gbs 30 on one
system at MBS 8: mbcompile's plan cuts it evenly into 8, 8, 7, 7, so there is a
short microbatch, and every hand loop below runs exactly the plan's slices
(``cm.plan.microbatch_slices``) with exact token weights (``common.hand_step``).
Like is set beside like: with ``--outputs all`` (the default) mbcompile returns the
logits of every microbatch, joined, and so does each hand loop (it keeps every
microbatch's detached logits and concatenates them); with ``--outputs loss``
mbcompile is compiled with ``outputs="loss"`` (the logits are dropped per
microbatch) and the hand loops discard their logits. The printed section says which.
Four contenders, gradients set to None before each step:

a. ``mbcompile + torch.compile``: ``compile(..., torch_compile=True)`` (inductor);
b. ``hand loop + torch.compile``: ``hand_step`` over ``torch.compile(model)`` with
   default settings, so the short microbatch recompiles (or goes dynamic);
c. ``hand loop``: the same loop, eager;
d. ``mbcompile``: ``compile(...)`` without torch_compile.

Before timing, (a) and (b) take their first step (timed: the compile), their
gradients are checked against one eager full-batch step, and each steps again
until a step makes no new graph. Graphs, ops captured into graphs and graph
breaks come from ``torch._dynamo.utils.counters``, recompiles and dynamic sizes
from dynamo's logs, counted per contender. Inductor's cache goes to a fresh
directory, so first steps are cold compiles. Then the four alternate, one step
each per round (order rotating), timed by the process's CPU time; ratios are
medians of the per-round ratios. ``--profile`` adds a cProfile of one step of
(a) and (b): where mbcompile's step spends its time, and how many eager ``linear``
calls each step makes (none when the body runs compiled).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import logging
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

_CACHE = tempfile.mkdtemp(prefix="bench_torch_compile_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE  # cold compiles: nothing from earlier runs

import torch  # noqa: E402
import torch._dynamo as dynamo  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_output_args,
    alternate,
    finish,
    hand_step,
    median,
    paired_ratio,
)

import mbcompile  # noqa: E402
from mbcompile.check import relative_error  # noqa: E402
from mbcompile.models import make_tiny_gpt  # noqa: E402

ROOT = str(Path(__file__).resolve().parent.parent) + "/"
CONFIG = dict(vocab=512, width=128, depth=2, heads=4, seq=64)
TARGET = 1.00
NAMES = {"a": "mbcompile + torch.compile", "b": "hand loop + torch.compile",
         "c": "hand loop (eager)", "d": "mbcompile (eager)"}


class _DynamoLog(logging.Handler):
    """Counts dynamo's recompiles and the symbolic (dynamic) sizes it creates.

    ``counters`` has neither: they are read from the 'Recompiling function ...' and
    'create_symbol ...' records of dynamo's ``recompiles`` and ``dynamic`` logs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.recompiles = 0
        self.symbols = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().lstrip()
        self.recompiles += message.startswith("Recompiling function")
        self.symbols += message.startswith("create_symbol")


def _watch_dynamo() -> _DynamoLog:
    torch._logging.set_logs(recompiles=True, dynamic=logging.INFO)
    handler = _DynamoLog()
    for name in ("torch._dynamo.guards.__recompiles", "torch._dynamo.__recompiles",
                 "torch.fx.experimental.symbolic_shapes"):
        log = logging.getLogger(name)
        log.handlers = [handler]  # count, do not print
        log.propagate = False
    return handler


def _backend() -> tuple[str, str]:
    """inductor where it compiles here (it needs a C++ compiler on CPU), else aot_eager."""
    try:
        torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.randn(4))
        return "inductor", ""
    except Exception as e:  # noqa: BLE001  (any failure: fall back, and say why)
        return "aot_eager", f"inductor failed here ({type(e).__name__}: {str(e)[:120]}); " \
                            "fell back to backend='aot_eager'"
    finally:
        dynamo.reset()


def _snapshot(log: _DynamoLog) -> dict[str, int]:
    stats = counters["stats"]
    return {"graphs": stats["unique_graphs"], "ops in graphs": stats["calls_captured"],
            "recompiles": log.recompiles, "dynamic sizes": log.symbols,
            "frames": counters["frames"]["total"],
            "graph breaks": sum(counters["unimplemented"].values())
            + sum(counters["graph_break"].values())}


def _diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _grad_error(model: torch.nn.Module, ref: list[torch.Tensor]) -> float:
    return max(relative_error(p.grad, r) for p, r in zip(model.parameters(), ref))


def _profile(step: Callable[[], object], zero: Callable[[], None], steps: int = 5
             ) -> tuple[float, list[tuple[str, float, int]], int]:
    """(CPU ms per step, [(function, cumulative ms per step, calls per step)], eager linears)."""
    prof = cProfile.Profile(time.process_time)  # CPU time, as the rounds
    c0 = time.process_time()
    for _ in range(steps):
        zero()
        prof.enable()
        step()
        prof.disable()
    total = (time.process_time() - c0) / steps * 1e3
    rows, linears = [], 0
    for (file, line, func), (_, ncalls, _, cum, _) in pstats.Stats(prof).stats.items():
        if func == "<built-in method torch._C._nn.linear>":
            linears += ncalls
        if ("/mbcompile/" in file or "/passes/" in file or "eval_with_key" in file
                or file.endswith(("_dynamo/eval_frame.py", "_inductor/output_code.py"))
                or func in ("<method 'run_backward' of 'torch._C._EngineBase' objects>",
                            "<built-in method torch._C._nn.linear>")):
            short = file.replace(ROOT, "").split("site-packages/")[-1]
            rows.append((f"{short}:{line}({func})", cum / steps * 1e3, ncalls // steps))
    rows.sort(key=lambda r: -r[1])
    return total, rows, linears // steps


def run(rounds: int, gbs: int, mbs: int, profile: bool, out: list[str], outputs: str = "all"
        ) -> dict[str, float]:
    backend, fallback = _backend()
    if fallback:
        print(fallback, flush=True)
    recompiles = _watch_dynamo()
    counters.clear()

    model, batch = make_tiny_gpt(gbs, **CONFIG)
    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    eager = copy.deepcopy(model)  # the reference: one eager full-batch step
    eager(*batch)[0].backward()
    ref = [p.grad.detach().clone() for p in eager.parameters()]
    del eager

    options = {} if backend == "inductor" else {"backend": backend}
    cm_a = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, outputs=outputs,
                             torch_compile=options or True)
    cm_d = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, outputs=outputs)
    slices = [(a, b) for system in cm_a.plan.microbatch_slices for a, b in system if b > a]
    sizes = [b - a for a, b in slices]
    if len(set(sizes)) < 2:
        raise SystemExit(f"gbs {gbs} at MBS {mbs} gives microbatches {sizes}: one size only; "
                         "pick a plan with a short microbatch")
    compiled_model = torch.compile(model, **options)  # default settings, as a user writes it

    def step_a() -> None:
        loss, _ = cm_a(*batch)
        loss.backward()

    def step_d() -> None:
        loss, _ = cm_d(*batch)
        loss.backward()

    keep = outputs == "all"  # the hand loops keep (and join) the logits exactly when mbcompile does
    steps = {"a": step_a, "b": lambda: hand_step(compiled_model, batch, slices, keep),
             "c": lambda: hand_step(model, batch, slices, keep), "d": step_d}

    # first steps (the compile), exactness, warm-up until no new graph, graph counts
    if backend == "inductor":  # start the compile workers now, not inside one contender's step
        from torch._inductor.async_compile import AsyncCompile
        AsyncCompile.warm_pool()
    first, grad_err, graphs, warm_steps = {}, {}, {}, {}
    for key in ("a", "b", "c", "d"):
        before = _snapshot(recompiles)
        zero()
        t0, c0 = time.perf_counter(), time.process_time()
        steps[key]()
        first[key] = (time.perf_counter() - t0, time.process_time() - c0)
        grad_err[key] = _grad_error(model, ref)
        n = 1
        while n < 8:  # until a step makes no new graph (and no recompile)
            mark = _snapshot(recompiles)
            zero()
            steps[key]()
            n += 1
            if _snapshot(recompiles) == mark:
                break
        warm_steps[key] = n
        graphs[key] = _diff(before, _snapshot(recompiles))
        print(f"{NAMES[key]}: first step {first[key][0]:.1f} s wall ({first[key][1]:.1f} s CPU "
              f"in this process), grad error {grad_err[key]:.1e}, {graphs[key]}", flush=True)

    t = alternate({key: steps[key] for key in steps}, rounds, warmup=1, before=zero)
    after = _snapshot(recompiles)
    new_in_timed = after["graphs"] - sum(g["graphs"] for g in graphs.values())

    cpu = {k: median(v) * 1e3 for k, v in t.cpu.items()}
    ratios = {f"{x}/{y}": paired_ratio(t.cpu[x], t.cpu[y]) for x, y in
              (("a", "b"), ("a", "c"), ("d", "c"), ("b", "c"), ("a", "d"))}
    wall = {f"{x}/{y}": paired_ratio(t.wall[x], t.wall[y]) for x, y in
            (("a", "b"), ("a", "c"), ("d", "c"))}

    prof_lines: list[str] = []
    if profile:
        for key in ("a", "b"):
            total, rows, linears = _profile(steps[key], zero)
            prof_lines += [f"{NAMES[key]}: {total:.1f} ms CPU per step (under cProfile), "
                           f"{linears} eager `linear` calls per step", "",
                           "| function | ms per step (cumulative) | calls per step |",
                           "|---|---:|---:|",
                           *(f"| `{f}` | {ms:.1f} | {c} |" for f, ms, c in rows[:16]), ""]
        print("\n".join(prof_lines), flush=True)

    sizes_txt = ", ".join(map(str, sizes))
    kept = ("`outputs='all'` (the default): mbcompile returns every microbatch's logits, "
            "joined, and so do the hand loops (each keeps every microbatch's detached logits "
            "and concatenates them)" if keep else
            "`outputs='loss'`: mbcompile drops the logits per microbatch and returns the loss "
            "only, and the hand loops discard their logits")
    out += [
        "### torch.compile: mbcompile against a hand loop over torch.compile(model)",
        "",
        f"Tiny GPT {CONFIG} (float32), gbs {gbs} on 1 system at MBS {mbs}: microbatches "
        f"{sizes_txt} (mbcompile's plan; every hand loop runs the same slices with exact token "
        f"weights). Outputs: {kept}. "
        f"Backend `{backend}`{' (' + fallback + ')' if fallback else ''}; inductor's "
        f"cache in a fresh directory (cold compiles). {rounds} rounds after a warm-up round, "
        "the contenders in turn, one torch thread; ms are medians of the process's CPU time "
        "per step; ratios are medians of the per-round ratios (CPU time; wall time in "
        "brackets). 'first step' is the wall time of the first step (compile included; "
        "inductor compiles in worker processes, so its CPU time is not this process's). "
        "'grad error' is the largest relative gradient difference against one eager "
        "full-batch step. Graphs, recompiles, dynamic sizes (symbols dynamo made for sizes that "
        "vary: a graph that went dynamic), ops captured into graphs and graph breaks are "
        "dynamo's counters and logs over the contender's warm-up steps (until a step made no "
        "new graph).",
        "",
        "| contender | step ms | first step s | warm-up steps | graphs | recompiles | "
        "dynamic sizes | ops in graphs | graph breaks | grad error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| ({k}) {NAMES[k]} | {cpu[k]:.1f} | {first[k][0]:.1f} | {warm_steps[k]} | "
          f"{graphs[k]['graphs']} | {graphs[k]['recompiles']} | {graphs[k]['dynamic sizes']} | "
          f"{graphs[k]['ops in graphs']} | "
          f"{graphs[k]['graph breaks']} | {grad_err[k]:.1e} |" for k in steps),
        "",
        f"New graphs during the timed rounds: {new_in_timed}.",
        "",
        "| ratio | CPU time | (wall) |",
        "|---|---:|---:|",
        f"| **a / b** (mbcompile + torch.compile / hand loop + torch.compile; goal <= "
        f"{TARGET:.2f}) | **{ratios['a/b']:.3f}** | ({wall['a/b']:.3f}) |",
        f"| a / c (against the eager hand loop) | {ratios['a/c']:.3f} | ({wall['a/c']:.3f}) |",
        f"| d / c (mbcompile eager / eager hand loop) | {ratios['d/c']:.3f} | "
        f"({wall['d/c']:.3f}) |",
        f"| b / c (what torch.compile gives the hand loop) | {ratios['b/c']:.3f} | |",
        f"| a / d (what torch_compile=True gives mbcompile) | {ratios['a/d']:.3f} | |",
        "",
    ]
    if prof_lines:
        out += ["One step profiled (cProfile, 5 steps averaged):", "", *prof_lines]
    figures = {"a_over_b": ratios["a/b"], "a_over_c": ratios["a/c"], "d_over_c": ratios["d/c"],
               "backend": backend, "outputs": outputs,
               **{f"graphs_{k}": graphs[k]["graphs"] for k in steps},
               **{f"first_step_s_{k}": first[k][0] for k in steps},
               **{f"grad_error_{k}": grad_err[k] for k in steps}}
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--gbs", type=int, default=30)
    parser.add_argument("--mbs", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is steadiest on a shared 2-core machine)")
    parser.add_argument("--outputs", choices=("all", "loss"), default="all",
                        help="compile(..., outputs=...); the hand loops keep their logits for "
                             "'all' and discard them for 'loss' (like with like)")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one step of (a) and (b)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out: list[str] = []
    try:
        figures = run(args.rounds, args.gbs, args.mbs, args.profile, out, args.outputs)
    finally:
        shutil.rmtree(_CACHE, ignore_errors=True)
    return finish(out, figures, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
