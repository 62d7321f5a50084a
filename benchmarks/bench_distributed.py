"""Step time on 2 gloo ranks against 1 process doing the same work; bytes per step.

    python benchmarks/bench_distributed.py

Both runs train the same small GPT on the same global batch with the same MBS:
one process running both systems in turn (the simulated backend) against two
CPU ranks running one system each. Bytes communicated per step are counted from
the all-reduce calls (status flag, packed partial sums, gradient buckets) and set
beside the size of the gradients.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import make_tiny_gpt

CONFIG = dict(vocab=1000, width=256, depth=4, heads=4, seq=128)
GBS, MBS, STEPS, WARMUP = 16, 4, 6, 2


def _time_steps(cm, batch, model) -> list[float]:
    times = []
    for step in range(WARMUP + STEPS):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss, _ = cm(*batch)
        loss.backward()
        if step >= WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def _rank(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    model, batch = make_tiny_gpt(GBS, **CONFIG)
    cm = mbcompile.compile(model, GBS, world, MBS, example_inputs=batch,
                           backend="torch.distributed")
    local = mbdist.shard(batch, cm.plan, rank)
    sent = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (sent.append(t.numel() * t.element_size()),
                                          real(t, *a, **k))[1]
    times = _time_steps(cm, local, model)
    dist.all_reduce = real
    if rank == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with open(out, "w") as f:
            f.write(f"{statistics.median(times)} {sum(sent) / (WARMUP + STEPS)} {grad_bytes}")


def main() -> None:
    torch.set_num_threads(2)
    model, batch = make_tiny_gpt(GBS, **CONFIG)
    single = mbcompile.compile(model, GBS, 2, MBS, example_inputs=batch)
    one = statistics.median(_time_steps(single, batch, model))
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.txt")
        mbdist.launch(_rank, 2, out)
        two, sent, grad_bytes = (float(x) for x in open(out).read().split())
    print(f"small GPT {CONFIG}, gbs {GBS}, mbs {MBS}, {STEPS} timed steps (medians)")
    print(f"1 process, 2 simulated systems: {one * 1e3:8.1f} ms/step")
    print(f"2 gloo ranks, 1 system each:    {two * 1e3:8.1f} ms/step   ratio {two / one:.2f}")
    print(f"bytes all-reduced per step per rank: {sent / 1e6:.2f} MB; gradients: "
          f"{grad_bytes / 1e6:.2f} MB; ratio {sent / grad_bytes:.3f}")


if __name__ == "__main__":
    sys.exit(main())
