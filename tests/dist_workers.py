"""Worker functions for tests/test_distributed.py (spawned ranks import them by name)."""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import make_tiny_gpt


def train_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int,
               bucket_bytes: int) -> None:
    """One compiled training step on this rank's share; saves loss, grads, call counts."""
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)  # same seed: same init everywhere
    mbdist.BUCKET_BYTES = bucket_bytes
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed")
    local = mbdist.shard(batch, cm.plan, rank)
    loss, logits = cm(*local)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    try:
        loss.backward()
    finally:
        dist.all_reduce = real
    grads = {n: p.grad for n, p in model.named_parameters()}
    buckets = len(list(mbdist.gradient_buckets([g for g in grads.values() if g is not None],
                                               bucket_bytes)))
    torch.save({"loss": loss.detach(), "logits": logits.detach(), "grads": grads,
                "calls": len(calls), "buckets": buckets, "plan": cm.plan.to_dict()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def failing_step(rank: int, world: int, out_dir: str, gbs: int) -> None:
    """Rank 1 raises inside its second microbatch; every rank records what it saw."""
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    cm = mbcompile.compile(model, gbs, world, 1, example_inputs=batch,
                           backend="torch.distributed")
    calls = {"n": 0}

    def explode(module, args):
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            raise RuntimeError("injected failure on rank 1")

    model.head.register_forward_pre_hook(explode)
    try:
        loss, _ = cm(*mbdist.shard(batch, cm.plan, rank))
        loss.backward()
        outcome = "no error"
    except Exception as exc:  # what each rank saw is the test's result
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=1)}"
    grads_untouched = all(p.grad is None for p in model.parameters())
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{grads_untouched}\n{outcome}")


def counted_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """One training step whose host reads are counted (tests/test_host_sync.py)."""
    from host_reads import HostReads

    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed")
    local = mbdist.shard(batch, cm.plan, rank)
    loss, _ = cm(*local)  # the first call compiles; count a later step
    loss.backward()
    with HostReads() as reads:
        loss, _ = cm(*local)
        loss.backward()
    torch.save({"reads": reads.total, "detail": dict(reads.ops),
                "microbatches": cm.plan.num_microbatches},
               os.path.join(out_dir, f"rank{rank}.pt"))


def state_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """One step of a model that updates a buffer from the batch mean (tests/test_state.py)."""
    from test_state import NoGradCentre, _batch

    torch.manual_seed(0)
    model = NoGradCentre().to(torch.float64)
    batch = _batch(gbs)
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed")
    cm(*mbdist.shard(batch, cm.plan, rank)).backward()
    torch.save({k: v.clone() for k, v in model.state_dict().items()},
               os.path.join(out_dir, f"rank{rank}.pt"))
