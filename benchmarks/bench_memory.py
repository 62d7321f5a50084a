"""Peak memory of one training step: mbcompile at MBS m, the hand-written loop at m, full batch.

    python benchmarks/bench_memory.py [--mbs 2 4 16]

The small GPT of issue 7 (4 layers, width 256, sequence 128, vocabulary 1000),
gbs 32 over 2 systems. Gradients are set to None before the step, as
``zero_grad()`` does by default, so the step allocates them.

Two measures:

1. **peak live tensor bytes** (``common.LiveBytes``): every storage an op
   creates is counted while it lives; parameters, buffers and the batch are
   counted from the start. Exact and repeatable, so a 10% difference means
   something. "step" is the peak minus what was alive before the step.
2. **peak RSS** of a fresh process (``resource.getrusage().ru_maxrss``) that
   builds the model, compiles it where it applies and runs one step, and the
   step's own rise (Linux: the high-water mark, reset just before the step,
   minus the RSS before it). RSS also holds the Python heap, torch's libraries
   and the allocator's caches: it is shown for completeness, and is too coarse
   for 10% comparisons.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GBS,
    GPT_CONFIG,
    SYSTEMS,
    LiveBytes,
    add_output_args,
    even_slices,
    finish,
    hand_step,
    make_gpt,
    plain_step,
)

import mbcompile  # noqa: E402

TARGET_VS_HAND, TARGET_VS_FULL, FULL_MBS = 1.10, 0.25, 4
MB = 2**20


def _step_fn(kind: str, mbs: int | None, model, batch):
    """The step to measure: 'mbcompile' or 'hand' at ``mbs``, or 'full'."""
    if kind == "mbcompile":
        cm = mbcompile.compile(model, GBS, SYSTEMS, mbs, example_inputs=batch)

        def step():
            loss, logits = cm(*batch)
            loss.backward()
            return loss, logits

        return step
    if kind == "hand":
        slices = even_slices(GBS, SYSTEMS, mbs)
        return lambda: hand_step(model, batch, slices)
    return lambda: plain_step(model, batch)


def live_peak(kind: str, mbs: int | None, model, batch) -> tuple[int, int]:
    """(peak live bytes, live bytes before the step) of one step, after a warm-up step."""
    step = _step_fn(kind, mbs, model, batch)
    model.zero_grad(set_to_none=True)
    step()  # warm-up: lazy initialisation is not part of a step
    model.zero_grad(set_to_none=True)
    with LiveBytes() as mem:
        mem.track(list(model.parameters()), list(model.buffers()), batch)
        before = mem.live
        out = step()
        del out
    return mem.peak, before


def _status(field: str) -> int | None:
    """A ``/proc/self/status`` size in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def child(kind: str, mbs: int | None) -> None:
    """In a fresh process: build, compile where it applies, one step; print the RSS figures."""
    torch.set_num_threads(1)
    model, batch = make_gpt()
    step = _step_fn(kind, mbs, model, batch)
    model.zero_grad(set_to_none=True)
    before = _status("VmRSS")
    try:  # reset the high-water mark, so VmHWM after the step is the step's own peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    step()
    hwm = _status("VmHWM") if reset else None
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(json.dumps({"maxrss": maxrss, "before": before, "step_hwm": hwm}))


def rss(kind: str, mbs: int | None) -> dict[str, int | None]:
    # Through sh, which forks: a process exec'd straight from this (large) one would report
    # this process's peak as its own ru_maxrss, as Linux keeps it across exec.
    cmd = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, __file__, "--child", kind,
           str(mbs or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(mbs_list: list[int], out: list[str], with_rss: bool = True) -> dict[str, float]:
    model, batch = make_gpt()
    variants = [("full", None)] + [(k, m) for m in mbs_list for k in ("mbcompile", "hand")]
    peaks = {v: live_peak(*v, model, batch) for v in variants}
    full_peak, static = peaks["full", None]
    rss_of = {v: rss(*v) for v in variants} if with_rss else {}

    def rss_cells(v) -> str:
        if v not in rss_of:
            return "- | -"
        r = rss_of[v]
        rise = "-" if r["step_hwm"] is None else f"{(r['step_hwm'] - r['before']) / MB:.0f}"
        return f"{r['maxrss'] / MB:.0f} | {rise}"

    figures, rows = {}, []
    rows.append(f"| full batch ({GBS}) | {full_peak / MB:.1f} | {(full_peak - static) / MB:.1f} | "
                f"- | 1.000 | {rss_cells(('full', None))} |")
    for m in mbs_list:
        c, c0 = peaks["mbcompile", m]
        h, h0 = peaks["hand", m]
        figures[f"live_vs_hand_mbs{m}"] = c / h
        figures[f"live_vs_full_mbs{m}"] = c / full_peak
        for name, (p, p0), vs_hand in (("mbcompile", (c, c0), f"**{c / h:.3f}**"),
                                       ("hand loop", (h, h0), "1.000")):
            vs_full = f"{p / full_peak:.3f}"
            if name == "mbcompile" and m == FULL_MBS:
                vs_full = f"**{vs_full}**"
            rows.append(f"| {name}, MBS {m} | {p / MB:.1f} | {(p - p0) / MB:.1f} | {vs_hand} | "
                        f"{vs_full} | {rss_cells((name if name == 'mbcompile' else 'hand', m))} |")
        print(rows[-2], rows[-1], sep="\n", flush=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out += [
        "### Peak memory of one training step",
        "",
        f"Small GPT {GPT_CONFIG}, gbs {GBS} over {SYSTEMS} systems, gradients None before the "
        f"step. Live tensor bytes count parameters ({params / MB:.1f} MiB), buffers and the "
        "batch from the start, then every storage ops create while it lives; 'step' is the "
        "peak minus what was alive before. RSS: ru_maxrss of a fresh process that builds "
        "the model, compiles it and runs one step (torch and the Python heap included), and "
        "the step's own rise: the high-water mark after the step (reset just before it) "
        "minus the RSS before it.",
        "",
        "| step | peak live MiB | step MiB | / hand loop | / full batch | peak RSS MiB | "
        "step RSS rise MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Targets: mbcompile / hand loop <= {TARGET_VS_HAND} at every MBS; mbcompile at MBS "
        f"{FULL_MBS} / full batch <= {TARGET_VS_FULL}.",
        "",
    ]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--no-rss", action="store_true", help="skip the fresh-process RSS runs")
    add_output_args(parser)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "MBS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]) or None)
        return 0
    torch.set_num_threads(1)
    out: list[str] = []
    figures = run(args.mbs, out, with_rss=not args.no_rss)
    return finish(out, figures, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
