"""Two-phase step (a loss that couples samples) against a hand-written GradCache loop.

    python benchmarks/bench_two_phase.py [--rounds 10] [--plans 64:16 62:16 64:4]

A CLIP-like model (issue 13, item 5): an image tower (8x8 patches of 3x32x32
float32 images, a linear patch embedding, two transformer blocks, mean pooling)
and a text tower (token embedding, two transformer blocks, the last position),
each projected and L2-normalised, a learned logit scale, and the symmetric
InfoNCE loss over the whole batch: every sample's loss depends on every other
sample's embedding, so a plain split changes the result. Dropout in both
towers, so the RNG replay matters. For each plan ``gbs:mbs`` (one system; the
microbatch sizes are mbcompile's own plan, e.g. 62:16 runs 16, 16, 15, 15) the
contenders run the very same microbatches:

1. ``mbcompile``: ``mbcompile.compile(model, gbs, 1, mbs, coupling="two_phase")``,
   then ``loss = cm(imgs, txts); loss.backward()``;
2. ``GradCache``: the same three phases by hand (Gao et al. 2021): per microbatch a
   forward of both towers under ``torch.no_grad`` keeping the embeddings and the RNG
   state; the loss on the joined embeddings with grad, its backward giving the logit
   scale's gradient and dL/d embeddings; per microbatch the towers again from the same
   RNG state, with grad, and ``torch.autograd.backward(embeddings, grad slices)``;
3. ``per-mb loss``: a plain loop computing the loss per microbatch (weighted by its
   share of the batch) and its backward. A different objective (each sample sees only
   its microbatch's negatives), but what users of gradient accumulation run;
4. ``full batch``: one forward and backward at gbs (the memory microbatching saves).

Before timing, mbcompile and GradCache are checked to give the same loss and
gradients in float64 (``grad diff``, target <= 1e-10), from the same RNG seed.
``phase-1 fwd`` is a fifth timed call: both towers under ``torch.no_grad`` over the
microbatches, i.e. the extra forward a two-phase step pays; its share is its time
over mbcompile's step. Peak live tensor bytes of one step (``common.LiveBytes``,
gradients None first) are printed per contender. Timing as in the other scripts:
contenders in turn, the order rotating, CPU time of one torch thread, medians, and
ratios as medians of per-round ratios.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    LiveBytes,
    alternate,
    bench_main,
    even_slices,
    median,
    paired_ratio,
)

import mbcompile  # noqa: E402
from mbcompile.models import Block  # noqa: E402

TARGET = 1.05
#: Model size: a step of mbcompile at gbs 64 takes about 100-150 ms of one core.
CONFIG = dict(width=128, depth=2, heads=4, embed=64, image=32, patch=8, seq=16, vocab=1000,
              dropout=0.1)
Batch = tuple[torch.Tensor, torch.Tensor]
Slices = Sequence[tuple[int, int]]


class Tower(nn.Module):
    """Transformer blocks over a sequence of tokens, pooled and projected to the embedding."""

    def __init__(self, width: int, depth: int, heads: int, embed: int, length: int,
                 dropout: float, pool: str) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(length, width) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.proj = nn.Linear(width, embed, bias=False)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(x + self.pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        x = x.mean(dim=1) if self.pool == "mean" else x[:, -1]
        return F.normalize(self.proj(x), dim=-1)


class Clip(nn.Module):
    """Two towers, normalised embeddings, a learned logit scale, symmetric InfoNCE."""

    def __init__(self, width: int, depth: int, heads: int, embed: int, image: int, patch: int,
                 seq: int, vocab: int, dropout: float) -> None:
        super().__init__()
        self.patch = patch
        patches = (image // patch) ** 2
        self.patch_embed = nn.Linear(3 * patch * patch, width)
        self.image_tower = Tower(width, depth, heads, embed, patches, dropout, "mean")
        self.tok = nn.Embedding(vocab, width)
        self.text_tower = Tower(width, depth, heads, embed, seq, dropout, "last")
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))  # log(1 / 0.07), as CLIP

    def encode_image(self, imgs: torch.Tensor) -> torch.Tensor:
        b, c, h, w = imgs.shape
        p = self.patch
        x = imgs.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.image_tower(self.patch_embed(x.reshape(b, (h // p) * (w // p), c * p * p)))

    def encode_text(self, txts: torch.Tensor) -> torch.Tensor:
        return self.text_tower(self.tok(txts))

    def encode(self, imgs: torch.Tensor, txts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sample part P: what a GradCache loop runs per microbatch."""
        return self.encode_image(imgs), self.encode_text(txts)

    def contrastive(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """The coupled part C: symmetric InfoNCE over every pair of the batch."""
        logits = self.logit_scale.exp() * img @ txt.t()
        target = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2

    def forward(self, imgs: torch.Tensor, txts: torch.Tensor) -> torch.Tensor:
        return self.contrastive(*self.encode(imgs, txts))


def make_clip(gbs: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[Clip, Batch]:
    torch.manual_seed(seed)
    model = Clip(**CONFIG).to(dtype)
    imgs = torch.randn(gbs, 3, CONFIG["image"], CONFIG["image"], dtype=dtype)
    txts = torch.randint(0, CONFIG["vocab"], (gbs, CONFIG["seq"]))
    return model, (imgs, txts)


# ---------------------------------------------------------------- the hand-written contenders
def grad_cache_step(model: Clip, batch: Batch, slices: Slices) -> torch.Tensor:
    """GradCache (Gao et al. 2021): the three phases written by hand."""
    imgs, txts = batch
    # 1. both towers per microbatch without grad; keep the embeddings and the RNG state
    states, img_parts, txt_parts = [], [], []
    with torch.no_grad():
        for a, b in slices:
            states.append(torch.get_rng_state())
            img, txt = model.encode(imgs[a:b], txts[a:b])
            img_parts.append(img)
            txt_parts.append(txt)
    # 2. the loss once on the joined embeddings, with grad: logit scale's grad and dL/d emb
    img_all = torch.cat(img_parts).requires_grad_()
    txt_all = torch.cat(txt_parts).requires_grad_()
    del img_parts, txt_parts
    loss = model.contrastive(img_all, txt_all)
    loss.backward()
    after = torch.get_rng_state()
    # 3. the towers again per microbatch from the same RNG state, backpropagating the slices
    for (a, b), state in zip(slices, states):
        torch.set_rng_state(state)
        img, txt = model.encode(imgs[a:b], txts[a:b])
        torch.autograd.backward((img, txt), (img_all.grad[a:b], txt_all.grad[a:b]))
    torch.set_rng_state(after)
    return loss.detach()


def per_microbatch_step(model: Clip, batch: Batch, slices: Slices) -> torch.Tensor:
    """What gradient accumulation computes: the loss per microbatch (not the batch's)."""
    imgs, txts = batch
    n = imgs.shape[0]
    loss = torch.zeros((), dtype=imgs.dtype)
    for a, b in slices:
        part = model(imgs[a:b], txts[a:b]) * ((b - a) / n)
        part.backward()
        loss += part.detach()
    return loss


def full_batch_step(model: Clip, batch: Batch) -> torch.Tensor:
    loss = model(*batch)
    loss.backward()
    return loss.detach()


def phase_one_forward(model: Clip, batch: Batch, slices: Slices) -> None:
    """The extra forward of a two-phase step: both towers, no grad, per microbatch."""
    imgs, txts = batch
    with torch.no_grad():
        for a, b in slices:
            model.encode(imgs[a:b], txts[a:b])


def compile_two_phase(model: Clip, gbs: int, mbs: int, batch: Batch) -> Callable[[], object]:
    cm = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, coupling="two_phase")

    def step() -> torch.Tensor:
        loss = cm(*batch)
        loss.backward()
        return loss.detach()

    step.cm = cm  # type: ignore[attr-defined]
    return step


# ------------------------------------------------------------------------------ checks
def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def check_exact(gbs: int, mbs: int) -> tuple[float, float]:
    """mbcompile against GradCache in float64, from the same RNG seed: (loss diff, grad diff)."""
    model, batch = make_clip(gbs, torch.float64)
    slices = even_slices(gbs, 1, mbs)
    compiled = compile_two_phase(model, gbs, mbs, batch)
    out = {}
    for name, fn in (("mbcompile", compiled),
                     ("GradCache", lambda: grad_cache_step(model, batch, slices))):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        loss = fn()
        out[name] = (loss, _grads(model))
    (la, ga), (lb, gb) = out["mbcompile"], out["GradCache"]
    return float((la - lb).abs()), max(float((x - y).abs().max()) for x, y in zip(ga, gb))


def peak_bytes(model: nn.Module, batch: Batch, fn: Callable[[], object]) -> int:
    model.zero_grad(set_to_none=True)
    with LiveBytes() as mem:
        mem.track(list(model.parameters()), list(model.buffers()), batch)
        fn()
    return mem.peak


# ---------------------------------------------------------------------------------- run
def _contenders(model: Clip, batch: Batch, slices: Slices, gbs: int, mbs: int
                ) -> dict[str, Callable[[], object]]:
    return {
        "mbcompile": compile_two_phase(model, gbs, mbs, batch),
        "GradCache": lambda: grad_cache_step(model, batch, slices),
        "per-mb loss": lambda: per_microbatch_step(model, batch, slices),
        "full batch": lambda: full_batch_step(model, batch),
        "phase-1 fwd": lambda: phase_one_forward(model, batch, slices),
    }


def run(rounds: int, plans: list[tuple[int, int]], out: list[str]) -> dict[str, float]:
    rows, mem_rows, figures = [], [], {}
    for gbs, mbs in plans:
        loss_diff, grad_diff = check_exact(gbs, mbs)
        print(f"gbs {gbs}, mbs {mbs}: mbcompile vs GradCache in float64: loss diff "
              f"{loss_diff:.1e}, grad diff {grad_diff:.1e} "
              f"({'ok' if grad_diff <= 1e-10 else 'NOT EQUAL'} at 1e-10)", flush=True)
        model, batch = make_clip(gbs)
        slices = even_slices(gbs, 1, mbs)
        sizes = _sizes(slices)
        contenders = _contenders(model, batch, slices, gbs, mbs)
        peaks = {name: peak_bytes(model, batch, fn) for name, fn in contenders.items()
                 if name != "phase-1 fwd"}
        zero = functools.partial(model.zero_grad, set_to_none=True)
        t = alternate(contenders, rounds, warmup=1, before=zero)
        ms = {name: median(v) * 1e3 for name, v in t.cpu.items()}
        a = t.cpu["mbcompile"]
        vs_gc = paired_ratio(a, t.cpu["GradCache"])
        vs_plain = paired_ratio(a, t.cpu["per-mb loss"])
        vs_full = paired_ratio(a, t.cpu["full batch"])
        share = paired_ratio(t.cpu["phase-1 fwd"], a)
        wall = paired_ratio(t.wall["mbcompile"], t.wall["GradCache"])
        key = f"gbs{gbs}_mbs{mbs}"
        figures.update({f"vs_gradcache_{key}": vs_gc, f"vs_per_mb_loss_{key}": vs_plain,
                        f"vs_full_{key}": vs_full, f"extra_forward_share_{key}": share,
                        f"grad_diff_f64_{key}": grad_diff,
                        f"live_vs_gradcache_{key}": peaks["mbcompile"] / peaks["GradCache"]})
        rows.append(
            f"| {gbs} | {sizes} | {ms['mbcompile']:.1f} | {ms['GradCache']:.1f} | "
            f"{ms['per-mb loss']:.1f} | {ms['full batch']:.1f} | **{vs_gc:.3f}** | {wall:.3f} | "
            f"{vs_plain:.3f} | {vs_full:.3f} | {share:.1%} | {grad_diff:.1e} |")
        print(rows[-1], flush=True)
        mib = {name: v / 2**20 for name, v in peaks.items()}
        mem_rows.append(
            f"| {gbs} | {sizes} | {mib['mbcompile']:.2f} | {mib['GradCache']:.2f} | "
            f"{mib['per-mb loss']:.2f} | {mib['full batch']:.2f} | "
            f"{peaks['mbcompile'] / peaks['GradCache']:.3f} |")
        print(mem_rows[-1], flush=True)
    n_params = sum(p.numel() for p in make_clip(2)[0].parameters())
    out += [
        "### Two-phase step (coupled loss): mbcompile against a hand-written GradCache loop",
        "",
        f"CLIP-like model {CONFIG} ({n_params / 1e6:.2f} M parameters): image tower over 8x8 "
        "patches of 3x32x32 float32 images and text tower over token ids, each two "
        "transformer blocks, normalised embeddings, learned logit scale, symmetric InfoNCE "
        f"over the whole batch; one system, `coupling=\"two_phase\"`; {rounds} rounds after a "
        "warm-up round, the contenders in turn, one torch thread. Times are medians of the "
        "process's CPU time per step in ms; ratios are medians of the per-round ratios (CPU "
        "time, and the mbcompile / GradCache ratio of wall time). 'per-mb loss' is the plain "
        "accumulation loop with the loss computed per microbatch (a different objective); "
        "'extra fwd' is the time of both towers under `torch.no_grad` over the microbatches "
        "(phase 1, timed by hand in the same rounds) over mbcompile's step. 'grad diff' is "
        "the largest gradient difference between mbcompile and GradCache in float64, from "
        "the same RNG seed (dropout on).",
        "",
        "| gbs | microbatches (count x size) | mbcompile ms | GradCache ms | per-mb loss ms | "
        "full batch ms | mbcompile / GradCache | (wall) | mbcompile / per-mb loss | "
        "mbcompile / full batch | extra fwd | grad diff (f64) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Peak live tensor bytes of one step (MiB; parameters, batch and gradients included):",
        "",
        "| gbs | microbatches (count x size) | mbcompile | GradCache | per-mb loss | full batch | "
        "mbcompile / GradCache |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *mem_rows,
        "",
        f"Target (issue 13, item 5): mbcompile / GradCache <= {TARGET}.",
        "",
    ]
    return figures


def _sizes(slices: Slices) -> str:
    """Microbatch sizes as runs: '4 x 16' for four of 16, '2 x 16 + 2 x 15'."""
    runs: list[list[int]] = []
    for a, b in slices:
        if runs and runs[-1][1] == b - a:
            runs[-1][0] += 1
        else:
            runs.append([1, b - a])
    return " + ".join(f"{n} x {size}" for n, size in runs)


def _plan(text: str) -> tuple[int, int]:
    gbs, mbs = text.split(":")
    return int(gbs), int(mbs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--plans", type=_plan, nargs="+", default=[(64, 16), (62, 16), (64, 4)],
                        help="gbs:mbs pairs, one system each")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is steadiest on a shared 2-core machine)")
    return bench_main(parser, argv, lambda args, out: run(args.rounds, args.plans, out))


if __name__ == "__main__":
    sys.exit(main())
