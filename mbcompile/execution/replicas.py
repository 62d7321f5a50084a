"""Ranks that train one model: checked once, at the end of compile(), on every rank.

DistributedDataParallel broadcasts rank 0's parameters and buffers when it wraps the
model, so a script that seeds each rank differently before building it (for its data
order, its augmentation) still trains one model. mbcompile never changes the user's
module (DESIGN.md, invariant 1): it checks instead, and refuses replicas that differ,
which would each keep their own offset for ever while every rank printed the same global
loss. The same exchange refuses ranks compiled for different global batches or models
of other layouts (a gbs of 8 on one rank and 10 on another ran silently; another model
aborted the process inside gloo, with no Python error), and a compile that failed on
one rank stops the others with an error naming it rather than leaving them waiting in
the first step's collectives.

Two collectives, at compile only: an ``all_gather_object`` of each rank's outcome and
layout (names, shapes, dtypes, ``requires_grad``, gbs), then, for a replicated model with
data, an all-reduce of two checksums per tensor (its sum, accumulated in float64, and its
norm). Sharded (FSDP2) models hold different shards by design: only their layout is
compared. Compiles that run nothing (``compile_only``, ``validate_only``) exchange
nothing, so one rank may plan alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from mbcompile.passes.errors import InputError
from mbcompile.passes.fake_probe import holds_no_data

__all__ = ["replicas_agreed"]


@contextlib.contextmanager
def replicas_agreed(model: Any, gbs: int, options: Mapping[str, Any]) -> Iterator[None]:
    """Run compile()'s body; on ranks, then agree with every other rank (module docstring)
    whether it failed or not, raising ``InputError`` where they disagree."""
    if not _on_ranks(options) or not isinstance(model, nn.Module):
        yield
        return
    try:
        yield
    except Exception as exc:
        _exchange(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        raise
    layout = _layout(model, gbs)
    _exchange(layout)
    _compare_values(model)


def _on_ranks(options: Mapping[str, Any]) -> bool:
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            and options.get("backend", "auto") in ("auto", "torch.distributed")
            and not options.get("compile_only") and not options.get("validate_only"))


def _state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _layout(model: nn.Module, gbs: int) -> tuple[Any, ...]:
    return (gbs, tuple((name, tuple(t.shape), str(t.dtype), t.requires_grad)
                       for name, t in _state(model)))


def _exchange(mine: Any) -> None:
    """All-gather each rank's outcome (a failure's message, or its layout) and raise where
    another rank failed or differs; a rank that failed raises its own error after."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if isinstance(mine, str):
        return  # this rank failed: its own error follows
    failed = {r: o for r, o in enumerate(every) if isinstance(o, str)}
    if failed:
        rank, why = next(iter(failed.items()))
        raise InputError(f"compile() failed on rank(s) {sorted(failed)} (rank {rank}: {why}); "
                         f"this rank ({dist.get_rank()}) stops too: fix that rank's call")
    for rank, other in enumerate(every):
        if other != mine:
            raise InputError(f"rank {rank} compiled {_difference(other, mine)}; every rank "
                             "must compile the same model for the same gbs (each its share "
                             "of one global batch)")


def _difference(other: tuple[Any, ...], mine: tuple[Any, ...]) -> str:
    if other[0] != mine[0]:
        return f"gbs={other[0]}, this rank ({dist.get_rank()}) gbs={mine[0]}"
    theirs = {n: rest for n, *rest in other[1]}
    ours = {n: rest for n, *rest in mine[1]}
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            return (f"a model whose {name!r} is {_said(theirs.get(name))}, where this rank's "
                    f"is {_said(ours.get(name))}")
    return "another model"


def _said(entry: list[Any] | None) -> str:
    if entry is None:
        return "missing"
    shape, dtype, trained = entry
    return f"{tuple(shape)} {dtype.removeprefix('torch.')}" + ("" if trained else " (frozen)")


def _compare_values(model: nn.Module) -> None:
    """Refuse replicas whose parameters or buffers differ (their checksums' max and min
    over ranks differ)."""
    state = [(n, t) for n, t in _state(model) if t.is_floating_point()]
    from torch.distributed.tensor import DTensor

    if not state or any(holds_no_data(t) or isinstance(t, DTensor)
                        for _, t in state):
        return  # shapes only (a meta plan), or shards that differ by design
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    with torch.no_grad():
        # no float64 copy of a tensor: a sum accumulated in float64, a norm in its dtype
        sums = torch.stack([torch.stack([t.detach().sum(dtype=torch.float64),
                                         torch.linalg.vector_norm(t.detach()).double()])
                            for _, t in state]).to(device).flatten()
    both = torch.cat([sums, -sums])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    n = sums.numel()
    apart = ((both[:n] != sums) | (-both[n:] != sums)).view(-1, 2).any(1).tolist()
    names = [name for (name, _), differ in zip(state, apart) if differ]
    if names:
        raise InputError(
            f"the ranks hold different values of {', '.join(map(repr, names[:3]))}"
            f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}: each would train "
            "its own model with the same summed gradients, apart for ever. "
            "DistributedDataParallel broadcasts rank 0's at construction; mbcompile does not "
            "change your model. Fix: build it alike on every rank (the same seed before "
            "building it, or load the same checkpoint), or broadcast rank 0's before compiling: "
            "for t in [*model.parameters(), *model.buffers()]: dist.broadcast(t.data, 0)")
