"""A training script as people write it for a launcher, run by tests/test_launchers.py:

    python -m torch.distributed.run --standalone --nproc-per-node 2 compile_on_ranks.py OUT
    accelerate launch --cpu --num_processes 2 compile_on_ranks.py OUT

It joins the launcher's group itself (``dist.init_process_group("gloo")``), compiles the
tiny GPT (float64, padded targets) for gbs 8 over 2 systems WITHOUT ``backend=``, feeds
each rank its share (``mbcompile.distributed.shard``) and takes 2 SGD steps. Each rank
also takes the same 2 steps eagerly on the whole batch (one process's full-batch
reference) and writes ``OUT/rank<r>.json``: the backend the compile chose, the largest
difference from the reference (parameters and the last loss) and whether every rank
holds bit-identical parameters.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import mbcompile
from mbcompile.models import make_tiny_gpt, token_batch

GBS, NUM_CSX, MBS, STEPS, LR = 8, 2, 2, 2, 0.5


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, example = make_tiny_gpt(GBS, seed=0, dtype=torch.float64)
    reference = copy.deepcopy(model)  # eager, the whole batch, in this one process
    cm = mbcompile.compile(model, gbs=GBS, num_csx=NUM_CSX, mbs=MBS, example_inputs=example)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    loss_diff = 0.0
    for step in range(STEPS):
        ids, labels = token_batch(GBS, seed=10 + step)  # every rank draws the global batch
        mine = mbcompile.distributed.shard((ids, labels), cm.plan, rank)
        opt.zero_grad(set_to_none=True)
        loss, _ = cm(*mine)
        loss.backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_loss, _ = reference(ids, labels)
        ref_loss.backward()
        ref_opt.step()
        loss_diff = max(loss_diff, (loss.detach() - ref_loss.detach()).abs().item())
    ref = dict(reference.named_parameters())
    param_diff = max((p.detach() - ref[n].detach()).abs().max().item()
                     for n, p in model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "backend": cm.backend, "world": dist.get_world_size(), "loss_diff": loss_diff,
        "param_diff": param_diff, "identical": identical,
        "mbs": cm.plan.mbs, "sizes": list(cm.plan.per_system_batch_sizes)}))
    # every rank done before any leaves: a rank that destroys its group while another's gloo
    # threads still use the connections can make that one abort at exit ("terminate called
    # without an active exception", seen once in CI), as mbcompile's own fit avoids
    # (``world.leave_launcher_group``)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
