"""Worker for tests/test_token_split.py's rank test (spawned ranks import it by name).

Each rank pads its share of a step's batch to its own length (``LENGTHS``), as a collator
on each rank does, and the compiled module chooses each rank's split from that length.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

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
    rank's share cut to its length. Saves each step's loss, logits, gradients and plan (and
    with a token budget, ``two_phase_steps``': one process of ranks for both, to save time)."""
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
    grads = [p.grad.clone() for p in model.parameters()]
    refused = _refused_call(cm, rank, lambda: all(
        torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads)))
    two_phase = two_phase_steps(rank, world) if policy == "tokens" else None
    torch.save({"steps": steps, "refused": refused, "two_phase": two_phase},
               os.path.join(out_dir, f"rank{rank}.pt"))


def fsdp_split_steps(rank: int, world: int, out_dir: str, policy: str = "tokens") -> None:
    """``split_steps``' steps with the tiny GPT sharded by FSDP2 (each block, then the root)
    and ``POLICIES[policy]``: each rank cuts its own length, and the rank with fewer
    microbatches runs its last one again with weight 0 so that both run FSDP's collectives
    in step. Saves each step's loss, logits, full gradients and split, the collectives
    counted, and the modelled peak of the split at the call's length (None: no model)."""
    from fsdp_workers import Comms, shard

    model, _ = make_tiny_gpt(GBS, dtype=torch.float64, seq=64)
    net = shard(model)
    cm = mbcompile.compile(net, GBS, world, dynamic=True, backend="torch.distributed",
                           **POLICIES[policy],
                           example_inputs=tuple(t[:, :EXAMPLE].contiguous() for t in step_batch(0)))
    steps = []
    for step, lengths in enumerate(LENGTHS):
        ids, labels = (t[:, :lengths[rank]].contiguous()
                       for t in mbdist.shard(step_batch(step), cm.plan, rank))
        net.zero_grad(set_to_none=True)
        with Comms() as comms:
            loss, logits = cm(ids, labels)
            loss.backward()
        steps.append({"loss": loss.detach(), "logits": logits.detach(),
                      "grads": {n: p.grad.full_tensor() for n, p in net.named_parameters()},
                      "mbs": cm.plan.mbs, "microbatches": cm.plan.num_microbatches,
                      "share": cm.plan.per_system_batch_sizes[rank], "counts": comms.counts,
                      "peak": None if cm.estimate is None else cm.estimate.memory.peak})
    # rank 0 runs its rounds while rank 1 refuses and joins them on zeros
    for p in net.parameters():
        p.grad = torch.full_like(p, 7.0)
    refused = _refused_call(cm, rank, lambda: all(
        bool((p.grad.full_tensor() == 7.0).all()) for p in net.parameters()))
    torch.save({"steps": steps, "refused": refused}, os.path.join(out_dir, f"rank{rank}.pt"))


def _refused_call(cm: Any, rank: int, unchanged: Any) -> dict[str, Any]:
    """Rank 1's rows too long for any split: refused on rank 1, and every rank stops the
    step; which error each rank raised and its text, ``unchanged()`` after it, and the loss
    of the first step run again after it (the ranks step on together)."""
    ids, labels = (t[:, :REFUSED[rank]].contiguous() for t in mbdist.shard(
        token_batch(GBS, max(REFUSED), seed=99), cm.plan, rank))
    try:
        cm(ids, labels)
        refused: dict[str, Any] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test reads which, and its text
        refused = {"error": type(exc).__name__, "message": str(exc)}
    refused["unchanged"] = unchanged()
    ids, labels = (t[:, :LENGTHS[0][rank]].contiguous()
                   for t in mbdist.shard(step_batch(0), cm.plan, rank))
    refused["loss_after"] = cm(ids, labels)[0].detach()
    return refused


class RootGPT(nn.Module):
    """The tiny GPT's loss under a square root: a function of the batch mean, so the step
    runs two-phase."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        loss, logits = self.gpt(ids, labels)
        return loss.sqrt(), logits


#: ``two_phase_steps``' steps per outputs, as (``step_batch``'s step, each rank's length):
#: the loss only at two lengths; the logits too at two lengths (refused: rank 0 at the
#: example's, so that it runs the module compiled for it while rank 1 runs the one its
#: length made symbolic) and at one
TWO_PHASE_STEPS = {"loss": ((2, (8, LONGEST)),),
                   "all": ((2, (EXAMPLE, LONGEST)), (1, (LONGEST, LONGEST)))}


def two_phase_steps(rank: int, world: int) -> dict[str, Any]:
    """``RootGPT`` (float64) compiled for ranks with a token budget (``POLICIES["tokens"]``),
    returning the loss only (``dynamic=True``), then the logits too (``"auto"``); the steps
    of ``TWO_PHASE_STEPS`` with each, each from no gradients, on this rank's share cut to
    its length, then a step with rank 1's rows too long for any split (``REFUSED``). Then,
    returning the logits, rank 1 fails in phase 1 of a step at the longest length (not the
    example's), and both ranks step on after it. Each step's loss, logits and plan, or its
    error and whether no gradient appeared."""
    saved: dict[str, Any] = {}
    for outputs, steps in TWO_PHASE_STEPS.items():
        model = RootGPT(make_tiny_gpt(GBS, dtype=torch.float64, seq=64)[0])
        cm = mbcompile.compile(model, GBS, world, dynamic=True if outputs == "loss" else "auto",
                               backend="torch.distributed", outputs=outputs,
                               **POLICIES["tokens"], example_inputs=tuple(
                                   t[:, :EXAMPLE].contiguous() for t in step_batch(0)))
        saved[outputs] = {k: _two_phase_step(cm, model, step_batch(step), lengths[rank], rank)
                          for k, (step, lengths) in enumerate(steps)}
        saved[outputs]["refused"] = _two_phase_step(
            cm, model, token_batch(GBS, max(REFUSED), seed=99), REFUSED[rank], rank)

    def fail(module: nn.Module, args: Any) -> None:
        if rank == 1 and not torch.is_grad_enabled():
            raise RuntimeError("injected failure in phase 1")

    hook = model.gpt.head.register_forward_pre_hook(fail)
    saved["failed"] = _two_phase_step(cm, model, step_batch(1), LONGEST, rank)
    hook.remove()
    saved["after"] = _two_phase_step(cm, model, step_batch(0), LENGTHS[0][rank], rank)
    return saved


def _two_phase_step(cm: Any, model: nn.Module, batch: Any, length: int, rank: int
                    ) -> dict[str, Any]:
    ids, labels = (t[:, :length].contiguous() for t in mbdist.shard(batch, cm.plan, rank))
    model.zero_grad(set_to_none=True)
    try:
        loss, logits = cm(ids, labels)
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the test reads which, and its text
        return {"error": type(exc).__name__, "message": str(exc),
                "unchanged": all(p.grad is None for p in model.parameters())}
    return {"loss": loss.detach(), "logits": None if logits is None else logits.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "share": cm.plan.per_system_batch_sizes[rank], "mbs": cm.plan.mbs,
            "microbatches": cm.plan.num_microbatches}
