"""What the two-phase step's shape exchange costs on ranks, side by side in one run.

    python benchmarks/bench_frontier_exchange.py [--rounds 20] [--gbs 64] [--mbs 16]

On ranks, a two-phase step gathers its frontier F over ranks. Where lengths may differ
between ranks (``dynamic="auto"``, the default, or a symbolic dim), the ranks first
exchange F's shapes, in one small all-gather and one host read per step
(``mbcompile/execution/frontier_gather.py``); with ``dynamic=False`` they do not. The
contenders are the CLIP-like model of ``bench_two_phase.py`` (two transformer towers,
the symmetric InfoNCE loss) compiled both ways on two gloo ranks, stepped in turn (the
order rotating each round), one torch thread per rank: rank 0's wall time per step,
medians, and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import mbcompile
from mbcompile.execution import distributed as mbdist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_two_phase import CONFIG, make_clip  # noqa: E402
from common import bench_main, on_two_ranks  # noqa: E402

CONTENDERS = {"dynamic=False (no exchange)": False, "dynamic='auto' (exchange)": "auto"}


def _rank(rank: int, world: int, out: str, gbs: int, mbs: int, rounds: int) -> None:
    torch.set_num_threads(1)
    steps = {}
    for name, dynamic in CONTENDERS.items():
        model, batch = make_clip(gbs)
        cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch, dynamic=dynamic,
                               backend="torch.distributed", coupling="two_phase")
        share = mbdist.shard(batch, cm.plan, rank)
        steps[name] = (model, cm, share)
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds + 1):  # the first round warms up
        k = r % len(names)
        for name in names[k:] + names[:k]:
            model, cm, share = steps[name]
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            cm(*share).backward()
            if r:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)


def run(args: argparse.Namespace, out: list[str]) -> dict[str, Any]:
    times = on_two_ranks(_rank, args.gbs, args.mbs, args.rounds)
    base = times[next(iter(CONTENDERS))]
    out.append(f"## Two-phase step on 2 gloo ranks: the frontier's shape exchange\n\nCLIP "
               f"{CONFIG}, gbs {args.gbs}, mbs {args.mbs}; {args.rounds} rounds, rank 0's "
               "wall time per step\n")
    out.append(f"{'contender':30s} {'median ms':>9s} {'ratio':>6s}")
    figures = {}
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base))
        figures[name] = ratio
        out.append(f"{name:30s} {statistics.median(ts) * 1e3:9.1f} {ratio:6.3f}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--gbs", type=int, default=64)
    parser.add_argument("--mbs", type=int, default=16)
    return bench_main(parser, argv, run)


if __name__ == "__main__":
    sys.exit(main())
