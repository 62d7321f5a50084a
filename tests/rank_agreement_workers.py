"""Rank bodies for ``tests/test_rank_agreement.py``: each compares a compiled step on its
share with eager on the whole global batch, in this rank, in float64, and saves what it
found (``rank{r}.pt``: a list of mismatch messages, empty when all is exact)."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import distributed as mbdist

TOL = 1e-10
LENGTHS = ((6, 6), (6, 9), (7, 5), (8, 8))  # (rank 0, rank 1) per step: rank 1 recompiles
GBS = 8  # alone at step 1 (a new length), rank 0 alone at step 2


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc, self.ln = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(self.ln(h)))


class PooledRegressor(nn.Module):
    """Tokens, masked mean pool, head, MSE against one-hot labels: the count (B * 3) is
    fixed by the shapes, so no pre-pass counts it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).to(torch.float64).unsqueeze(-1)
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        pooled = (h * mask).sum(1) / mask.sum(1)
        return F.mse_loss(self.head(pooled), F.one_hot(y, 3).to(pooled.dtype))


class TokenRegressor(nn.Module):
    """MSE over every (sample, position, feature): the count follows each rank's length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.block = nn.Linear(4, 4), Block(4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.block(self.lin(x)), t)


class DrawNet(nn.Module):
    """Draws that read no sample: eager draws them once per step for the whole batch."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.g = kind, torch.Generator().manual_seed(7)
        self.inp, self.block, self.head = nn.Linear(4, 8), Block(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.block(self.inp(x))
        if self.kind == "rand":  # torch's generator, a per-sample keep mask
            h = h * (torch.rand(h.shape[0], 1) > 0.3)
        elif self.kind == "generator":  # the model's own generator
            h = h + 0.1 * torch.randn(h.shape, generator=self.g)
        elif self.kind == "randperm":  # in-batch negatives: a two-phase step
            e = F.normalize(h, dim=-1)
            neg = e[torch.randperm(e.shape[0])]
            h = h + 0.01 * torch.randperm(h.shape[0]).to(h.dtype).unsqueeze(1)
            margin = F.relu(0.5 - (e * e).sum(-1) + (e * neg).sum(-1)).mean()
            return margin + F.cross_entropy(self.head(h), y), self.head(h)
        logits = self.head(h)
        return F.cross_entropy(logits, y), logits


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _full(a).detach(), b.detach()
    if a.shape != b.shape:
        return float("inf")
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _compare(found: list[str], tag: str, model: nn.Module, eager: nn.Module,
             grads: bool = True) -> None:
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        if grads and (p.grad is None) != (q.grad is None):
            found.append(f"{tag} {name}.grad None-ness differs")
        elif grads and p.grad is not None and _rel(p.grad, q.grad) > TOL:
            found.append(f"{tag} {name}.grad rel {_rel(p.grad, q.grad):.2e}")
        if _rel(p, q) > TOL:
            found.append(f"{tag} {name} rel {_rel(p, q):.2e}")


def _in_sync(found: list[str], tag: str, model: nn.Module) -> None:
    """Every parameter bit-identical on every rank (full tensors under FSDP2)."""
    flat = torch.cat([_full(p.detach()).reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    if not all(torch.equal(every[0], x) for x in every):
        found.append(f"{tag} parameters differ between ranks")


def _tokens(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 11, (n, length), generator=g), torch.randint(0, 3, (n,), generator=g)


def _pooled(found: list[str], rank: int, mbs: Any, fsdp: bool) -> None:
    """The pooled regressor over ``LENGTHS``, each rank's rows padded to its own length;
    eager on the global batch padded to the longest (the mask makes it the same loss)."""
    torch.manual_seed(0)
    model = PooledRegressor()
    eager = copy.deepcopy(model)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    cm = mbcompile.compile(model, gbs=GBS, num_csx=2, mbs=mbs, example_inputs=_tokens(GBS, 6, 0),
                           cost_model=False, backend="torch.distributed")
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, eager))
    tag = f"pooled mbs={mbs} fsdp={fsdp}"
    for step, lengths in enumerate(LENGTHS):
        ids, y = _tokens(GBS, max(lengths), step + 1)
        rows = [mbdist.rank_slice(cm.plan, r) for r in range(2)]
        for r in range(2):
            ids[rows[r], lengths[r]:] = 0
        loss = cm(ids[rows[rank], :lengths[rank]], y[rows[rank]])
        loss.backward()
        want = eager(ids, y)
        want.backward()
        if _rel(loss, want) > TOL:
            found.append(f"{tag} step {step} loss {loss.item()} vs {want.item()}")
        _compare(found, f"{tag} step {step}", model, eager)
        for o in (opt, opt_e):
            o.step()
            o.zero_grad()
        _in_sync(found, f"{tag} step {step}", model)
    _compare(found, f"{tag} end", model, eager, grads=False)


def _token_mse(found: list[str], rank: int) -> None:
    """An MSE whose count follows the lengths, which differ between the ranks: the full
    batch's loss is every rank's squared error summed over every rank's elements."""
    torch.manual_seed(0)
    model = TokenRegressor()
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(GBS, 6, 4, generator=g), torch.randn(GBS, 6, 4, generator=g))
    cm = mbcompile.compile(model, gbs=GBS, num_csx=2, mbs=2, example_inputs=example,
                           cost_model=False, backend="torch.distributed")
    for step, lengths in enumerate(((6, 6), (6, 10), (9, 7))):
        g = torch.Generator().manual_seed(step + 1)
        x, t = (torch.randn(GBS, max(lengths), 4, generator=g) for _ in range(2))
        rows = [mbdist.rank_slice(cm.plan, r) for r in range(2)]
        loss = cm(x[rows[rank], :lengths[rank]], t[rows[rank], :lengths[rank]])
        loss.backward()
        xs = [x[rows[r], :lengths[r]] for r in range(2)]
        ts = [t[rows[r], :lengths[r]] for r in range(2)]
        want = sum(((eager.block(eager.lin(a)) - b) ** 2).sum() for a, b in zip(xs, ts)) \
            / sum(b.numel() for b in ts)
        want.backward()
        if _rel(loss, want) > TOL:
            found.append(f"token mse step {step} loss {loss.item()} vs {want.item()}")
        _compare(found, f"token mse step {step}", model, eager)
        _in_sync(found, f"token mse step {step}", model)  # (the grads: no optimizer here)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)


def _draws(found: list[str], rank: int, kind: str) -> None:
    """Two steps from torch's generator seeded alike on every rank: the loss, this rank's
    rows of the outputs (a two-phase step's are the whole batch's), every gradient and the
    generators after each step are eager's."""
    torch.manual_seed(0)
    model = DrawNet(kind)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    example = (torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g))
    cm = mbcompile.compile(model, gbs=GBS, num_csx=2, mbs=2, example_inputs=example,
                           cost_model=False, backend="torch.distributed")
    rows = mbdist.rank_slice(cm.plan, rank)
    for step in range(2):
        x, y = torch.randn(GBS, 4, generator=g), torch.randint(0, 3, (GBS,), generator=g)
        torch.manual_seed(100 + step)
        loss, out = cm(x[rows], y[rows])
        loss.backward()
        states = torch.get_rng_state(), model.g.get_state()
        torch.manual_seed(100 + step)
        want, want_out = eager(x, y)
        want.backward()
        tag = f"draw {kind} step {step}"
        if _rel(loss, want) > TOL:
            found.append(f"{tag} loss {loss.item()} vs {want.item()}")
        if _rel(out, want_out if out.shape == want_out.shape else want_out[rows]) > TOL:
            found.append(f"{tag} outputs differ from eager's")
        if not torch.equal(states[0], torch.get_rng_state()):
            found.append(f"{tag} torch's generator ends elsewhere than eager's")
        if not torch.equal(states[1], eager.g.get_state()):
            found.append(f"{tag} the model's generator ends elsewhere than eager's")
        _compare(found, tag, model, eager)
        _in_sync(found, tag, model)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)


def _saved(rank: int, out_dir: str, cases: list[Callable[[list[str]], None]]) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    found: list[str] = []
    for case in cases:
        case(found)
    torch.save(found, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()


def replicated(rank: int, world: int, out_dir: str) -> None:
    """Lengths per rank (int mbs, a token budget, a count that follows the lengths) and the
    draws, on replicated ranks."""
    _saved(rank, out_dir, [
        lambda f: _pooled(f, rank, 2, False),
        lambda f: _pooled(f, rank, {"tokens": 14}, False),
        lambda f: _token_mse(f, rank),
        *(lambda f, k=k: _draws(f, rank, k) for k in ("rand", "generator", "randperm"))])


def sharded(rank: int, world: int, out_dir: str) -> None:
    """Lengths per rank on an FSDP2-sharded model (int mbs and a token budget)."""
    _saved(rank, out_dir, [lambda f: _pooled(f, rank, 2, True),
                           lambda f: _pooled(f, rank, {"tokens": 14}, True)])
