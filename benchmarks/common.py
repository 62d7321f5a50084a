"""Shared pieces of the benchmarks: the models, the contenders, timing and a live-bytes counter.

Every benchmark compares mbcompile against what a careful user writes by hand,
on the same microbatch sizes, so the only difference is mbcompile itself:

    hand_step(model, batch, slices)      # the loop a user writes (exact token weights)
    compiled(ids, labels)                # mbcompile.compile(model, gbs, 2, mbs)

``alternate`` times the contenders in turn, one step each, round after round, so
that a burst of load from another process hits all of them alike; the figure of
each is its median. ``LiveBytes`` counts the bytes of tensor storages alive at
each moment and keeps the peak, which is exact where RSS is not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from mbcompile.models import IGNORE_INDEX, TinyGPT, token_batch
from mbcompile.planning.measure import LiveBytes

__all__ = [
    "GBS",
    "GPT_CONFIG",
    "HF_ARCHS",
    "HF_GBS",
    "HF_LAYERS",
    "HF_SEQ",
    "HF_WIDTH",
    "SYSTEMS",
    "LiveBytes",
    "Timings",
    "add_output_args",
    "alternate",
    "bench_main",
    "build_hf",
    "even_slices",
    "finish",
    "hand_infer",
    "hand_step",
    "hf_parser",
    "machine",
    "make_gpt",
    "median",
    "on_two_ranks",
    "paired_ratio",
    "plain_step",
]

#: The small GPT of issue 7: 4 layers, width 256, sequence 128, vocabulary 1000.
GPT_CONFIG = dict(vocab=1000, width=256, depth=4, heads=4, seq=128)
GBS, SYSTEMS = 32, 2


def make_gpt(batch: int = GBS, seed: int = 0, **overrides: int
             ) -> tuple[TinyGPT, tuple[torch.Tensor, torch.Tensor]]:
    """The benchmark GPT and one padded token batch (samples hold different token counts)."""
    config = {**GPT_CONFIG, **overrides}
    torch.manual_seed(seed)
    model = TinyGPT(**config)
    return model, token_batch(batch, config["seq"], config["vocab"], seed=seed + 1)


def even_slices(gbs: int, systems: int, mbs: int) -> list[tuple[int, int]]:
    """(start, stop) of every microbatch, as mbcompile's plan cuts them.

    Taken from the plan itself so both contenders run the very same sizes.
    """
    from mbcompile.planning.plan import make_plan

    plan = make_plan(gbs, systems, mbs)
    return [(a, b) for system in plan.microbatch_slices for a, b in system if b > a]


# ------------------------------------------------------------ the transformers models
#: bench_memory_accuracy's and bench_auto_time's five architectures (issue 34): 4 layers,
#: width 256, sequence 128, each config's own vocabulary, gbs 16.
HF_GBS, HF_SEQ, HF_LAYERS, HF_WIDTH, HF_HEADS = 16, 128, 4, 256, 4


def _hf_config(arch: str, width: int, vocab: int | None) -> tuple[str, str, dict[str, Any]]:
    """(model class, config class, config) of ``arch`` at ``width`` (``vocab`` None: the
    config's own vocabulary)."""
    common: dict[str, Any] = dict(pad_token_id=0)
    if vocab is not None:
        common["vocab_size"] = vocab
    if arch == "gpt2":
        return "GPT2LMHeadModel", "GPT2Config", dict(
            common, n_embd=width, n_layer=HF_LAYERS, n_head=HF_HEADS, n_positions=HF_SEQ,
            bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return "LlamaForCausalLM", "LlamaConfig", dict(
            common, hidden_size=width, intermediate_size=4 * width,
            num_hidden_layers=HF_LAYERS, num_attention_heads=HF_HEADS, num_key_value_heads=HF_HEADS,
            max_position_embeddings=HF_SEQ, bos_token_id=1, eos_token_id=2)
    if arch == "bert":
        return "BertForMaskedLM", "BertConfig", dict(
            common, hidden_size=width, intermediate_size=4 * width,
            num_hidden_layers=HF_LAYERS, num_attention_heads=HF_HEADS,
            max_position_embeddings=HF_SEQ)
    if arch == "t5":
        return "T5ForConditionalGeneration", "T5Config", dict(
            common, d_model=width, d_kv=width // HF_HEADS, d_ff=4 * width,
            num_layers=HF_LAYERS // 2, num_decoder_layers=HF_LAYERS // 2, num_heads=HF_HEADS,
            eos_token_id=1, decoder_start_token_id=0)
    if arch == "vit":
        return "ViTForImageClassification", "ViTConfig", dict(
            image_size=64, patch_size=8, num_channels=3, hidden_size=width,
            num_hidden_layers=HF_LAYERS, num_attention_heads=HF_HEADS,
            intermediate_size=4 * width, num_labels=10)
    raise ValueError(f"unknown architecture {arch!r}")


HF_ARCHS = ("gpt2", "llama", "bert", "t5", "vit")


def build_hf(arch: str, width: int = HF_WIDTH, gbs: int = HF_GBS, vocab: int | None = None
             ) -> tuple[torch.nn.Module, dict]:
    """The model of ``arch`` (float32, dropout 0, training mode) and a batch of ``gbs``
    samples: ``model(**batch)`` returns the loss.

    >>> model, batch = build_hf("llama")
    >>> sorted(batch)
    ['attention_mask', 'input_ids', 'labels']
    """
    import transformers

    model_class, config_class, config = _hf_config(arch, width, vocab)
    cfg = getattr(transformers, config_class)(**config)
    for key, value in cfg.to_dict().items():
        if "drop" in key and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).float().train()
    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        return model, {"pixel_values": torch.randn(gbs, 3, 64, 64, generator=g),
                       "labels": torch.randint(0, 10, (gbs,), generator=g)}
    ids = torch.randint(3, cfg.vocab_size, (gbs, HF_SEQ), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "labels": ids.clone()}


# ------------------------------------------------------------------ the hand-written loop
def hand_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
              slices: Sequence[tuple[int, int]], keep_outputs: bool = True,
              scale: Callable[[torch.Tensor], torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One training step as a user writes it: exact token weights, one microbatch alive.

    The model's loss is the mean over a microbatch's real tokens; weighted by
    that microbatch's share of the global token count it becomes (sum of its
    token losses) / (global count), so the gradients add up to those of the
    full-batch mean. Returns what the model returns (loss, logits), like the
    compiled module, so both do the same work; logits are kept detached, as
    nothing backpropagates through them. ``keep_outputs=False`` drops each
    microbatch's logits instead and returns (loss, None): the loop to set beside
    ``compile(..., outputs="loss")``. ``scale``: what each part is backpropagated as (a
    ``GradScaler``'s ``scale``).
    """
    loss = torch.zeros((), device=batch[0].device)
    outs = []
    for part, logits in _token_weighted(model, batch, slices):
        (part if scale is None else scale(part)).backward()
        loss += part.detach()
        if keep_outputs:
            outs.append(logits.detach())
    return loss, torch.cat(outs) if keep_outputs else None


def hand_infer(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               slices: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference over the same microbatches (call under ``torch.no_grad``)."""
    loss = torch.zeros((), device=batch[0].device)
    outs = []
    for part, logits in _token_weighted(model, batch, slices):
        loss += part
        outs.append(logits)
    return loss, torch.cat(outs)


def _token_weighted(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                    slices: Sequence[tuple[int, int]]
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each microbatch's forward, one at a time as the caller asks: its mean loss weighted
    by its share of the global count of real tokens, and its logits."""
    ids, labels = batch
    counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
    total = sum(counts)
    for (a, b), count in zip(slices, counts):
        mean, logits = model(ids[a:b], labels[a:b])
        yield mean * (count / total), logits


def plain_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """The full batch at once: the memory a user saves by microbatching."""
    loss, logits = model(*batch)
    loss.backward()
    return loss, logits


# ------------------------------------------------------------------------------- timing
def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


@dataclass
class Timings:
    """Seconds per call of each contender: wall clock and this process's CPU time."""

    wall: dict[str, list[float]]
    cpu: dict[str, list[float]]


def alternate(contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
              before: Callable[[], None] | None = None) -> Timings:
    """Time each contender in turn, one call each per round (the order rotates each round).

    ``before`` runs untimed before every call (e.g. setting gradients to None).
    Both clocks are kept: with one torch thread, the process's CPU time is the
    work done and stays steady when other processes take the cores; wall time is
    what a user waits, and on a shared machine it mostly measures the neighbours.
    """
    names = list(contenders)
    out = Timings({n: [] for n in names}, {n: [] for n in names})
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()  # what exists now is never scanned again: a collection below costs µs, not 0.2 s
    try:
        for r in range(warmup + rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if before is not None:
                    before()
                gc.collect()  # as timeit does: no collection pause lands in one contender's time
                gc.disable()
                c0, t0 = time.process_time(), time.perf_counter()
                contenders[name]()
                t1, c1 = time.perf_counter(), time.process_time()
                gc.enable()
                if r >= warmup:
                    out.wall[name].append(t1 - t0)
                    out.cpu[name].append(c1 - c0)
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
    return out


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of round-by-round ratios a/b: robust to load that drifts between rounds."""
    return statistics.median(x / y for x, y in zip(a, b))


# --------------------------------------------------------------------- live tensor bytes
# ---------------------------------------------------------------------------- output
def finish(out: list[str], figures: dict[str, Any], markdown: str | None,
           json_path: str | None) -> int:
    """Print the section; append it to ``markdown`` and write ``figures`` to ``json_path``."""
    text = "\n".join(out)
    print(text)
    if markdown:
        with open(markdown, "a") as f:
            f.write(text + "\n")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


def add_output_args(parser: Any) -> None:
    parser.add_argument("--markdown", help="append the markdown section to this file")
    parser.add_argument("--json", help="write the headline figures to this file")


def hf_parser(description: str) -> argparse.ArgumentParser:
    """A parser with ``--arch``: one or more of ``HF_ARCHS`` (all by default)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", nargs="+", default=list(HF_ARCHS), choices=HF_ARCHS)
    return parser


def bench_main(parser: argparse.ArgumentParser, argv: list[str] | None,
               run: Callable[[argparse.Namespace, list[str]], dict[str, Any]]) -> int:
    """A benchmark's ``main``: parse ``argv`` (``--markdown`` and ``--json`` added), take
    ``args.threads`` torch threads (1 where the benchmark has no ``--threads``), and
    ``finish`` with the lines ``run(args, out)`` appends to ``out`` and the figures it
    returns.

    >>> bench_main(argparse.ArgumentParser(), [], lambda args, out: out.append("# x") or {})
    # x
    0
    """
    add_output_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(getattr(args, "threads", 1))
    out: list[str] = []
    figures = run(args, out)
    return finish(out, figures, args.markdown, args.json)


# ----------------------------------------------------------------------- two gloo ranks
def on_two_ranks(rank_fn: Callable[..., None], *args: Any) -> dict[str, Any]:
    """Run ``rank_fn(rank, world, out, *args)`` on two gloo ranks
    (``mbcompile.execution.distributed.launch``) and return the JSON rank 0 wrote to
    ``out``."""
    from mbcompile.execution import distributed as mbdist

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mbdist.launch(rank_fn, 2, out, *args, timeout_s=600.0)
        with open(out) as f:
            return json.load(f)


# ------------------------------------------------------------------------ the machine
def machine() -> dict[str, str]:
    """CPU model, cores, load, versions: what RESULTS.md records."""
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import mbcompile

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    src = os.path.dirname(os.path.dirname(os.path.abspath(mbcompile.__file__)))
    try:
        git = ["git", "-C", src]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "mbcompile", "passes"],
                               capture_output=True, text=True, check=True).stdout.strip()
        revision = head + (" with uncommitted changes in mbcompile/ or passes/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        revision = "unknown (not a git checkout)"
    return {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "load (1, 5, 15 min)": ", ".join(f"{x:.2f}" for x in load),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mbcompile": f"{getattr(mbcompile, '__version__', '?')} from {src}, git {revision}",
        "platform": platform.platform(),
    }


if __name__ == "__main__":  # a quick self-check of the byte counter
    with LiveBytes() as mem:
        a = torch.ones(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = a + 1  # 4000 more
        del c
    print(mem.peak, mem.live, b.shape, file=sys.stderr)
