"""Worker for tests/test_token_split.py's rank test (spawned ranks import it by name).

Each rank pads its share of a step's batch to its own length (``LENGTHS``), as a collator
on each rank does, and the compiled module chooses each rank's split from that length.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import make_tiny_gpt, token_batch
from mbcompile.planning.systems import SystemSpec

GBS, EXAMPLE, LONGEST = 7, 12, 40
#: per step, each rank's length: both short, both long, then rank 0 short and rank 1 long
LENGTHS = ((8, 8), (LONGEST, LONGEST), (8, LONGEST))
#: then rank 1's rows longer than any split holds (40 tokens per microbatch; 1.5 MB)
REFUSED = (8, 64)
#: the split policies a rank test may ask for: ``"tokens"``, 40 tokens per microbatch, cuts
#: a rank of 4 samples into one microbatch of 4 at length 8, four of 1 at length 40 (no
#: cost model: the cheap one); ``"auto"``, the largest MBS whose modelled peak fits the tiny
#: GPT's step (Adam) in 1.5 MB (test_token_split.BUDGET), cuts it the same way
POLICIES: dict[str, dict[str, Any]] = {
    "tokens": {"mbs": {"tokens": LONGEST}, "cost_model": False},
    "auto": {"mbs": "auto", "system": SystemSpec(
        "budget", memory_bytes=1.5e6, peak_flops=1e12, peak_flops_fp32=1e12,
        memory_bandwidth=1e11, optimizer_bytes_per_param=8)},
}


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch at the longest length (each rank cuts its own)."""
    return token_batch(GBS, LONGEST, seed=100 + step)


def split_steps(rank: int, world: int, out_dir: str, policy: str) -> None:
    """The tiny GPT (float64, the same init on every rank) compiled for ranks with
    ``POLICIES[policy]``; one step per entry of ``LENGTHS``, each from no gradients, on this
    rank's share cut to its length. Saves each step's loss, logits, gradients and plan."""
    model, _ = make_tiny_gpt(GBS, dtype=torch.float64, seq=64)
    cm = mbcompile.compile(model, GBS, world, dynamic=True, backend="torch.distributed",
                           **POLICIES[policy],
                           example_inputs=tuple(t[:, :EXAMPLE].contiguous() for t in step_batch(0)))
    steps = []
    for step, lengths in enumerate(LENGTHS):
        length = lengths[rank]
        ids, labels = (t[:, :length].contiguous()
                        for t in mbdist.shard(step_batch(step), cm.plan, rank))
        model.zero_grad(set_to_none=True)
        loss, logits = cm(ids, labels)
        loss.backward()
        steps.append({"loss": loss.detach(), "logits": logits.detach(),
                      "grads": {n: p.grad for n, p in model.named_parameters()},
                      "mbs": cm.plan.mbs, "microbatches": cm.plan.num_microbatches,
                      "share": cm.plan.per_system_batch_sizes[rank]})
    # rank 1's rows too long for any split: refused on rank 1, and every rank stops the step
    grads = [p.grad.clone() for p in model.parameters()]
    length = REFUSED[rank]
    ids, labels = (t[:, :length].contiguous() for t in mbdist.shard(
        token_batch(GBS, max(REFUSED), seed=99), cm.plan, rank))
    try:
        cm(ids, labels)
        refused: dict[str, Any] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test reads which, and its text
        refused = {"error": type(exc).__name__, "message": str(exc)}
    refused["unchanged"] = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # and the ranks step on together after it: the first step again, the same loss
    ids, labels = (t[:, :LENGTHS[0][rank]].contiguous()
                   for t in mbdist.shard(step_batch(0), cm.plan, rank))
    refused["loss_after"] = cm(ids, labels)[0].detach()
    torch.save({"steps": steps, "refused": refused}, os.path.join(out_dir, f"rank{rank}.pt"))
