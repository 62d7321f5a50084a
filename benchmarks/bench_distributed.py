"""Training steps on 2 gloo ranks: against DDP + ``no_sync``, and against 1 process.

    python benchmarks/bench_distributed.py             # both parts
    python benchmarks/bench_distributed.py --ddp-only --rounds 40

Every run trains the same small GPT on the same global batch with the same MBS.

1. Against DistributedDataParallel with ``no_sync`` on every microbatch but the
   last, over the very same microbatches, each weighted by its share of the global
   token count (one all-reduce of the count per step, which an exact DDP loop
   needs as the compiled step does), so both produce the same gradients. Two more
   contenders: mbcompile with DDP's bucket sizes (``MIN_BUCKETS = 1``: one bucket
   of 1 MiB, then 25 MiB ones), and mbcompile reducing the old way (``OVERLAP =
   False``: every bucket after the loop, in ``loss.backward()``). The contenders
   alternate round by round (the order rotates), each step starts from a barrier,
   and ratios are medians of the per-round ratios of rank 0's wall time.
2. One process running both systems in turn (the simulated backend) against two
   CPU ranks running one system each. Bytes communicated per step are counted from
   the all-reduce calls (status flag, packed partial sums, gradient buckets) and set
   beside the size of the gradients.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import IGNORE_INDEX, make_tiny_gpt
from mbcompile.planning import buckets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import on_two_ranks  # noqa: E402

CONFIG = dict(vocab=1000, width=256, depth=4, heads=4, seq=128)
GBS, MBS, STEPS, WARMUP = 16, 4, 6, 2
ROUNDS = 30  # of the DDP side-by-side; each round times every contender once


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


def _ddp_step(ddp: DistributedDataParallel, batch: tuple[torch.Tensor, torch.Tensor],
              sizes: tuple[int, ...], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A DDP user's exact step: ``no_sync`` but for the last microbatch, each one's mean
    weighted by its share of the global token count (times ``world``: DDP averages)."""
    ids, labels = batch
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    slices = list(zip(bounds, bounds[1:]))
    counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
    total = torch.stack(counts).sum()
    dist.all_reduce(total)  # the global count, as the compiled step's packed sums
    loss = torch.zeros(())
    outs = []
    for k, ((a, b), count) in enumerate(zip(slices, counts)):
        with ddp.no_sync() if k < len(slices) - 1 else contextlib.nullcontext():
            mean, logits = ddp(ids[a:b], labels[a:b])
            part = mean * (count * world / total)
            part.backward()
        loss += part.detach() / world
        outs.append(logits.detach())
    return loss, torch.cat(outs)


def _versus_ddp(rank: int, world: int, out: str, rounds: int) -> None:
    torch.set_num_threads(1)
    model, batch = make_tiny_gpt(GBS, **CONFIG)
    twin = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, world, MBS, example_inputs=batch,
                           backend="torch.distributed")
    ddp = DistributedDataParallel(twin)  # DDP's defaults: 25 MiB buckets, 1 MiB first
    local = mbdist.shard(batch, cm.plan, rank)
    sizes = cm.plan.microbatch_sizes[rank]

    def compiled(overlap: bool, min_buckets: int = buckets.MIN_BUCKETS) -> Callable[[], object]:
        def step() -> object:
            mbdist.OVERLAP, buckets.MIN_BUCKETS = overlap, min_buckets
            loss, _ = cm(*local)
            loss.backward()
            return loss
        return step

    contenders: dict[str, tuple[torch.nn.Module, Callable[[], object]]] = {
        "mbcompile": (model, compiled(True)),
        "mbcompile, DDP's buckets": (model, compiled(True, min_buckets=1)),
        "mbcompile, reduced after the loop": (model, compiled(False)),
        "DDP + no_sync": (twin, lambda: _ddp_step(ddp, local, sizes, world)),
    }
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(WARMUP + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            module, step = contenders[name]
            module.zero_grad(set_to_none=True)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    grads = {}
    for name in names:  # one more step of each from zero gradients, to compare them
        module, step = contenders[name]
        module.zero_grad(set_to_none=True)
        step()
        grads[name] = [p.grad.clone() for p in module.parameters()]
    ref = grads["DDP + no_sync"]
    diff = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
               for a, b in zip(grads["mbcompile"], ref))
    same = all(torch.equal(a, b) for a, b in zip(grads["mbcompile"],
                                                 grads["mbcompile, reduced after the loop"]))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": cpu, "grad_diff": diff, "bitwise_old": same}, f)


def versus_ddp(rounds: int) -> None:
    got = on_two_ranks(_versus_ddp, rounds)
    times, cpu = got["times"], got["cpu"]
    ddp, ddp_cpu = times["DDP + no_sync"], cpu["DDP + no_sync"]
    print(f"2 gloo ranks, small GPT {CONFIG}, gbs {GBS}, mbs {MBS} "
          f"({GBS // 2 // MBS} microbatches per rank); {rounds} rounds, contenders in turn, "
          "one torch thread per rank; rank 0's wall time per step, medians; '/ DDP' is the "
          "median of the per-round ratios (CPU: the process's CPU time, gloo's threads "
          "included)")
    print(f"{'contender':34s} {'median ms':>9s} {'/ DDP':>6s} {'quartiles':>13s} "
          f"{'CPU ms':>7s} {'CPU / DDP':>9s}")
    for name, ts in times.items():
        ratios = sorted(t / d for t, d in zip(ts, ddp))
        q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
        cpu_ratio = statistics.median(c / d for c, d in zip(cpu[name], ddp_cpu))
        print(f"{name:34s} {statistics.median(ts) * 1e3:9.1f} {statistics.median(ratios):6.3f} "
              f"{q1:6.3f}-{q3:.3f} {statistics.median(cpu[name]) * 1e3:7.1f} {cpu_ratio:9.3f}")
    same = "bitwise equal" if got["bitwise_old"] else "DIFFERENT"
    print(f"gradients: mbcompile against DDP, largest difference relative to the tensor's "
          f"largest element {got['grad_diff']:.1e} (float32, DDP averages); overlapped "
          f"against reduced after the loop: {same}")


def against_one_process() -> None:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="rounds of the DDP side-by-side")
    parser.add_argument("--ddp-only", action="store_true",
                        help="only the side-by-side against DDP + no_sync")
    args = parser.parse_args()
    versus_ddp(args.rounds)
    if not args.ddp_only:
        print()
        against_one_process()


if __name__ == "__main__":
    sys.exit(main())
