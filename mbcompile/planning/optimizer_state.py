"""The optimizer's state in the plan: bytes per trainable parameter, from the optimizer.

``compile(..., optimizer=...)`` sizes the plan's optimizer state from what the user trains
with; ``with_optimizer`` folds it into the ``SystemSpec`` the cost model reads
(``optimizer_bytes_per_param``). ``None`` keeps the system's own figure.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from mbcompile.planning.systems import SystemSpec

__all__ = ["with_optimizer"]


def with_optimizer(spec: SystemSpec, optimizer: Any, model: nn.Module) -> SystemSpec:
    """``spec`` with its optimizer state sized for ``optimizer`` (None: unchanged)."""
    if optimizer is None:
        return spec
    raise NotImplementedError("compile(optimizer=...) is not implemented yet")
