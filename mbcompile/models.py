"""Small built-in models: the tiny GPT, an MLP and a CNN, with synthetic batches.

They are what ``examples/`` runs, what the demo compiles and what the tests share.
Each ``make_*`` returns ``(model, example_batch)`` where the batch is a tuple of
inputs for ``model(*batch)``; every model returns its loss (computed inside, so
mbcompile can run backward per microbatch) and a per-sample output.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CNN",
    "MLP",
    "TinyGPT",
    "make_cnn",
    "make_mlp",
    "make_tiny_gpt",
    "token_batch",
]

IGNORE_INDEX = -100


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style causal language model; the loss is token-level cross-entropy.

    ``labels`` equal to -100 (padding) are ignored, so the loss is the mean over
    real tokens of the whole batch, however they fall into microbatches.
    """

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2, heads: int = 4,
                 seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(ids.size(1), device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                               ignore_index=IGNORE_INDEX)
        return loss, logits


class MLP(nn.Module):
    """A regression MLP with a mean-squared-error loss."""

    def __init__(self, features: int = 8, hidden: int = 32, out: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, hidden),
                                 nn.Tanh(), nn.Linear(hidden, out))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.net(x)
        return F.mse_loss(pred, y), pred


class CNN(nn.Module):
    """An image classifier with GroupNorm (not BatchNorm, which mixes samples in training)."""

    def __init__(self, channels: int = 3, classes: int = 5, width: int = 8) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.GroupNorm(2, width), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1), nn.GroupNorm(4, 2 * width),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(2 * width, classes)
        self.loss = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, images: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.features(images), 1))
        return self.loss(logits, labels), logits


def token_batch(batch: int, seq: int = 16, vocab: int = 64, *, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids with right padding: each sequence has its own length.

    Labels are the next tokens, -100 on padding, so samples hold different
    numbers of real tokens (what makes per-microbatch means wrong).
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    lengths = torch.randint(max(1, seq // 4), seq + 1, (batch,), generator=g)
    pad = torch.arange(seq)[None, :] >= lengths[:, None]
    labels[pad] = IGNORE_INDEX
    labels[:, -1] = IGNORE_INDEX
    ids[pad] = 0
    return ids, labels


def make_tiny_gpt(batch: int = 8, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **config: int) -> tuple[TinyGPT, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = TinyGPT(**config).to(dtype)
    seq = config.get("seq", 16)
    return model, token_batch(batch, seq, config.get("vocab", 64), seed=seed + 1)


def make_mlp(batch: int = 8, *, seed: int = 0, dtype: torch.dtype = torch.float32
             ) -> tuple[MLP, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = MLP().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 8, generator=g, dtype=dtype),
                   torch.randn(batch, 3, generator=g, dtype=dtype))


def make_cnn(batch: int = 8, *, seed: int = 0, dtype: torch.dtype = torch.float32
             ) -> tuple[CNN, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = CNN().to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, 3, 8, 8, generator=g, dtype=dtype),
                   torch.randint(0, 5, (batch,), generator=g))
