"""Shared pieces of the benchmarks: the model, the contenders, timing and a live-bytes counter.

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

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from mbcompile.models import IGNORE_INDEX, TinyGPT, token_batch
from mbcompile.planning.measure import LiveBytes

__all__ = [
    "GBS",
    "GPT_CONFIG",
    "SYSTEMS",
    "LiveBytes",
    "Timings",
    "add_output_args",
    "alternate",
    "even_slices",
    "finish",
    "hand_infer",
    "hand_step",
    "machine",
    "make_gpt",
    "median",
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


# ------------------------------------------------------------------ the hand-written loop
def hand_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
              slices: Sequence[tuple[int, int]], keep_outputs: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One training step as a user writes it: exact token weights, one microbatch alive.

    The model's loss is the mean over a microbatch's real tokens; weighted by
    that microbatch's share of the global token count it becomes (sum of its
    token losses) / (global count), so the gradients add up to those of the
    full-batch mean. Returns what the model returns (loss, logits), like the
    compiled module, so both do the same work; logits are kept detached, as
    nothing backpropagates through them. ``keep_outputs=False`` drops each
    microbatch's logits instead and returns (loss, None): the loop to set beside
    ``compile(..., outputs="loss")``.
    """
    ids, labels = batch
    counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
    total = sum(counts)
    loss = torch.zeros(())
    outs = []
    for (a, b), count in zip(slices, counts):
        mean, logits = model(ids[a:b], labels[a:b])
        part = mean * (count / total)
        part.backward()
        loss += part.detach()
        if keep_outputs:
            outs.append(logits.detach())
    return loss, torch.cat(outs) if keep_outputs else None


def hand_infer(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               slices: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference over the same microbatches (call under ``torch.no_grad``)."""
    ids, labels = batch
    counts = [(labels[a:b] != IGNORE_INDEX).sum() for a, b in slices]
    total = sum(counts)
    loss = torch.zeros(())
    outs = []
    for (a, b), count in zip(slices, counts):
        mean, logits = model(ids[a:b], labels[a:b])
        loss += mean * (count / total)
        outs.append(logits)
    return loss, torch.cat(outs)


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
