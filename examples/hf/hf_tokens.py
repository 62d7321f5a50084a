"""Random token batches for ``examples/hf/llama.yaml``: causal-LM inputs as keyword
arguments (``input_ids`` and ``labels``; transformers shifts the labels itself)."""

from __future__ import annotations

import torch

_SPLIT_SEED = {"train": 0, "validate": 10_000}


def batches(batch_size: int, split: str = "train", vocab_size: int = 64, seq: int = 16,
            num_batches: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(_SPLIT_SEED[split])
    out = []
    for _ in range(num_batches):
        ids = torch.randint(0, vocab_size, (batch_size, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out
