"""Static memory checked before any tracing: what does not fit fails in milliseconds.

Parameters, gradients and optimizer state do not depend on the MBS; when they alone exceed
a system's memory no plan can fit, and counting them needs no trace.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from mbcompile.planning.systems import SystemSpec

__all__ = ["check_static_memory"]


def check_static_memory(model: nn.Module, system: SystemSpec, num_csx: int,
                        shard: Any = None) -> None:
    """Raise ``DoesNotFitError`` when ``model``'s static memory cannot fit on ``system``
    (no-op so far)."""
