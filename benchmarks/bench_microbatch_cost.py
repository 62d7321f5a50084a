"""The fixed time mbcompile adds per microbatch, in microseconds.

    python benchmarks/bench_microbatch_cost.py [--rounds 30] [--counts 2 4 8 16 32 64]

A tiny GPT (width 32, 2 layers, sequence 16) with MBS 2 over 2 systems, so that
Python and dispatch costs are visible next to the arithmetic. The number of
microbatches n sweeps ``--counts`` (gbs = 2n, every microbatch the same size);
every round runs every n with both contenders (the compiled module and the
hand-written loop) in turn. A line ``time = a + b * n`` is fitted (Theil-Sen,
robust to one disturbed point) to each contender's medians, and one to the
medians of the per-round differences, whose slope is what mbcompile adds per
microbatch (``b_mbcompile - b_hand``, measured paired). Training (forward and backward) and
inference (``torch.no_grad``) are fitted apart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    alternate,
    bench_main,
    even_slices,
    hand_infer,
    hand_step,
    median,
)

import mbcompile  # noqa: E402
from mbcompile.models import TinyGPT, token_batch  # noqa: E402

TINY = dict(vocab=64, width=32, depth=2, heads=4, seq=16)
MBS, SYSTEMS = 2, 2
TARGET_US = 100.0


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``: returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def robust_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Theil-Sen ``y = a + b x``: b the median of the slopes between every two points.

    One point thrown off by a burst of load moves a least-squares slope a lot
    (the largest n weighs most) and this one hardly at all.
    """
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i])
              for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    b = median(slopes)
    return median(y - b * x for x, y in zip(xs, ys)), b


def run(rounds: int, counts: list[int], out: list[str]) -> dict[str, float]:
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    train, infer = {}, {}
    for n in counts:
        gbs = MBS * n
        batch = token_batch(gbs, TINY["seq"], TINY["vocab"], seed=1)
        cm = mbcompile.compile(model, gbs, SYSTEMS, MBS, example_inputs=batch)
        slices = even_slices(gbs, SYSTEMS, MBS)
        assert len(slices) == n

        def compiled(cm=cm, batch=batch) -> None:
            loss, _ = cm(*batch)
            loss.backward()

        train[n, "mbcompile"] = compiled
        train[n, "hand loop"] = lambda b=batch, s=slices: hand_step(model, b, s)
        infer[n, "mbcompile"] = lambda cm=cm, b=batch: cm(*b)
        infer[n, "hand loop"] = lambda b=batch, s=slices: hand_infer(model, b, s)
    # Every point runs in every round, so a burst of load spreads over all of them.
    t_train = alternate(train, rounds, warmup=2, before=zero)
    with torch.no_grad():
        t_infer = alternate(infer, rounds, warmup=2)

    figures, rows, fits = {}, {n: [] for n in counts}, []
    for mode, t in (("train", t_train), ("infer", t_infer)):
        per = {k: [median(t.cpu[n, k]) for n in counts] for k in ("mbcompile", "hand loop")}
        # paired: round-by-round differences, so load common to both cancels
        diff = [median(c - h for c, h in zip(t.cpu[n, "mbcompile"], t.cpu[n, "hand loop"]))
                for n in counts]
        for i, n in enumerate(counts):
            rows[n] += [f"{per['mbcompile'][i] * 1e3:.2f}", f"{per['hand loop'][i] * 1e3:.2f}",
                        f"{diff[i] * 1e6:.0f}"]
        xs = [float(n) for n in counts]
        (_, bc), (_, bh), (da, db) = (robust_fit(xs, ys) for ys in
                                      (per["mbcompile"], per["hand loop"], diff))
        figures[f"{mode}_us_per_microbatch"] = db * 1e6
        figures[f"{mode}_us_per_step"] = da * 1e6
        fits.append(f"| {mode} | {bc * 1e6:.0f} | {bh * 1e6:.0f} | **{db * 1e6:.1f}** | "
                    f"{da * 1e6:.0f} |")
    table = [f"| {n} | " + " | ".join(cells) + " |" for n, cells in rows.items()]
    out += [
        "### Fixed cost per microbatch",
        "",
        f"Tiny GPT {TINY}, MBS {MBS} over {SYSTEMS} systems, gbs = {MBS} x microbatches; "
        f"{rounds} rounds, every point in every round; medians of CPU time per step in ms, "
        "and the median of the per-round differences (mbcompile - hand) in µs; one torch "
        "thread.",
        "",
        "| microbatches | train mbcompile ms | train hand ms | train diff µs | "
        "infer mbcompile ms | infer hand ms | infer diff µs |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *table,
        "",
        "Fit of time = a + b * n (Theil-Sen: the median of the slopes between every two "
        "points): b per contender, and the fit of the differences (what mbcompile adds), "
        "in µs:",
        "",
        "| mode | b mbcompile | b hand | **added per microbatch** | added per step |",
        "|---|---:|---:|---:|---:|",
        *fits,
        "",
        f"Target: added per microbatch <= {TARGET_US:.0f} µs.",
        "",
    ]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--counts", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=1)
    return bench_main(parser, argv, lambda args, out: run(args.rounds, args.counts, out))


if __name__ == "__main__":
    sys.exit(main())
