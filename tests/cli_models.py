"""Data for the CLI tests, referenced from YAML configs as ``cli_models:<name>``.

The test puts this folder on ``PYTHONPATH`` for the ``mbcompile`` subprocess.
"""

from __future__ import annotations

import torch


def inf_at_step(batch_size: int, split: str = "train", step: int = 3, features: int = 4,
                out: int = 2, num_batches: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Regression batches for the built-in ``mlp``; training batch ``step`` (from 1) has an
    infinite input in its last sample, so the last microbatch's loss is not finite."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(1, num_batches + 1):
        x = torch.randn(batch_size, features, generator=g)
        y = torch.randn(batch_size, out, generator=g)
        if split == "train" and i == step:
            x[-1] = float("inf")
        batches.append((x, y))
    return batches
