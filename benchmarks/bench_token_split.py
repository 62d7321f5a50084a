"""Microbatches cut by tokens: the memory model over lengths, each call's split, its cost.

    OMP_NUM_THREADS=1 python benchmarks/bench_token_split.py [--budget-mb 6] [--calls 20000]
        [--attention sdpa eager]

The tiny GPT (2 layers, width 64, 128 positions, vocabulary 64, float32), gbs 16 on one
system, with its attention as torch's fused kernel (``sdpa``: memory linear in the length)
or written out (``eager``: the ``L x L`` scores saved for backward), compiled at length 32
with every length symbolic (``dynamic=True``), ``mbs="auto"`` and a memory budget
(``system=``: a user-defined system of ``--budget-mb`` MB, Adam). In one run:

1. **The memory figure over lengths.** At lengths 8-100 and MBS 2, 5, 16, the peak the
   length model gives (quadratic in the length: ``planning/length_cost.py``) and the
   figure scaled linearly from the example's (each per-sample figure times length / 32),
   each over the measured peak live tensor bytes of one training step (forward, backward,
   Adam: ``planning/measure.py``'s ``training_step_peak``) of a module compiled with that
   MBS and run at that length.
2. **Each call's split** (the last attention given). At lengths 8-100, the MBS and
   microbatches ``auto`` chose for the call, its modelled peak and the measured one over
   the budget (goal: at most 1).
3. **The choice's cost**, in µs per call: ``length_plans.for_length`` (read the call's
   length, choose, show the plan) for a length seen before and for a new one (goal <=
   1000 µs); the split modules were made first, so no lowering is timed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, finish  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile.length_plans import for_length  # noqa: E402
from mbcompile.models import Block, make_tiny_gpt, token_batch  # noqa: E402
from mbcompile.planning.length_cost import scaled_in_length  # noqa: E402
from mbcompile.planning.measure import training_step_peak  # noqa: E402
from mbcompile.planning.plan import num_microbatches  # noqa: E402
from mbcompile.planning.systems import SystemSpec, get_system  # noqa: E402

GBS, EXAMPLE, VOCAB = 16, 32, 64
LENGTHS = (8, 16, 32, 48, 64, 100)
MB = 2**20


def _system(megabytes: float) -> SystemSpec:
    host = get_system("host")
    return SystemSpec("budget", memory_bytes=megabytes * 1e6, peak_flops=host.peak_flops,
                      peak_flops_fp32=host.peak_flops_fp32,
                      memory_bandwidth=host.memory_bandwidth, optimizer_bytes_per_param=8)


class EagerBlock(Block):
    """The tiny GPT's block with its attention written out: softmax of the scores."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        y = F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(GBS, length, VOCAB, seed=length)


def _compiled(attention: str, system: SystemSpec) -> tuple[Any, Any, float]:
    model, _ = make_tiny_gpt(GBS, seq=128, width=64, vocab=VOCAB)
    if attention == "eager":
        for block in model.blocks:
            block.__class__ = EagerBlock
    start = time.perf_counter()
    cm = mbcompile.compile(model, GBS, 1, "auto", example_inputs=_batch(EXAMPLE),
                           dynamic=True, system=system, recompute=False)
    return model, cm, time.perf_counter() - start


def _figures(attention: str, model: Any, lengths: Any, system: SystemSpec,
             fig: dict[str, Any]) -> list[str]:
    """The table's rows for one model: each figure over the measured peak."""
    rows, quads, lins = [], [], []
    for mbs in (2, 5, 16):
        pinned = mbcompile.compile(model, GBS, 1, mbs, example_inputs=_batch(EXAMPLE),
                                   dynamic=True, cost_model=False, recompute=False)
        k = num_microbatches(GBS, mbs)
        for n in LENGTHS:
            b = _batch(n)
            measured = training_step_peak(model, lambda b=b, cm=pinned: cm(*b), b)
            quad = lengths.at(n - EXAMPLE).memory(GBS, mbs, k, system).peak / measured
            lin = scaled_in_length(lengths.base, n / EXAMPLE).memory(GBS, mbs, k, system).peak
            quads.append(quad)
            lins.append(lin / measured)
            rows.append(f"| {attention} | {n} | {mbs} | {measured / MB:.2f} | {quad:.4f} | "
                        f"{lins[-1]:.3f} |")
    fig[f"{attention}_quadratic"] = (min(quads), max(quads))
    fig[f"{attention}_linear"] = (min(lins), max(lins))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=6.0)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "eager"])
    add_output_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    system = _system(args.budget_mb)
    out = ["## Microbatches cut by tokens", "",
           f"tiny GPT (width 64, 2 layers, float32), gbs {GBS} on one system, compiled at "
           f"length {EXAMPLE} with dynamic=True, mbs='auto', a {args.budget_mb:g} MB budget, "
           "Adam.", "", "### The memory figure over lengths, over the measured peak", "",
           "| attention | length | mbs | measured MiB | quadratic fit | linear scaling |",
           "|---|---|---|---|---|---|"]
    fig: dict[str, Any] = {}
    for attention in args.attention:
        model, cm, seconds = _compiled(attention, system)
        fig[f"{attention}_compile_s"] = seconds
        out += _figures(attention, model, cm._split.lengths, system, fig)
    out += ["", *(f"{a}: compiled in {fig[a + '_compile_s']:.1f} s; quadratic fit / measured "
                  f"{fig[a + '_quadratic'][0]:.4f} to {fig[a + '_quadratic'][1]:.4f}, linear "
                  f"scaling / measured {fig[a + '_linear'][0]:.3f} to "
                  f"{fig[a + '_linear'][1]:.3f}" for a in args.attention),
            f"the length model: {cm._split.lengths.note}", "",
            f"### Each call's split under the budget ({args.attention[-1]} attention)", "",
            "| length | mbs | microbatches | modelled MiB | measured MiB | measured / budget |",
            "|---|---|---|---|---|---|"]
    over, pbs, lengths = 0.0, GBS, cm._split.lengths
    for n in LENGTHS:
        b = _batch(n)
        try:
            measured = training_step_peak(model, lambda b=b: cm(*b), b)
        except mbcompile.errors.DoesNotFitError:
            out.append(f"| {n} | - | - | - | - | refused: no MBS fits |")
            continue
        plan = cm.plan
        modelled = lengths.at(n - EXAMPLE).memory(pbs, plan.mbs, plan.num_microbatches,
                                                  system).peak
        over = max(over, measured / system.usable_bytes)
        out.append(f"| {n} | {plan.mbs} | {plan.num_microbatches} | {modelled / MB:.2f} | "
                   f"{measured / MB:.2f} | {measured / system.usable_bytes:.3f} |")
        fig[f"microbatches_at_{n}"] = plan.num_microbatches
    fig["measured_over_budget"] = over
    values = list(_batch(EXAMPLE + 5))
    for_length(cm, values)
    start = time.perf_counter()
    for _ in range(args.calls):
        for_length(cm, values)
    seen = (time.perf_counter() - start) / args.calls * 1e6
    split = cm._split
    start = time.perf_counter()
    for _ in range(args.calls):  # a new length every time: the choice and the plan shown
        split.split._chosen.clear()
        split.shown.clear()
        for_length(cm, values)
    new = (time.perf_counter() - start) / args.calls * 1e6
    fig.update(choice_us_seen=seen, choice_us_new=new)
    out += ["", f"the plan choice per call (length_plans.for_length): {seen:.1f} µs for a length "
            f"seen before, {new:.1f} µs for a new length (goal <= 1000 µs)"]
    return finish(out, fig, args.markdown, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
