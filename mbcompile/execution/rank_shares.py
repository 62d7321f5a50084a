"""Each rank's share of the global batch: which samples system ``rank`` runs.

Rank ``r`` is system ``r`` of the plan and runs ``plan.per_system_batch_sizes[r]``
consecutive samples of each global batch (gbs 10 on 3 ranks: samples 0-3, 4-6, 7-9).
``shard`` cuts a batch that every rank holds, ``PlanSampler`` hands each rank its
indices of a dataset, and ``check_world`` says whether the process group is the plan's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from mbcompile.passes.errors import InputError
from mbcompile.planning.plan import MicrobatchPlan

__all__ = ["PlanSampler", "check_not_in_ddp", "check_world", "rank_slice", "shard",
           "share_refused"]


def check_world(plan: MicrobatchPlan) -> int:
    """This process's rank; raises unless a process group of ``num_csx`` ranks is up."""
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            "backend='torch.distributed' needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first (torchrun sets it up), or use "
            "the default simulated backend")
    world = dist.get_world_size()
    if world != plan.num_csx:
        raise InputError(
            f"the process group has {world} ranks but num_csx={plan.num_csx}; each rank is one "
            f"system: compile with num_csx={world} or launch {plan.num_csx} ranks")
    return dist.get_rank()


def check_not_in_ddp() -> None:
    """Refuse a call from inside DistributedDataParallel's forward: a module compiled for
    ranks all-reduces its gradients itself, once a step, and DDP would do it again."""
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_get_active_ddp_module", lambda: None)()
    if active is not None:
        raise InputError(
            "this module was compiled with backend='torch.distributed' and all-reduces its "
            "gradients itself, once a step, but it runs inside DistributedDataParallel, which "
            "would all-reduce them a second time: do not wrap it (with Accelerate, prepare it "
            "with mbcompile.integrations.accelerate.prepare(accelerator, cm, opt, loader) "
            "instead of accelerator.prepare)")


def share_refused(plan: MicrobatchPlan, rank: int, batch: int | None) -> InputError | None:
    """The error of a call of ``batch`` samples on ``rank`` that is not its share of the
    plan (None: it is). The rank does not raise it at once: the other ranks may be in the
    step already (their shares fit), so it runs the step on the example, its collectives
    paired with theirs, and raises in it (``StepChannels.refused``): every rank stops the
    step, changing nothing."""
    local = plan.per_system_batch_sizes[rank]
    if batch is None or batch == local:
        return None
    return InputError(
        f"rank {rank} was called with {batch} samples but its share of gbs={plan.gbs} is "
        f"{local} (plan.per_system_batch_sizes[{rank}]); cut the global batch with "
        "mbcompile.distributed.shard(batch, cm.plan, rank); every step's global batch has "
        "gbs samples (drop a short last one); the step was stopped on every rank")


def rank_slice(plan: MicrobatchPlan, rank: int) -> slice:
    """The samples of the global batch that system ``rank`` runs."""
    start = sum(plan.per_system_batch_sizes[:rank])
    return slice(start, start + plan.per_system_batch_sizes[rank])


def shard(batch: Any, plan: MicrobatchPlan, rank: int, dim: int = 0) -> Any:
    """Rank ``rank``'s share of a global batch (views along ``dim`` of every tensor);
    ``InputError`` for a batch of another size than ``plan.gbs`` (a short last batch),
    on every rank alike, before anything is cut: its shares are not the plan's."""
    sizes = {int(t.shape[dim]) for t in pytree.tree_leaves(batch)
             if isinstance(t, torch.Tensor) and t.dim() > dim}
    if sizes and sizes != {plan.gbs}:
        raise InputError(
            f"shard() cuts a global batch of gbs={plan.gbs} samples by the plan, but this one "
            f"has {', '.join(map(str, sorted(sizes)))} along dim {dim}; on ranks every step's "
            f"batch cut by hand has gbs samples: drop the short last batch (DataLoader(..., "
            f"drop_last=True)), batch with mbcompile.distributed.PlanSampler, or train with "
            f"mbcompile.Trainer, which plans a batch of another size for its size")
    s = rank_slice(plan, rank)
    return pytree.tree_map(
        lambda t: t.narrow(dim, s.start, s.stop - s.start) if isinstance(t, torch.Tensor) else t,
        batch)


class PlanSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of dataset indices for one rank: step k's global batch is
    ``[k*gbs, (k+1)*gbs)`` (shuffled by ``seed`` if given) and this rank takes its
    plan-sized share. Use as ``DataLoader(ds, batch_sampler=PlanSampler(...))``.
    """

    def __init__(self, length: int, plan: MicrobatchPlan, rank: int,
                 seed: int | None = None) -> None:
        self.length, self.plan, self.rank, self.seed = length, plan, rank, seed

    def __len__(self) -> int:
        return self.length // self.plan.gbs

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(self.length))
        if self.seed is not None:
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(self.length, generator=g).tolist()
        s = rank_slice(self.plan, self.rank)
        for step in range(len(self)):
            base = step * self.plan.gbs
            yield order[base + s.start:base + s.stop]
