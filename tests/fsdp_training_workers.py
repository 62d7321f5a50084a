"""A sharded-training model for tests/test_fsdp_training.py, referenced from YAML as
``fsdp_training_workers:Regressor`` (the test puts this folder on ``PYTHONPATH``), and
the rank functions that test spawns.

The model is float64 with a ``nn.ModuleList`` of blocks (one FSDP unit each when the
config says ``shard: fsdp``) and dropout, so a resume must restore every rank's torch
RNG; its data is ``checkpoint_workers:shuffled`` (a global-RNG shuffle once per pass,
Python and numpy noise, and ``MBC_SIGNAL_AT`` to signal the run at a chosen batch).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from checkpoint_workers import FEATURES, OUT

__all__ = ["Regressor", "reference_steps", "trainer_steps"]


class Block(nn.Module):
    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.ff(self.norm(h))))


class Regressor(nn.Module):
    """Input projection and head at the root, ``depth`` residual blocks in between."""

    def __init__(self, width: int = 8, depth: int = 2, p: float = 0.25) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width, p) for _ in range(depth))
        self.head = nn.Linear(width, OUT)
        self.double()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x.double())
        for block in self.blocks:
            h = block(h)
        pred = self.head(h)
        return F.mse_loss(pred, y.double()), pred


def _batches(gbs: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(gbs, FEATURES, generator=g), torch.randn(gbs, OUT, generator=g))
            for _ in range(steps)]


def trainer_steps(rank: int, world: int, out_dir: str, gbs: int, steps: int) -> None:
    """``Trainer(..., shard="fsdp")`` on this rank, from a model and an AdamW built the
    plain way: records the shards' types, the optimizer's parameters, each step's loss
    and the full parameters after the steps."""
    from torch.distributed.tensor import DTensor

    from mbcompile.training.flags import GlobalFlags
    from mbcompile.training.trainer import Trainer

    torch.manual_seed(0)
    model = Regressor(p=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = Trainer(model, opt, gbs=gbs, num_csx=world, backend="torch.distributed",
                      shard="fsdp", callbacks=[GlobalFlags(micro_batch_size=2)], progress=False)
    params = dict(model.named_parameters())
    rows = trainer.fit(_batches(gbs, steps))
    torch.save({
        "sharded": trainer.sharded and all(isinstance(p, DTensor) for p in params.values()),
        "optimizer_holds_shards": [id(p) for p in opt.param_groups[0]["params"]]
        == [id(p) for p in params.values()],
        "local_numel": sum(p.to_local().numel() for p in params.values()),
        "losses": [r["loss"] for r in rows],
        "params": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
    }, os.path.join(out_dir, f"rank{rank}.pt"))


def reference_steps(gbs: int, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same steps on one process, unsharded, full batch (no microbatches)."""
    torch.manual_seed(0)
    model = Regressor(p=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in _batches(gbs, steps):
        opt.zero_grad(set_to_none=True)
        loss, _ = model(x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in model.named_parameters()}

