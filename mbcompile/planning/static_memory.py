"""Static memory checked before any tracing: what does not fit fails in milliseconds.

Parameters, gradients and optimizer state do not depend on the MBS; when they alone exceed
a system's usable memory no plan can fit, and counting them needs no trace: shapes and
dtypes are enough, so a 70B-shaped model on the meta device is refused in milliseconds
instead of after minutes of probing. The figures and the fixes the error names (the
smallest FSDP2 world, an optimizer with less state; never more replicated systems) are
``fixes.py``'s, the one place that works out what would fit.
"""

from __future__ import annotations

import torch.nn as nn

from mbcompile.planning.estimates import ShardSpec
from mbcompile.planning.fixes import static_does_not_fit
from mbcompile.planning.systems import SystemSpec

__all__ = ["check_static_memory"]


def check_static_memory(model: nn.Module, system: SystemSpec,
                        shard: ShardSpec | None = None) -> None:
    """Raise ``DoesNotFitError`` when ``model``'s static memory alone exceeds ``system``'s
    usable memory: a whole replica (each system holds one, however many there are), or
    one rank's share when ``shard`` (its FSDP2 sharding) spreads it over ``shard.world``
    ranks.

    >>> check_static_memory(nn.Linear(4, 4), get_system("host"))   # fits: returns None
    """
    error = static_does_not_fit(model, system, world=shard.world if shard is not None else 1)
    if error is not None:
        raise error
