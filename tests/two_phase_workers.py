"""Models and rank workers for tests/test_two_phase_distributed.py (spawned ranks import
them by name): losses that couple samples, one two-phase step on each rank's share."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import distributed as mbdist


class Clip(nn.Module):
    """Symmetric InfoNCE over the batch with a learned logit scale (a parameter of C)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(5, 4)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        u, v = F.normalize(self.a(x), dim=-1), F.normalize(self.b(y), dim=-1)
        logits = u @ v.T * self.scale.exp()
        labels = torch.arange(x.size(0))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class Centered(nn.Module):
    """A representation centred over the batch (F holds per-sample rows and a partial sum),
    and the root of a mean squared error (a non-linear function of a batch reduction)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(6, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.f(x)
        h = h - h.mean(0)
        return F.mse_loss(self.g(torch.tanh(h)).squeeze(-1), y[:, 0]).sqrt()


MODELS = {"clip": Clip, "centered": Centered}


def make(name: str, gbs: int) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (same seed: same weights on every rank) and a float64 batch of ``gbs``."""
    torch.manual_seed(0)
    model = MODELS[name]().double()
    batch = (torch.randn(gbs, 6, dtype=torch.float64), torch.randn(gbs, 5, dtype=torch.float64))
    return model, batch


def step(rank: int, world: int, out_dir: str, name: str, gbs: int, mbs: int) -> None:
    """One two-phase step on this rank's share; saves the loss and the gradients."""
    model, batch = make(name, gbs)
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed", coupling="two_phase")
    loss = cm(*mbdist.shard(batch, cm.plan, rank))
    loss.backward()
    torch.save({"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()},
                "reason": cm.plan.reason}, os.path.join(out_dir, f"rank{rank}.pt"))


def _raise(rank: int, phase: int) -> None:
    if rank == 1:
        raise RuntimeError(f"injected failure in phase {phase}")


def failing_step(rank: int, world: int, out_dir: str, name: str, gbs: int, phase: int) -> None:
    """Rank 1 fails in ``phase`` (1: P without grad, 2: C, 3: P with grad; 0: P in a call
    under torch.no_grad()); every rank must raise and keep its parameters and gradients."""
    model, batch = make(name, gbs)
    cm = mbcompile.compile(model, gbs, world, 2, example_inputs=batch,
                           backend="torch.distributed", coupling="two_phase")
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}

    def fail(module: nn.Module, args: object) -> None:
        if rank == 1 and torch.is_grad_enabled() == (phase == 3):
            raise RuntimeError(f"injected failure in phase {phase}")
        if rank == 1 and phase == 0:
            raise RuntimeError("injected failure in phase 0")

    if phase == 2:  # C: the centred model's head runs once, on the whole batch
        model.g.register_forward_pre_hook(lambda m, a: _raise(rank, phase))
    else:
        (model.a if name == "clip" else model.f).register_forward_pre_hook(fail)
    error = ""
    try:
        if phase == 0:
            with torch.no_grad():
                cm(*mbdist.shard(batch, cm.plan, rank))
        else:
            cm(*mbdist.shard(batch, cm.plan, rank)).backward()
    except mbcompile.MicrobatchError as exc:
        error = str(exc)
    kept = all(torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1])
               for n, p in model.named_parameters())
    torch.save({"error": error, "kept": kept}, os.path.join(out_dir, f"rank{rank}.pt"))


def counted_step(rank: int, world: int, out_dir: str, name: str, gbs: int, mbs: int) -> None:
    """Two steps; counts the device-to-host reads (the status check) of each."""
    from mbcompile.execution import runtime

    model, batch = make(name, gbs)
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed", coupling="two_phase")
    real, reads = runtime.read_host, []

    def counted(t):
        reads.append(t.numel())
        return real(t)

    runtime.read_host = counted
    counts = []
    for _ in range(2):
        start = len(reads)
        cm(*mbdist.shard(batch, cm.plan, rank)).backward()
        counts.append(len(reads) - start)
    runtime.read_host = real
    torch.save({"reads": counts}, os.path.join(out_dir, f"rank{rank}.pt"))


def families_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """One two-phase step of every family of tests/coupled_models.py on this rank's share:
    the loss, the gradients and the buffers (BatchNorm's running statistics) of each."""
    from coupled_models import COUPLED

    results = {}
    for family, make in COUPLED.items():
        model, batch = make(gbs)
        cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                               backend="torch.distributed", coupling="two_phase")
        out = cm(*mbdist.shard(batch, cm.plan, rank))
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        rest = [o.detach() for o in out[1:]] if isinstance(out, tuple) else []
        results[family] = {"loss": loss.detach(), "two_phase": "two-phase" in cm.plan.reason,
                           "outputs": rest,
                           "rows": (lambda s: (s.start, s.stop))(mbdist.rank_slice(cm.plan, rank)),
                           "grads": {n: p.grad for n, p in model.named_parameters()},
                           "buffers": {n: b.clone() for n, b in model.named_buffers()}}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def mixtral_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int) -> None:
    """Mixtral (float32) with its router aux loss, the global-batch load-balancing loss, as
    a two-phase step on this rank's share: the loss, the aux loss and the gradients."""
    import transformers
    import zoo

    transformers.logging.set_verbosity_error()
    build = zoo.hf("MixtralForCausalLM", "MixtralConfig", dtype=torch.float32,
                   **{**zoo.MOE, "output_router_logits": True, "router_aux_loss_coef": 1.0})
    model = build()
    batch = {**zoo.tokens(gbs), "use_cache": False}
    cm = mbcompile.compile(model, gbs, world, mbs, example_kwargs=batch,
                           backend="torch.distributed", coupling="two_phase", outputs="loss")
    local = {k: mbdist.shard(v, cm.plan, rank) if isinstance(v, torch.Tensor) else v
             for k, v in batch.items()}
    out = cm(**local)
    out.loss.backward()
    torch.save({"loss": out.loss.detach(), "two_phase": "two-phase" in cm.plan.reason,
                "grads": {n: p.grad for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))
