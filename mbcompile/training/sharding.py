"""FSDP2 sharding for the Trainer: ``fully_shard`` per repeated block, then the root.

With ``Trainer(..., shard="fsdp")`` (torch.distributed ranks) the model is sharded by
``shard_model`` (each child of its ``nn.ModuleList`` containers, then the root, as
torchtitan does) and the optimizer's parameter groups are pointed at the shards;
checkpoints then hold each rank's shards (``get_state_dict`` / ``set_state_dict``
through DCP), which DCP reshards when a run resumes on another number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from mbcompile.errors import ArgumentTypeError
from mbcompile.planning.shard_plan import fsdp_blocks
from mbcompile.training.batches import TrainerError

__all__ = ["is_fsdp", "shard_for_training", "shard_model"]


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_model(model: nn.Module, shard: str = "fsdp") -> nn.Module:
    """Shard ``model`` in place with FSDP2, as torchtitan does: ``fully_shard`` on each
    repeated block (the children of its ``nn.ModuleList`` containers), then on the root.

    Needs an initialized process group; call it before building the optimizer (or let
    ``Trainer(..., shard="fsdp")`` point the optimizer at the shards). A model that is
    already sharded is returned as it is.
    """
    import torch.distributed as dist

    if shard != "fsdp":
        raise ArgumentTypeError(f"shard must be 'fsdp' (or None for no sharding), got {shard!r}")
    if is_fsdp(model):
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise TrainerError("shard='fsdp' splits the model over torch.distributed ranks, but "
                           "no process group is initialized: run with `mbcompile fit CONFIG "
                           "--nproc N`, under torchrun, or call "
                           "torch.distributed.init_process_group first")
    from torch.distributed.fsdp import fully_shard

    for block in fsdp_blocks(model):  # the units a plan costs (planning.shard_plan)
        fully_shard(block)
    fully_shard(model)
    return model


def _point_at_shards(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
                     model: nn.Module) -> None:
    """After ``fully_shard`` replaced ``model``'s parameters by shards, make ``optimizer``
    (built on the old ones, with no state yet) update the shards instead."""
    now = dict(model.named_parameters())
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise TrainerError(
                "shard='fsdp': the optimizer holds a parameter that is not the model's; build "
                "the optimizer on model.parameters(), or shard the model yourself first "
                "(mbcompile.training.sharding.shard_model) and build it on the shards")
        group["params"] = [now[names[id(p)]] for p in group["params"]]


def shard_for_training(model: nn.Module, optimizer: torch.optim.Optimizer, shard: str | None,
                       backend: str | None, num_csx: int) -> None:
    """``Trainer(shard=...)``: shard ``model`` in place (None or "none": leave it) and point
    ``optimizer``, built on the unsharded parameters and without state yet, at the shards."""
    if shard in (None, "none"):
        return
    if shard != "fsdp":
        raise ArgumentTypeError(f"shard must be 'fsdp' or None, got {shard!r}")
    if backend != "torch.distributed":
        raise TrainerError(
            "shard='fsdp' splits the model over torch.distributed ranks: give "
            "backend='torch.distributed' (in a config: shard: fsdp, run with --nproc N "
            "or torchrun)")
    if num_csx < 2:
        raise TrainerError(f"shard='fsdp' splits the model over the ranks, one per "
                           f"system, but num_csx is {num_csx}: use 2 or more ranks, or no "
                           "sharding")
    if is_fsdp(model):
        return
    if optimizer.state:
        raise TrainerError("shard='fsdp': the optimizer has state already; shard the "
                           "model before the first step")
    names = {id(p): n for n, p in model.named_parameters()}
    shard_model(model, shard)
    _point_at_shards(optimizer, names, model)
