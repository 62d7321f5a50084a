"""Models whose loss couples the samples of the batch: the two-phase step's test registry.

Each family is written the way its users write it, in float64, small enough to
compile in a fraction of a second. ``COUPLED[name](batch, seed=0)`` returns
``(model, inputs)`` like ``models.MODELS`` does. Every model is split by the
compiler into a per-sample part P (the encoders) and a coupled part C (the loss,
and any parameter it alone reads: a learned temperature, a bias, a head after
centering), so each family exercises a different frontier:

- ``clip``: two embeddings per sample, C reads ``logit_scale``;
- ``siglip``: two embeddings, C reads a temperature and a bias;
- ``simclr``: two views through one encoder, joined with ``cat`` inside C;
- ``triplet``: one embedding, ``cdist`` and batch-hard max/min with the labels;
- ``centering``: ``h - h.mean(0)``, then a head (C's own parameters);
- ``rmse``: ``mse.sqrt()``: the frontier is the partial sums of a reduction;
- ``rmse_plus_ce``: ``sqrt`` of one reduction plus a plain cross-entropy;
- ``batch_norm``: ``models.BatchNormNet`` (BatchNorm1d in training; (loss, logits), both
  computed in C);
- ``logits``: (loss, per-sample logits computed in P), the loss adding a coupled term.

``DropoutCLIP`` is CLIP with dropout in both encoders, for the RNG replay test.
``FIRST_P[name](model)`` is the first module of P, for hooks that watch P run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CLASSES as BN_CLASSES
from models import FEATURES as BN_FEATURES
from models import BatchNormNet

__all__ = [
    "COUPLED",
    "FIRST_P",
    "CLIPNet",
    "CenteringNet",
    "DropoutCLIP",
    "Encoder",
    "LogitsNet",
    "RMSENet",
    "RMSEPlusCENet",
    "SigLIPNet",
    "SimCLRNet",
    "TripletNet",
    "make_dropout_clip",
]

DTYPE = torch.float64
IMAGE, TEXT, HIDDEN, EMBED, CLASSES = 6, 5, 8, 4, 3

Inputs = tuple[Any, ...]


class Encoder(nn.Module):
    """Linear -> tanh -> (dropout) -> Linear: the per-sample part of every family."""

    def __init__(self, features: int, out: int = EMBED, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(features, HIDDEN)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(HIDDEN, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.tanh(self.inp(x))))


class CLIPNet(nn.Module):
    """Symmetric InfoNCE over image-text pairs, with CLIP's learned logit scale."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.image = Encoder(IMAGE, dropout=dropout)
        self.text = Encoder(TEXT, dropout=dropout)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def embed(self, image: torch.Tensor, text: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-sample part: unit-norm image and text embeddings."""
        return F.normalize(self.image(image), dim=-1), F.normalize(self.text(text), dim=-1)

    def contrastive(self, zi: torch.Tensor, zt: torch.Tensor) -> torch.Tensor:
        """The coupled part: every image against every text of the batch."""
        logits = self.logit_scale.exp() * zi @ zt.T
        labels = torch.arange(logits.size(0), device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.contrastive(*self.embed(image, text))


class DropoutCLIP(CLIPNet):
    """CLIP with dropout in both encoders (P draws random masks)."""

    def __init__(self) -> None:
        super().__init__(dropout=0.3)


class SigLIPNet(nn.Module):
    """SigLIP's pairwise sigmoid loss with a learned temperature and bias."""

    def __init__(self) -> None:
        super().__init__()
        self.image = Encoder(IMAGE)
        self.text = Encoder(TEXT)
        self.t_prime = nn.Parameter(torch.tensor(math.log(10.0)))
        self.bias = nn.Parameter(torch.tensor(-10.0))

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        zi = F.normalize(self.image(image), dim=-1)
        zt = F.normalize(self.text(text), dim=-1)
        logits = zi @ zt.T * self.t_prime.exp() + self.bias
        n = logits.size(0)
        labels = 2 * torch.eye(n, dtype=logits.dtype, device=logits.device) - 1
        return -F.logsigmoid(labels * logits).sum() / n


class SimCLRNet(nn.Module):
    """NT-Xent over two views of each sample: cat, cosine similarity, self-pairs masked."""

    def __init__(self, temperature: float = 0.5) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE)
        self.temperature = temperature

    def forward(self, view1: torch.Tensor, view2: torch.Tensor) -> torch.Tensor:
        z = F.normalize(torch.cat([self.encoder(view1), self.encoder(view2)]), dim=-1)
        sim = z @ z.T / self.temperature
        n = view1.size(0)
        self_pairs = torch.eye(2 * n, dtype=torch.bool, device=z.device)
        sim = sim.masked_fill(self_pairs, float("-inf"))
        targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
        return F.cross_entropy(sim, targets)


class TripletNet(nn.Module):
    """Batch-hard triplet loss: for each anchor its farthest positive and nearest negative."""

    def __init__(self, margin: float = 0.5) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE)
        self.margin = margin

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        e = self.encoder(x)
        d = torch.cdist(e, e)
        same = labels[:, None] == labels[None, :]
        hardest_pos = d.masked_fill(~same, 0.0).max(dim=1).values
        hardest_neg = d.masked_fill(same, float("inf")).min(dim=1).values
        return F.relu(hardest_pos - hardest_neg + self.margin).mean()


class CenteringNet(nn.Module):
    """A representation centred over the batch, then a head: the head runs in C, and the
    encoder's last bias gets a gradient of zero (centering removes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE, out=HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return F.cross_entropy(self.head(h - h.mean(0, keepdim=True)), y)


class RMSENet(nn.Module):
    """A non-linear function of a batch reduction: ``mse.sqrt()``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE, out=2)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.encoder(x), target).sqrt()


class RMSEPlusCENet(nn.Module):
    """``sqrt`` of one reduction plus a second, plain, loss on another head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE, out=HIDDEN)
        self.reg = nn.Linear(HIDDEN, 2)
        self.cls = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, target: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encoder(x))
        return F.mse_loss(self.reg(h), target).sqrt() + F.cross_entropy(self.cls(h), y)


class LogitsNet(nn.Module):
    """(loss, per-sample logits): the logits come from P; the loss adds a batch-spread term."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(IMAGE, out=HIDDEN)
        self.cls = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        logits = self.cls(h)
        spread = (h - h.mean(0)).pow(2).mean().sqrt()
        return F.cross_entropy(logits, y) + 0.1 * spread, logits


# --------------------------------------------------------------------------- #
# Makers: (model, inputs) in float64, seeded
# --------------------------------------------------------------------------- #


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=DTYPE)


def _labels(g: torch.Generator, batch: int) -> torch.Tensor:
    """Every class present (when the batch allows), in a random order."""
    return (torch.arange(batch) % CLASSES)[torch.randperm(batch, generator=g)]


def _maker(cls: Callable[[], nn.Module], inputs: Callable[[torch.Generator, int], Inputs]
           ) -> Callable[..., tuple[nn.Module, Inputs]]:
    def make(batch: int, seed: int = 0) -> tuple[nn.Module, Inputs]:
        torch.manual_seed(seed)
        model = cls().to(DTYPE)
        return model, inputs(torch.Generator().manual_seed(seed + 1), batch)

    make.__name__ = getattr(cls, "__name__", "make")
    return make


def _pairs(g: torch.Generator, n: int) -> Inputs:
    return _randn(g, n, IMAGE), _randn(g, n, TEXT)


def _views(g: torch.Generator, n: int) -> Inputs:
    x = _randn(g, n, IMAGE)
    return x + 0.1 * _randn(g, n, IMAGE), x + 0.1 * _randn(g, n, IMAGE)


def _classified(g: torch.Generator, n: int) -> Inputs:
    return _randn(g, n, IMAGE), _labels(g, n)


def _regression(g: torch.Generator, n: int) -> Inputs:
    return _randn(g, n, IMAGE), _randn(g, n, 2)


def _regression_and_classes(g: torch.Generator, n: int) -> Inputs:
    return _randn(g, n, IMAGE), _randn(g, n, 2), _labels(g, n)


def _batch_norm_inputs(g: torch.Generator, n: int) -> Inputs:
    return _randn(g, n, BN_FEATURES), torch.randint(0, BN_CLASSES, (n,), generator=g)


COUPLED: dict[str, Callable[..., tuple[nn.Module, Inputs]]] = {
    "clip": _maker(CLIPNet, _pairs),
    "siglip": _maker(SigLIPNet, _pairs),
    "simclr": _maker(SimCLRNet, _views),
    "triplet": _maker(TripletNet, _classified),
    "centering": _maker(CenteringNet, _classified),
    "rmse": _maker(RMSENet, _regression),
    "rmse_plus_ce": _maker(RMSEPlusCENet, _regression_and_classes),
    "batch_norm": _maker(BatchNormNet, _batch_norm_inputs),
    "logits": _maker(LogitsNet, _classified),
}

#: CLIP with dropout in P: not in ``COUPLED``, since its masks differ from eager's full batch.
make_dropout_clip = _maker(DropoutCLIP, _pairs)

FIRST_P: dict[str, Callable[[Any], nn.Module]] = {
    "clip": lambda m: m.image.inp,
    "siglip": lambda m: m.image.inp,
    "simclr": lambda m: m.encoder.inp,
    "triplet": lambda m: m.encoder.inp,
    "centering": lambda m: m.encoder.inp,
    "rmse": lambda m: m.encoder.inp,
    "rmse_plus_ce": lambda m: m.encoder.inp,
    "batch_norm": lambda m: m.inp,
    "logits": lambda m: m.encoder.inp,
}
