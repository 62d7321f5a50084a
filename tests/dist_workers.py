"""Worker functions for tests/test_distributed.py (spawned ranks import them by name)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from faults import on_output_gradient

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.models import make_tiny_gpt
from mbcompile.planning import buckets


class Collectives:
    """Records every ``dist.all_reduce`` call in order, beside the test's own markers.

    ``with Collectives() as log:``; then ``log.events``: ``("reduce", numel, dtype,
    async_op)`` per call and whatever ``log.mark(...)`` added (gradient arrivals,
    microbatch forwards, the user's ``backward``), in the order they happened.
    """

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def mark(self, *event: object) -> None:
        self.events.append(event)

    def __enter__(self) -> Collectives:
        self._real = dist.all_reduce

        def logged(t, *args, **kwargs):
            self.mark("reduce", t.numel(), str(t.dtype), bool(kwargs.get("async_op", False)))
            return self._real(t, *args, **kwargs)

        dist.all_reduce = logged
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self._real

    def reduces(self) -> list[tuple]:
        return [e for e in self.events if e[0] == "reduce"]


def _step(gbs: int, world: int, mbs: int, rank: int, log: Collectives | None = None):
    """A fresh tiny GPT (same seed: same init on every rank), compiled for ranks, and one
    step on this rank's share; markers for each microbatch forward and gradient go to log."""
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    cm = mbcompile.compile(model, gbs, world, mbs, example_inputs=batch,
                           backend="torch.distributed")
    if log is not None:
        model.head.register_forward_pre_hook(
            mbcompile.per_microbatch(lambda *_: log.mark("forward")))
        # the embedding's output gradient: late in each microbatch's backward (a parameter's
        # own tensor hooks fire once, in loss.backward(): tests/faults.py)
        on_output_gradient(model.tok, lambda g: log.mark("grad", "tok"))
    loss, logits = cm(*mbdist.shard(batch, cm.plan, rank))
    if log is not None:
        log.mark("backward")
    loss.backward()
    return model, cm, loss, logits


def train_step(rank: int, world: int, out_dir: str, gbs: int, mbs: int,
               bucket_bytes: int) -> None:
    """One compiled training step on this rank's share, then the same step reduced the old
    way (``OVERLAP = False``); saves loss, both gradients, the collectives in order."""
    buckets.BUCKET_BYTES = bucket_bytes
    with Collectives() as log:
        model, cm, loss, logits = _step(gbs, world, mbs, rank, log)
    mbdist.OVERLAP = False
    reference, *_ = _step(gbs, world, mbs, rank)
    params = [p for p in model.parameters() if p.requires_grad]
    torch.save({"loss": loss.detach(), "logits": logits.detach(),
                "grads": {n: p.grad for n, p in model.named_parameters()},
                "reference": {n: p.grad for n, p in reference.named_parameters()},
                "events": log.events, "buckets": len(mbdist.OverlappedReduce(params).buckets),
                "plan": cm.plan.to_dict()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def failing_step(rank: int, world: int, out_dir: str, gbs: int, where: str) -> None:
    """Rank 1 fails in one place of its step; every rank records what it saw.

    ``where``: ``"forward"`` raises in its second microbatch's forward (before any
    bucket is launched), ``"last_backward"`` in the middle of its last microbatch's
    backward (after some are), ``"nan"`` makes its last microbatch's loss NaN.
    """
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    buckets.BUCKET_BYTES = 16 * 1024  # several buckets, so some start before the failure
    forwards = {"n": 0, "armed": False}
    log = Collectives()
    last = 0  # rank 1's last microbatch (microbatches of 1), known once compiled

    def count(module, args):
        if not forwards["armed"]:
            return
        forwards["n"] += 1
        log.mark("forward")
        if where == "forward" and rank == 1 and forwards["n"] == 2:
            log.mark("fail")
            raise RuntimeError("injected failure on rank 1")

    def poison(module, args, out):
        return out + float("nan") if forwards["armed"] and where == "nan" and rank == 1 \
            and forwards["n"] == last else out

    def explode(grad):
        if forwards["armed"] and where == "last_backward" and rank == 1 \
                and forwards["n"] == last:
            log.mark("fail")
            raise RuntimeError("injected failure on rank 1")

    # Registered before compile, which checks them (a hook added later that changes what
    # a layer returns is refused); they act only once armed, after compile's own forwards.
    model.head.register_forward_pre_hook(mbcompile.per_microbatch(count))
    model.head.register_forward_hook(poison)
    on_output_gradient(model.blocks[0].qkv, explode)  # late in the backward
    cm = mbcompile.compile(model, gbs, world, 1, example_inputs=batch,
                           backend="torch.distributed", nonfinite="raise")
    last = cm.plan.per_system_batch_sizes[rank]
    forwards["armed"] = True
    for p in model.parameters():  # the user's gradients, which a failed step leaves alone
        p.grad = torch.full_like(p, 7.0)
    try:
        with log:
            loss, _ = cm(*mbdist.shard(batch, cm.plan, rank))
            loss.backward()
        outcome = "no error"
    except Exception as exc:  # what each rank saw is the test's result
        outcome = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=1)}"
    untouched = all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())
    torch.save({"untouched": untouched, "outcome": outcome, "events": log.events},
               os.path.join(out_dir, f"rank{rank}.pt"))


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


class Sized(torch.nn.Module):
    """Prints, counts and returns the batch's shape; ``coupled``: its loss is an RMSE, a
    two-phase step (the shape is read in the coupled part)."""

    def __init__(self, coupled: bool) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.coupled = coupled
        self.seen = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Any]:
        err = (self.lin(x) - y).pow(2).mean()
        loss = err.sqrt() if self.coupled else err
        self.seen += x.shape[0]
        print("shape", x.shape, x.size(0), x.shape[1:])
        return loss, x.shape


def sized_steps(rank: int, world: int, out_dir: str, gbs: int, coupled: bool) -> None:
    """Two steps of ``Sized``: what it printed, counted and returned (test_distributed.py)."""
    import contextlib
    import io

    torch.manual_seed(0)
    model = Sized(coupled).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(gbs, 4, generator=g, dtype=torch.float64),
             torch.randn(gbs, 3, generator=g, dtype=torch.float64))
    cm = mbcompile.compile(model, gbs, world, 2, example_inputs=batch,
                           backend="torch.distributed")
    printed, shapes = io.StringIO(), []
    with contextlib.redirect_stdout(printed):
        for _ in range(2):
            loss, shape = cm(*mbdist.shard(batch, cm.plan, rank))
            loss.backward()
            shapes.append(shape)
    torch.save({"printed": printed.getvalue(), "shapes": shapes, "seen": model.seen,
                "loss": loss.detach(), "grad": model.lin.weight.grad.clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))


def token_draw_step(rank: int, world: int, out_dir: str, gbs: int, norm: bool) -> None:
    """One step of test_draws_merged's per-token mask, drawn at the global batch on every
    rank (tests/test_distributed.py)."""
    from test_draws_merged import TokenDraw, _mask

    torch.manual_seed(0)
    model = TokenDraw(_mask, norm).to(torch.float64)
    x = torch.randn(gbs, 5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cm = mbcompile.compile(model, gbs, world, 2, example_inputs=(x,),
                           backend="torch.distributed")
    torch.manual_seed(10)
    loss, r = cm(*mbdist.shard((x,), cm.plan, rank))
    after = torch.rand(())
    loss.backward()
    torch.save({"loss": loss.detach(), "r": r, "after": after,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                "sizes": list(cm.plan.per_system_batch_sizes)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def drawn_scale_steps(rank: int, world: int, out_dir: str, gbs: int) -> None:
    """Three calls from one state of test_seeded_backward's loss times a draw, on ranks:
    every rank seeds its backwards with the value drawn (the same on every rank)."""
    from test_seeded_backward import _DrawnScale

    torch.manual_seed(0)
    model = _DrawnScale()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(gbs, 4, generator=g), torch.randint(0, 3, (gbs,), generator=g)
    cm = mbcompile.compile(model, gbs, world, 2, example_inputs=(x, y),
                           backend="torch.distributed", cost_model=False)
    state, grads = model.g.get_state(), []
    for _ in range(3):
        model.g.set_state(state)
        cm(*mbdist.shard((x, y), cm.plan, rank)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    torch.save({"grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))


def hand_mean_steps(rank: int, world: int, out_dir: str, gbs: int) -> None:
    """Three steps of test_seeded_backward's hand-written token mean, the second with every
    label masked, each rank on its share: the gradients of each step."""
    from test_seeded_backward import IGNORE_INDEX, _HandMean

    torch.manual_seed(0)
    model = _HandMean("count").double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (gbs, 5), generator=g),
                torch.randint(0, 11, (gbs, 5), generator=g)) for _ in range(3)]
    batches[1][1][:] = IGNORE_INDEX
    cm = mbcompile.compile(model, gbs, world, 2, example_inputs=batches[0],
                           backend="torch.distributed", cost_model=False)
    grads = []
    for batch in batches:
        cm(*mbdist.shard(batch, cm.plan, rank)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    torch.save({"grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))


def logged(rank: int, log_dir: str, target: Callable[..., None],
           target_args: tuple[Any, ...]) -> None:
    """``target(rank, *target_args)`` with this rank's stdout and stderr going to
    ``log_dir/rank{rank}.log`` (tests/test_distributed.py ``_run`` copies them to the test's
    output: a rank forked from the forkserver would write to the output of whichever test
    started it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(os.path.join(log_dir, f"rank{rank}.log"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    target(rank, *target_args)
