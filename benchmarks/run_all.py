"""Run every benchmark of issue 7 and write ``benchmarks/RESULTS.md`` (up to its ``KEPT``
line: the hand-written sections after it stay as they are).

    python benchmarks/run_all.py [--quick] [--out benchmarks/RESULTS.md]

Each benchmark runs in its own fresh process (no heap or cache carried over
from the one before), writes its markdown section and its headline figures;
this script adds the machine, the versions, the command and a table of the
targets of issue 7 with whether each holds. About 6 to 10 minutes on a shared
2-core machine; ``--quick`` (fewer rounds, a smoke test of the scripts) about 3.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import machine  # noqa: E402

#: (script, arguments, arguments with --quick)
BENCHMARKS = [
    ("bench_overhead.py", ["--rounds", "8"], ["--rounds", "2"]),
    ("bench_memory.py", [], ["--mbs", "4"]),
    ("bench_microbatch_cost.py", ["--rounds", "40"], ["--rounds", "8"]),
    ("bench_compile.py", [], ["--depths", "2", "8", "24", "--repeats", "1"]),
    ("bench_two_phase.py", ["--rounds", "10"], ["--rounds", "2", "--plans", "64:16"]),
    # most of its ~1.5 min is the cold inductor compile of the hand loop's two graphs
    ("bench_torch_compile.py", ["--rounds", "20", "--profile"], ["--rounds", "2"]),
]


def _targets(f: dict[str, dict[str, float]]) -> list[tuple[str, str, bool]]:
    """(target, measured, holds) for each figure issue 7 asks for."""
    rows = []
    over = f.get("bench_overhead", {})
    for mode, name in (("train", "training step"), ("infer", "inference")):
        vals = {k: v for k, v in over.items() if k.startswith(mode)}
        if vals:
            worst = max(vals.values())
            each = ", ".join(f"MBS {k.split('mbs')[1]}: {v:.3f}" for k, v in vals.items())
            rows.append((f"{name}: mbcompile / hand loop <= 1.03 at every MBS", each,
                         worst <= 1.03))
    mem = f.get("bench_memory", {})
    vs_hand = {k: v for k, v in mem.items() if k.startswith("live_vs_hand")}
    if vs_hand:
        each = ", ".join(f"MBS {k.split('mbs')[1]}: {v:.3f}" for k, v in vs_hand.items())
        rows.append(("peak live bytes: mbcompile / hand loop <= 1.10", each,
                     max(vs_hand.values()) <= 1.10))
    if "live_vs_full_mbs4" in mem:
        v = mem["live_vs_full_mbs4"]
        rows.append(("peak live bytes: mbcompile MBS 4 / full batch of 32 <= 0.25", f"{v:.3f}",
                     v <= 0.25))
    cost = f.get("bench_microbatch_cost", {})
    for mode in ("train", "infer"):
        key = f"{mode}_us_per_microbatch"
        if key in cost:
            rows.append((f"added per microbatch ({mode}) <= 100 µs", f"{cost[key]:.1f} µs",
                         cost[key] <= 100))
    comp = f.get("bench_compile", {})
    if comp:
        rows.append(("compile time per layer <= 50 ms",
                     f"{comp['ms_per_layer']:.1f} ms per layer, at most "
                     f"{comp['ms_per_layer_deep']:.1f} ms per added layer beyond 4",
                     bool(comp["linear_in_depth"])))
        rows.append(("compile time flat in the number of microbatches",
                     f"2 -> 128 microbatches: {comp['microbatch_growth']:.2f}x",
                     bool(comp["flat_in_microbatches"])))
    return rows


#: The line from which RESULTS.md is written by hand (runs on ranks, diagnoses, reruns
#: with their own commands): run_all rewrites what comes before it and keeps the rest.
KEPT = "<!-- kept by run_all.py: the sections below are written by hand -->"


def _kept_sections(out: Path) -> str:
    """The hand-written part of an existing RESULTS.md, from the ``KEPT`` line on."""
    if not out.exists():
        return ""
    text = out.read_text()
    at = text.find(KEPT)
    return text[at:] if at >= 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke test")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--note", help="a line for the header, e.g. which patch was applied")
    args = parser.parse_args(argv)
    command = "python benchmarks/run_all.py" + (" --quick" if args.quick else "")
    info = machine()
    load_before = os.getloadavg()
    start = time.perf_counter()
    sections, figures, durations = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for script, full, quick in BENCHMARKS:
            name = script[:-3]
            md, js = os.path.join(tmp, name + ".md"), os.path.join(tmp, name + ".json")
            cmd = [sys.executable, str(HERE / script), *(quick if args.quick else full),
                   "--markdown", md, "--json", js]
            print(f"== {' '.join(cmd[1:-4])}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            durations[name] = time.perf_counter() - t0
            sections.append(Path(md).read_text())
            figures[name] = json.loads(Path(js).read_text())
    total = time.perf_counter() - start
    load_after = os.getloadavg()
    cores = os.cpu_count() or 1
    shared = max(load_before[0], load_after[0], load_after[1]) > 0.5 * cores

    lines = [
        "# Benchmark results",
        "",
        "Generated by `benchmarks/run_all.py`; see `benchmarks/README.md` for what each "
        "benchmark measures and how.",
        "",
        f"- command: `{command}` (from the repository root)",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}, "
        f"total {total / 60:.1f} min ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in durations.items()) + ")",
    ]
    lines += [f"- {k}: {v}" for k, v in info.items() if k not in ("torch threads",
                                                                    "load (1, 5, 15 min)")]
    lines += [
        "- torch threads: 1 in every benchmark (steadiest when the cores are shared)",
        f"- load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {', '.join(f'{x:.2f}' for x in load_after)}",
    ]
    if args.note:
        lines += [f"- note: {args.note}"]
    if shared:
        lines += [
            "",
            f"**The machine was shared** (load average above half of its {cores} cores): other "
            "processes ran during the benchmarks, so wall times are inflated and noisy. Timed "
            "figures therefore use this process's CPU time, contenders alternate call by call, "
            "and ratios are medians of per-round ratios; expect a few percent of noise on the "
            "step ratios.",
        ]
    lines += [
        "",
        "## Targets of issue 7",
        "",
        "| target | measured | holds |",
        "|---|---|---|",
        *(f"| {t} | {m} | {'yes' if ok else '**no**'} |" for t, m, ok in _targets(figures)),
        "",
        "## Figures",
        "",
        *sections,
    ]
    out = Path(args.out)
    kept = _kept_sections(out)
    out.write_text("\n".join(lines).rstrip() + "\n" + (f"\n{kept}" if kept else ""))
    print(f"wrote {args.out} in {total / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
