"""Which FSDP2 units a model is sharded into, known before it is sharded.

``Trainer(..., shard="fsdp")`` and ``mbcompile fit`` with ``shard: fsdp`` call
``fully_shard`` on each repeated block (every child of an ``nn.ModuleList`` that is not
inside another block), then on the root, as torchtitan does. ``fsdp_units`` names those
units without sharding anything, so a plan can cost FSDP2 (``ShardSpec``: each unit's
parameter bytes, gathered one at a time) in one process, with no process group.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["fsdp_blocks", "fsdp_units"]


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of every ``nn.ModuleList`` that is not inside
    another block (a block's own lists stay in its unit)."""
    out: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            for child in module:
                out.append(child)
                inside.update(id(m) for m in child.modules())
    return out


def fsdp_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units ``shard_model`` would make, the root first (as ``fsdp_modules`` lists a
    sharded model's), each with its name in ``model``."""
    names = {id(m): name for name, m in model.named_modules()}
    return [("", model), *((names[id(b)], b) for b in fsdp_blocks(model))]
