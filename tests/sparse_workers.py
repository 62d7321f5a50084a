"""Rank workers for tests/test_sparse_ranks.py: sparse embedding gradients on real ranks.

Each worker trains a float64 model of ``SparseNet`` two steps on this rank's share and
saves, per step, the loss and every gradient (its layout and its dense value, None kept),
and the parameters after the optimizers' two steps; the test runs the same steps eagerly
on the whole batch in one process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import distributed as mbdist

GBS, MBS, STEPS = 7, 2, 2


class SparseNet(nn.Module):
    """``kind``: "module" (``nn.Embedding(sparse=True)``), "functional" (also
    ``F.embedding(..., sparse=True)`` of a parameter), "tied" (the sparse embedding's weight
    is the head's too: its gradient is dense), "coupled" (a batch-coupled loss: two-phase)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.e = nn.Embedding(20, 4, sparse=True)
        self.w = nn.Parameter(torch.randn(20, 4)) if kind == "functional" else None
        self.head = nn.Linear(4, 20)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.e(ids).mean(1)
        if self.kind == "functional":
            h = h + F.embedding(ids, self.w, sparse=True).mean(1)
        if self.kind == "coupled":
            z = F.normalize(h, dim=-1)
            return torch.logsumexp(z @ z.t(), 1).mean()
        logits = F.linear(h, self.e.weight) if self.kind == "tied" else self.head(h)
        return F.cross_entropy(logits, y)


def model_of(kind: str) -> SparseNet:
    torch.manual_seed(0)
    return SparseNet(kind).to(torch.float64)


def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, 20, (GBS, 3), generator=g), torch.randint(0, 20, (GBS,), generator=g)


def optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """SparseAdam for the sparse embeddings' weights (where the gradient is sparse), SGD
    with momentum for the rest."""
    sparse = [] if model.kind == "tied" else [model.e.weight] + (
        [model.w] if model.w is not None else [])
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    return ([torch.optim.SparseAdam(sparse, lr=0.1)] if sparse else []) + [
        torch.optim.SGD(dense, lr=0.1, momentum=0.9)]


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if hasattr(t, "full_tensor"):  # an FSDP2 shard
        t = t.full_tensor()
    return t.to_dense() if t.is_sparse else t.detach().clone()


def record(model: nn.Module, call: Any, batches: list[tuple[torch.Tensor, ...]]) -> dict:
    """Two steps of ``call`` (zero_grad, forward, backward, step); what the test compares."""
    opts = optimizers(model)
    out: dict[str, Any] = {"loss": [], "grads": [], "layouts": []}
    for batch in batches:
        for opt in opts:
            opt.zero_grad()
        loss = call(*batch)
        loss.backward()
        out["loss"].append(loss.detach().clone())
        out["grads"].append({n: _full(p.grad) for n, p in model.named_parameters()})
        out["layouts"].append({n: None if p.grad is None else str(p.grad.layout)
                               for n, p in model.named_parameters()})
        for opt in opts:
            opt.step()
    out["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return out


def sparse_steps(rank: int, world: int, out_dir: str, kind: str, capture: str,
                 overlap: bool, fsdp: bool) -> None:
    """Two compiled steps on this rank's share (``fsdp``: the head sharded, the sparse
    embedding kept out of the shards with ``ignored_params``)."""
    mbdist.OVERLAP = overlap
    model = model_of(kind)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.head)
        fully_shard(model, ignored_params={model.e.weight})
    cm = mbcompile.compile(model, GBS, world, MBS, example_inputs=batch_of(0), capture=capture,
                           backend="torch.distributed", cost_model=False)
    got = record(model, cm, [mbdist.shard(batch_of(s), cm.plan, rank) for s in range(STEPS)])
    got["two_phase"] = "two-phase" in cm.plan.to_dict()["reason"]
    torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))


def sharded_sparse_refused(rank: int, world: int, out_dir: str) -> None:
    """A sparse embedding inside FSDP2's shards: compile refuses it, changing nothing."""
    from torch.distributed.fsdp import fully_shard

    model = model_of("module")
    fully_shard(model)
    before = {n: _full(p) for n, p in model.named_parameters()}
    try:
        mbcompile.compile(model, GBS, world, MBS, example_inputs=batch_of(0),
                          backend="torch.distributed", cost_model=False)
        outcome = "compiled"
    except mbcompile.MbcompileError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    same = all(torch.equal(before[n], _full(p)) for n, p in model.named_parameters())
    grads = [p.grad for p in model.parameters()]
    torch.save({"outcome": outcome, "same": same, "grads": grads},
               os.path.join(out_dir, f"rank{rank}.pt"))
