"""What a call compile() did not see costs: another batch size, or a train/eval switch.

    OMP_NUM_THREADS=1 python benchmarks/bench_variants.py [--gbs 7] [--mbs 2] [--recompute]
    OMP_NUM_THREADS=1 python benchmarks/bench_variants.py --predict

``--predict``: a call without labels (predictions) of ``bench_dynamic.py``'s GPT-2,
compiled from a labelled batch as the Trainer calls it: the first such call in training
mode and in eval mode (each captures its own graph once), then calls at other lengths
and batch sizes, beside the model's own call on the same batch.

The tiny GPT of the tests (``tests/models.py``: 2 layers, width 16, sequence 8, vocabulary
32, float64) compiled for gbs 7 over 2 systems at mbs 2, with the cost model on (its
probes are what a training variant would otherwise run again). Then, in one run, the CPU
time (``time.process_time``) of each call that compiles something, beside the first
compile's:

1. the first call in eval mode (``cm.eval()``, under ``no_grad``): a train/eval switch. The
   training capture serves eval where the trace read no ``training`` flag and no layer's
   batch fact reads it (``mbcompile/captures.py``): what a step keeps is decided again and
   the graph lowered, no capture, no probe;
2. evaluation at batch sizes 1..gbs+3 (each new size: a plan without probes and a
   lowering on that capture), the call included; the same call again, compiled already,
   is printed beside it, so that the difference is the compile;
3. a training step at two new batch sizes after ``cm.train()`` (the first capture, and
   the first cost model: a plan and a lowering).

Goal (issue 34): each new batch size and the mode switch <= 50 ms of CPU time. Before
(commit e237a40) each size captured, analysed and probed again: 0.4-1.1 s per size on the
same machine; the switch captured the eval graph again until commit dc6f031 (~340 ms); a
training size whose plan ends on another microbatch size (9: 2+2+1) probed that size
until branch variants3 (~500 ms; now compile probes the pinned MBS and the size below it
and fits the others: ``CostModel.pin``).
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import mbcompile
from mbcompile.models import make_tiny_gpt

CONFIG = dict(vocab=32, width=16, depth=2, heads=2, seq=8)  # tests/models.py's tiny_gpt


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_tiny_gpt(size, seed=size, dtype=torch.float64, **CONFIG)[1]


def _cpu_ms(fn: Callable[[], Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        fn()
        return (time.process_time() - start) * 1e3
    finally:
        gc.enable()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbs", type=int, default=7)
    parser.add_argument("--mbs", default="2", help="an int, or auto")
    parser.add_argument("--recompute", action="store_true",
                        help="compile with recompute=True (activation checkpointing per block)")
    parser.add_argument("--predict", action="store_true",
                        help="a GPT-2 called without labels (transformers)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
    if args.predict:
        return predict_costs()
    gbs, mbs = args.gbs, (int(args.mbs) if args.mbs.isdigit() else args.mbs)
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64, **CONFIG)
    holder: dict[str, Any] = {}
    options = {"recompute": True} if args.recompute else {}
    first = _cpu_ms(lambda: holder.setdefault("cm", mbcompile.compile(
        model, gbs, 2, mbs, example_inputs=batch, **options)))
    cm = holder["cm"]
    print(f"tiny GPT {CONFIG}, gbs {gbs} over 2 systems, mbs={mbs}: first compile "
          f"{first:.0f} ms CPU (plan mbs {cm.plan.mbs})")
    rows = []
    cm.eval()
    with torch.no_grad():
        switch = _cpu_ms(lambda: cm(*batch))
        rows.append(("eval mode, first call (mode switch)", switch, _cpu_ms(lambda: cm(*batch))))
        for size in range(1, gbs + 4):
            if size == gbs:
                continue
            b = _batch(size)
            rows.append((f"eval, batch {size}", _cpu_ms(lambda b=b: cm(*b)),
                         _cpu_ms(lambda b=b: cm(*b))))
    cm.train()
    for size in (3, gbs + 2):
        b = _batch(size)

        def step(b: Any = b) -> None:
            cm(*b)[0].backward()

        rows.append((f"train, batch {size}", _cpu_ms(step), _cpu_ms(step)))
    print(f"{'call':<40} {'first call':>11} {'again':>8} {'compile':>8} {'/ first':>8}")
    worst = 0.0
    for name, once, again in rows:
        compile_ms = once - again
        if not name.startswith("eval mode"):
            worst = max(worst, once)
        print(f"{name:<40} {once:>8.1f} ms {again:>5.1f} ms {compile_ms:>5.1f} ms "
              f"{compile_ms / first:>8.4f}")
    print(f"each new batch size: at most {worst:.1f} ms CPU, call included (goal <= 50 ms); "
          f"the train/eval switch {switch:.1f} ms, call included (goal <= 50 ms); the first "
          f"compile {first:.0f} ms")
    return 0


def predict_costs() -> int:
    """``--predict``: the CPU ms of calls without labels, first and later, and the model's."""
    import copy

    import transformers
    from bench_dynamic import GBS, RandomLengths, collator, make_model

    transformers.logging.set_verbosity_error()
    model = make_model(transformers, "gpt2")
    data, pad = RandomLengths(200, 0), collator(transformers, "gpt2")
    rows = iter(range(200))

    def batch(n: int) -> dict[str, Any]:
        out = dict(pad([data[next(rows)] for _ in range(n)]))
        del out["labels"]
        return out

    labelled = dict(pad([data[next(rows)] for _ in range(GBS)]))
    holder: dict[str, Any] = {}
    first = _cpu_ms(lambda: holder.setdefault("cm", mbcompile.compile(
        copy.deepcopy(model), GBS, 2, 2, example_kwargs=labelled)))
    cm = holder["cm"]
    print(f"GPT-2 of bench_dynamic.py, gbs {GBS} over 2 systems, mbs 2: compile {first:.0f} ms "
          "CPU, from a labelled batch")
    print(f"{'call without labels':<44} {'compiled':>10} {'model':>9}")
    with torch.no_grad():
        for mode in ("train", "eval"):
            cm.train(mode == "train"), model.train(mode == "train")
            for n, what in ((GBS, "first"), (GBS, "another length"), (3, "batch 3"),
                            (GBS + 2, "batch 8")):
                b = batch(n)
                got, want = _cpu_ms(lambda b=b: cm(**b)), _cpu_ms(lambda b=b: model(**b))
                name = f"{mode} mode, {what} (length {b['input_ids'].shape[1]})"
                print(f"{name:<44} {got:>7.1f} ms {want:>6.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
