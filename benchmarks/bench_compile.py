"""Compile time against model depth and against the number of microbatches.

    python benchmarks/bench_compile.py [--depths 2 4 8 12 16 24] [--repeats 3]
    python benchmarks/bench_compile.py --only transformers [--hf-depths 4 8 16]
    python benchmarks/bench_compile.py --only fake [--repeats 5]

``mbcompile.compile`` on the GPT of issue 7 (width 256, sequence 128,
vocabulary 1000) at gbs 32 over 2 systems, MBS 4:

1. against depth: 2 to 24 layers. A least-squares line through the times and
   the time per layer, and what each layer adds between consecutive depths. The
   cost model probes a repeated block once and counts it (from
   ``planning/block_probe.MIN_BLOCKS`` layers on), and the shape pass runs two blocks,
   so depth adds less than linearly: the target is at most ``PER_LAYER_MS`` per
   layer, on the line and for every added layer from that depth on.
2. against the number of microbatches: depth 4, gbs 128 over 2 systems, MBS
   from 64 (2 microbatches) to 1 (128 microbatches). The plan is arithmetic and
   the loop runs one body, so compile time should not grow.
3. against the model's own cost: the 8-layer GPT with MBS 2 (gbs 32 over 2 systems)
   compiled, beside one forward and backward of the model on fake tensors (no compute:
   what any shape-level look at the model costs), in turns; the target is a compile of at
   most ``FAKE_STEP_RATIO`` of that step.
4. a trainable compile of a transformers GPT-2 (width 32, sequence 16, ``--hf-depths``
   layers; gbs 8 over 2 systems, MBS 2, loss inside the model): torch.export of every
   layer ("before", the whole model exported) against the repeated block exported once
   and its graph copied for the alike layers ("after", ``passes/export_blocks.py``),
   side by side in one run. The time per layer is the slope of a line through the
   depths; the target is at most ``PER_LAYER_MS`` after.

The first compile of a process pays for imports and torch's lazy set-up; it is
reported apart and a warm-up round runs before the timed ones (so torch's
fake-tensor dispatch cache is warm, as for any compile after the first). The
points of a sweep take turns, one compile each per round, and each is the
median of ``--repeats`` rounds, in CPU seconds (one torch thread).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_microbatch_cost import fit  # noqa: E402
from common import (  # noqa: E402
    GBS,
    SYSTEMS,
    add_output_args,
    alternate,
    finish,
    make_gpt,
    median,
)

import mbcompile  # noqa: E402
from mbcompile import analysis  # noqa: E402
from mbcompile.planning.block_probe import MIN_BLOCKS  # noqa: E402

MBS = 4
#: Verdicts: the line misses no point by more than this share of the deepest time, and
#: the most microbatches cost at most this factor of the fewest.
FLAT_TOLERANCE = 1.20
#: Issue 26's target for the tiny GPT: CPU milliseconds per layer.
PER_LAYER_MS = 50.0
#: Issue 37's target: a compile of the 8-layer GPT at MBS 2 costs at most this many fake
#: forward and backward steps of the model.
FAKE_STEP_RATIO = 1.5


def _sweep(points: dict[object, tuple[int, int, int]], repeats: int
           ) -> dict[object, tuple[float, float]]:
    """Median (CPU s, wall s) of compiling each point's (depth, gbs, mbs), points in turn."""
    models = {depth: make_gpt(batch=8, depth=depth) for depth, _, _ in points.values()}

    def compile_fn(depth: int, gbs: int, mbs: int):
        model, batch = models[depth]  # the example batch size does not matter
        return lambda: mbcompile.compile(model, gbs, SYSTEMS, mbs, example_inputs=batch)

    t = alternate({k: compile_fn(*v) for k, v in points.items()}, repeats, warmup=1)
    return {k: (median(t.cpu[k]), median(t.wall[k])) for k in points}


def run(depths: list[int], mbs_list: list[int], repeats: int, out: list[str]
        ) -> dict[str, float]:
    model, batch = make_gpt(batch=8, depth=2)
    c0 = time.process_time()
    mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=batch)
    first = time.process_time() - c0

    timed = _sweep({d: (d, GBS, MBS) for d in depths}, repeats)
    by_depth = [timed[d] for d in depths]
    a, b = fit([float(d) for d in depths], [c for c, _ in by_depth])
    residual = max(abs(c - (a + b * d)) for d, (c, _) in zip(depths, by_depth))
    added = [(c - p) / (d - e) for (d, (c, _)), (e, (p, _)) in
             zip(zip(depths[1:], by_depth[1:]), zip(depths, by_depth))]
    deep = [x for d, x in zip(depths[1:], added) if d > MIN_BLOCKS] or added
    depth_rows = [f"| {d} | {c:.3f} | {w:.3f} | {a + b * d:.3f} |"
                  for d, (c, w) in zip(depths, by_depth)]

    gbs_n = 128
    counts = [mbcompile.make_plan(gbs_n, SYSTEMS, m).num_microbatches * SYSTEMS
              for m in mbs_list]
    timed = _sweep({m: (4, gbs_n, m) for m in mbs_list}, repeats)
    by_n = [(n, *timed[m]) for n, m in zip(counts, mbs_list)]
    an, bn = fit([float(n) for n, _, _ in by_n], [c for _, c, _ in by_n])
    growth = by_n[-1][1] / by_n[0][1]
    n_rows = [f"| {m} | {n} | {c:.3f} | {w:.3f} |" for m, (n, c, w) in zip(mbs_list, by_n)]
    within = b * 1e3 <= PER_LAYER_MS and max(deep) * 1e3 <= PER_LAYER_MS
    flat = growth <= FLAT_TOLERANCE

    out += [
        "### Compile time",
        "",
        f"`mbcompile.compile` on the GPT (width 256, sequence 128, vocabulary 1000); median "
        f"of {repeats} rounds in CPU seconds (wall beside it), the points of a sweep in turn, "
        "after a warm-up round. The first "
        f"compile of the process took {first:.2f} s (imports, torch's lazy set-up).",
        "",
        f"Against depth (gbs {GBS} over {SYSTEMS} systems, MBS {MBS}):",
        "",
        "| layers | CPU s | wall s | line a + b * layers |",
        "|---:|---:|---:|---:|",
        *depth_rows,
        "",
        f"Line: {a:.3f} s + **{b * 1e3:.1f} ms per layer**; largest residual {residual:.3f} s "
        f"({residual / by_depth[-1][0]:.1%} of the deepest). Each added layer costs "
        + ", ".join(f"{x * 1e3:.1f} ms ({e} -> {d})" for (d, e), x in
                    zip(zip(depths[1:], depths), added))
        + f": {'within' if within else 'ABOVE'} {PER_LAYER_MS:.0f} ms per layer on the line "
        f"and beyond {MIN_BLOCKS} layers (a repeated block is probed once from "
        f"{MIN_BLOCKS} on, so the step up to it is where block probing starts).",
        "",
        f"Against the number of microbatches (4 layers, gbs {gbs_n} over {SYSTEMS} systems):",
        "",
        "| MBS | microbatches | CPU s | wall s |",
        "|---:|---:|---:|---:|",
        *n_rows,
        "",
        f"Slope {bn * 1e6:.0f} µs per microbatch (a layer costs {b * 1e3:.1f} ms); "
        f"{by_n[-1][0]} microbatches take "
        f"{growth:.2f}x the time of {by_n[0][0]}: "
        f"{'flat' if flat else 'GROWING'} in the number of microbatches.",
        "",
    ]
    return {"ms_per_layer": b * 1e3, "depth_residual_frac": residual / by_depth[-1][0],
            "linear_in_depth": within, "ms_per_layer_deep": max(deep) * 1e3,
            "us_per_microbatch": bn * 1e6,
            "microbatch_growth": growth, "flat_in_microbatches": flat}


def _gpt2(depth: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers as tf

    tf.logging.set_verbosity_error()
    config = tf.GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=depth, n_head=4,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                           eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (4, 16))
    return tf.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def fake_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    """One forward and backward of ``model`` on ``batch`` with fake tensors: the shapes of
    every value and gradient, no compute (a fresh fake mode, as a compile's first look)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    mode = FakeTensorMode()
    params = {n: mode.from_tensor(p).requires_grad_(p.requires_grad)
              for n, p in model.named_parameters()}
    inputs = tuple(mode.from_tensor(t) for t in batch)
    with mode:
        loss = functional_call(model, params, inputs)[0]
        torch.autograd.grad(loss, [p for p in params.values() if p.requires_grad])


def run_against_fake_step(repeats: int, out: list[str], depth: int = 8, mbs: int = 2
                          ) -> dict[str, float]:
    """``compile()`` of the ``depth``-layer GPT at ``mbs`` beside one fake step of it."""
    model, batch = make_gpt(batch=8, depth=depth)
    t = alternate({"compile": lambda: mbcompile.compile(model, GBS, SYSTEMS, mbs,
                                                        example_inputs=batch),
                   "fake step": lambda: fake_step(model, batch)}, repeats, warmup=1)
    compile_s, step_s = median(t.cpu["compile"]), median(t.cpu["fake step"])
    ratio = compile_s / step_s
    within = ratio <= FAKE_STEP_RATIO
    out += [
        "### Compile time against one fake step of the model",
        "",
        f"`mbcompile.compile` of the {depth}-layer GPT (gbs {GBS} over {SYSTEMS} systems, MBS "
        f"{mbs}) and one forward and backward of the model on fake tensors, in turns; median "
        f"of {repeats} rounds in CPU seconds: compile {compile_s:.3f} s, fake step "
        f"{step_s:.3f} s: **{ratio:.2f}x**, {'within' if within else 'ABOVE'} "
        f"{FAKE_STEP_RATIO}x.",
        "",
    ]
    return {"compile_s": compile_s, "fake_step_s": step_s, "compile_over_fake_step": ratio,
            "within_fake_step_ratio": within}


@contextlib.contextmanager
def _every_layer_exported():
    """The capture before block capture for training: torch.export of the whole model."""
    by_blocks = analysis.capture_once_per_block
    analysis.capture_once_per_block = lambda model, capture: None
    try:
        yield
    finally:
        analysis.capture_once_per_block = by_blocks


def run_transformers(depths: list[int], repeats: int, out: list[str]) -> dict[str, float]:
    models = {d: _gpt2(d) for d in depths}

    def compile_fn(depth: int, before: bool):
        model, batch = models[depth]

        def go() -> None:
            with _every_layer_exported() if before else contextlib.nullcontext():
                mbcompile.compile(model, 8, SYSTEMS, 2, example_kwargs=batch)
        return go

    points = {(d, b): compile_fn(d, b) for d in depths for b in (True, False)}
    t = alternate(points, repeats, warmup=1)
    cpu = {k: median(t.cpu[k]) for k in points}
    slope = {b: fit([float(d) for d in depths], [cpu[d, b] for d in depths])[1] * 1e3
             for b in (True, False)}
    rows = [f"| {d} | {cpu[d, True]:.3f} | {cpu[d, False]:.3f} | "
            f"{cpu[d, True] / cpu[d, False]:.2f} |" for d in depths]
    within = slope[False] <= PER_LAYER_MS
    out += [
        "### Compile time of a trained transformers model",
        "",
        f"`mbcompile.compile` of a transformers GPT-2 (width 32, sequence 16) for training "
        f"(gbs 8 over {SYSTEMS} systems, MBS 2); median of {repeats} rounds in CPU seconds, "
        "the points in turn, after a warm-up round. Before: every layer exported; after: "
        "the repeated block exported once and copied (`passes/export_blocks.py`).",
        "",
        "| layers | before CPU s | after CPU s | before / after |",
        "|---:|---:|---:|---:|",
        *rows,
        "",
        f"Per layer (slope through {', '.join(map(str, depths))} layers): before "
        f"**{slope[True]:.1f} ms**, after **{slope[False]:.1f} ms**: "
        f"{'within' if within else 'ABOVE'} {PER_LAYER_MS:.0f} ms per layer.",
        "",
    ]
    return {"hf_ms_per_layer_before": slope[True], "hf_ms_per_layer_after": slope[False],
            "hf_within_per_layer": within}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 12, 16, 24])
    parser.add_argument("--mbs", type=int, nargs="+", default=[64, 16, 4, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hf-depths", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hf-repeats", type=int, default=3)
    parser.add_argument("--only", choices=["all", "tiny", "fake", "transformers"], default="all")
    add_output_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out: list[str] = []
    figures: dict[str, float] = {}
    if args.only in ("all", "tiny"):
        figures |= run(args.depths, args.mbs, args.repeats, out)
    if args.only in ("all", "tiny", "fake"):
        figures |= run_against_fake_step(args.repeats, out)
    if args.only in ("all", "transformers"):
        figures |= run_transformers(args.hf_depths, args.hf_repeats, out)
    return finish(out, figures, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
