"""Step time of the compiled module against a hand-written loop (and Accelerate), side by side.

    python benchmarks/bench_overhead.py [--rounds 5] [--mbs 2 4 16] [--threads 1] [--tiny]

The small GPT of issue 7 (4 layers, width 256, sequence 128, vocabulary 1000),
gbs 32 over 2 systems. At each MBS three contenders run the very same
microbatches (sizes taken from mbcompile's plan) and produce the same gradients:

1. ``mbcompile``: ``cm(ids, labels)`` then ``loss.backward()``;
2. ``hand loop``: per microbatch, (its mean loss x its share of the global token
   count).backward(), i.e. (sum of its token losses / global token count);
3. ``accelerate``: the same loop inside ``Accelerator.accumulate``, the loss scaled
   by the accumulation steps as Accelerate's guide does for token-level losses
   (skipped when ``accelerate`` is not installed: ``pip install -e .[bench]``).

``--tiny``: ``mbcompile.models.make_tiny_gpt``'s GPT instead (width 32, 2 layers, sequence
16, vocabulary 64), a step of a few ms where mbcompile's fixed per-step host cost shows
(on the GPT above it is under 0.1% of a CPU step).

Gradients are set to None before every step (``zero_grad()``'s default) and
checked equal across contenders before timing. The contenders take turns, one
step each, for ``--rounds`` rounds after a warm-up round; each figure is a
median, and the ratio is the median of the round-by-round ratios. Inference
(``torch.no_grad``) compares the compiled module with the same loop, no backward.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GBS,
    GPT_CONFIG,
    SYSTEMS,
    alternate,
    bench_main,
    even_slices,
    hand_infer,
    hand_step,
    make_gpt,
    median,
    paired_ratio,
)

import mbcompile  # noqa: E402
from mbcompile.models import IGNORE_INDEX  # noqa: E402

TARGET = 1.03
#: An inference call costs a third of a training step: more rounds for the same time.
INFER_ROUNDS = 3


def accelerate_step(model, batch, slices) -> Callable[[], object] | None:
    """The hand loop under ``Accelerator.accumulate``; None when accelerate is missing."""
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=len(slices))
    prepared = accelerator.prepare(model)
    ids, labels = batch

    def step() -> object:
        accelerator.gradient_accumulation_steps = len(slices)
        counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
        total = sum(counts)
        loss, outs = torch.zeros(()), []
        for (a, b), count in zip(slices, counts):
            with accelerator.accumulate(prepared):
                mean, logits = prepared(ids[a:b], labels[a:b])
                part = mean * (count / total)
                # backward() divides by the accumulation steps: undo it, keep exact weights
                accelerator.backward(part * len(slices))
                loss += part.detach()
                outs.append(logits.detach())
        return loss, torch.cat(outs)

    return step


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


#: ``--tiny``: make_tiny_gpt's defaults
TINY = dict(vocab=64, width=32, depth=2, heads=4, seq=16)


def run(rounds: int, mbs_list: list[int], out: list[str], tiny: bool = False
        ) -> dict[str, float]:
    config = TINY if tiny else GPT_CONFIG
    ms = ".2f" if tiny else ".0f"  # ms per step, to show
    model, batch = make_gpt(**config)
    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    have_accelerate = True
    rows, infer_rows, figures = [], [], {}
    for mbs in mbs_list:
        cm = mbcompile.compile(model, GBS, SYSTEMS, mbs, example_inputs=batch)
        slices = even_slices(GBS, SYSTEMS, mbs)

        def compiled(cm=cm) -> None:
            loss, _ = cm(*batch)
            loss.backward()

        contenders = {"mbcompile": compiled,
                      "hand loop": lambda slices=slices: hand_step(model, batch, slices)}
        acc = accelerate_step(model, batch, slices)
        if acc is not None:
            contenders["accelerate"] = acc
        else:
            have_accelerate = False
        grads = {}
        for name, fn in contenders.items():  # same numbers first, then time
            zero()
            fn()
            grads[name] = _grads(model)
        diff = max(_max_diff(grads["mbcompile"], g) for g in grads.values())
        t = alternate(contenders, rounds, warmup=0, before=zero)
        c, h = t.cpu["mbcompile"], t.cpu["hand loop"]
        ratio = paired_ratio(c, h)
        wall_ratio = paired_ratio(t.wall["mbcompile"], t.wall["hand loop"])
        figures[f"train_mbs{mbs}"] = ratio
        if acc is not None:
            acc_ms = f"{median(t.cpu['accelerate']) * 1e3:{ms}}"
            acc_ratio = f"{paired_ratio(t.cpu['accelerate'], h):.3f}"
        else:
            acc_ms = acc_ratio = "skipped"
        rows.append(f"| {mbs} | {len(slices)} | {median(c) * 1e3:{ms}} | {median(h) * 1e3:{ms}} | "
                    f"{acc_ms} | **{ratio:.3f}** | {acc_ratio} | {wall_ratio:.3f} | "
                    f"{diff:.1e} |")
        print(rows[-1], flush=True)

        with torch.no_grad():
            inf = alternate({"mbcompile": lambda cm=cm: cm(*batch),
                             "hand loop": lambda slices=slices: hand_infer(model, batch, slices)},
                            INFER_ROUNDS * rounds, warmup=1)
        ratio = paired_ratio(inf.cpu["mbcompile"], inf.cpu["hand loop"])
        figures[f"infer_mbs{mbs}"] = ratio
        infer_rows.append(
            f"| {mbs} | {median(inf.cpu['mbcompile']) * 1e3:{ms}} | "
            f"{median(inf.cpu['hand loop']) * 1e3:{ms}} | **{ratio:.3f}** | "
            f"{paired_ratio(inf.wall['mbcompile'], inf.wall['hand loop']):.3f} |")
        print(infer_rows[-1], flush=True)

    out += [
        "### Training step: mbcompile against a hand-written loop",
        "",
        f"{'Tiny' if tiny else 'Small'} GPT {config}, gbs {GBS} over {SYSTEMS} systems; "
        f"{rounds} rounds, the "
        "contenders in turn, one torch thread. Times are medians of the process's CPU time "
        "per step in ms (steady when other processes share the cores); ratios are medians "
        "of the per-round ratios, of CPU time (bold) and of wall time. 'grad diff' is the "
        "largest gradient difference between contenders.",
        "",
        "| MBS | microbatches | mbcompile ms | hand loop ms | accelerate ms | "
        "mbcompile / hand | accelerate / hand | mbcompile / hand (wall) | grad diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]
    if not have_accelerate:
        out += ["accelerate: skipped: accelerate not installed (`pip install -e .[bench]`)", ""]
    out += [
        "### Inference (torch.no_grad): mbcompile against the same loop",
        "",
        f"{INFER_ROUNDS * rounds} rounds.",
        "",
        "| MBS | mbcompile ms | hand loop ms | mbcompile / hand | (wall) |",
        "|---:|---:|---:|---:|---:|",
        *infer_rows,
        "",
        f"Target: every ratio <= {TARGET}.",
        "",
    ]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 16])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is steadiest on a shared 2-core machine)")
    parser.add_argument("--tiny", action="store_true",
                        help="make_tiny_gpt's GPT: the fixed per-step cost shows")
    return bench_main(parser, argv, _with_accelerate_noted)


def _with_accelerate_noted(args: argparse.Namespace, out: list[str]) -> dict[str, float]:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        print("accelerate: skipped: accelerate not installed")
    return run(args.rounds, args.mbs, out, args.tiny)


if __name__ == "__main__":
    sys.exit(main())
