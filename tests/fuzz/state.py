"""Constructs: attribute reads, state writes, model-owned generators, parametrizations."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations

from .base import (
    DTYPE,
    WIDTH,
    Construct,
    WithLinear,
    _lin,
)

# ----- attribute reads ------------------------------------------------------------ #


class AttrBeta(WithLinear):
    """``self.beta * loss_term`` added to the loss; mutate changes beta."""

    def __init__(self) -> None:
        super().__init__()
        self.beta = 0.5

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h))
        return h, None, self.beta * h.pow(2).mean()

    def mutate(self, root):
        self.beta = 2.0


class AttrFlag(WithLinear):
    """A Python flag in an ``if``; mutate flips it."""

    def __init__(self) -> None:
        super().__init__()
        self.flag = True

    def forward(self, h, x):
        if self.flag:
            return torch.tanh(self.lin(h)), None, None
        return self.lin(h) * 0.5, None, None

    def mutate(self, root):
        self.flag = False


class TrainingBranch(WithLinear):
    """``if self.training:``; mutate puts this block (only) in eval."""

    def forward(self, h, x):
        if self.training:
            return h + torch.tanh(self.lin(h)), None, None
        return h * 2.0, None, None

    def mutate(self, root):
        self.eval()


class DropoutAttr(WithLinear):
    """``F.dropout(..., p=self.p, training=self.training)`` with p 0, then 1 (no draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.p = 0.0

    def forward(self, h, x):
        return h + F.dropout(torch.tanh(self.lin(h)), p=self.p, training=self.training), None, None

    def mutate(self, root):
        self.p = 1.0


class DropoutModuleP(WithLinear):
    """``nn.Dropout(0.0)`` whose ``p`` is set to 1.0 after compile."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.0)

    def forward(self, h, x):
        return h + self.drop(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        self.drop.p = 1.0


class DropoutModuleEval(WithLinear):
    """``nn.Dropout(1.0)`` (all zeros in training) put in eval after compile."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(1.0)

    def forward(self, h, x):
        return h + self.drop(torch.tanh(self.lin(h))), None, None

    def mutate(self, root):
        self.drop.eval()


# ----- state writes ------------------------------------------------------------------ #


class BufferCounter(WithLinear):
    """``self.seen += h.shape[0]`` (a long buffer: samples seen); mutate resets it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, h, x):
        self.seen += h.shape[0]
        return h + torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        self.seen.zero_()


class BufferCounterRead(WithLinear):
    """``self.seen.add_(h.shape[0])`` then the updated count read as a factor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.ones((), dtype=torch.long))

    def forward(self, h, x):
        self.seen.add_(h.shape[0])
        return h * (1 + 0.01 * self.seen) + torch.tanh(self.lin(h)), None, None


class EmaCenterBefore(Construct):
    """DINO's centre: read the EMA buffer, then update it under no_grad with the batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.linspace(-0.1, 0.1, WIDTH))

    def forward(self, h, x):
        out = h - self.center
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * h.mean(0))
        return out, None, None


class EmaCenterAfter(Construct):
    """The EMA of the batch mean updated first, then read (couples the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("center", torch.linspace(-0.1, 0.1, WIDTH))

    def forward(self, h, x):
        with torch.no_grad():
            self.center.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.center, None, None


class EmaParamLoop(Construct):
    """A frozen teacher's parameters updated in place from the student's, looping over
    ``.parameters()`` under no_grad (the usual EMA-teacher code), then used."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = _lin(), _lin()
        self.teacher.requires_grad_(False)

    def forward(self, h, x):
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.student.parameters()):
                pt.mul_(0.9).add_(ps, alpha=0.1)
        return self.student(h) + torch.tanh(self.teacher(h)), None, None


class EmaParamAttr(Construct):
    """The same EMA written with attribute reads (``self.teacher.weight.mul_(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = _lin(), _lin()
        self.teacher.requires_grad_(False)

    def forward(self, h, x):
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(0.1 * self.student.weight)
            self.teacher.bias.mul_(0.9).add_(0.1 * self.student.bias)
        return self.student(h) + torch.tanh(self.teacher(h)), None, None


class InputWrite(Construct):
    """An in-place write to the model's input ``x`` before anything reads it (normalising the
    batch in place at the top of forward; after a read, eager's autograd would refuse it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, WIDTH))

    def prepare(self, x):
        x.sub_(self.shift).mul_(0.5)

    def forward(self, h, x):
        return h + 0.1 * x, None, None


# ----- model-owned generators ------------------------------------------------------- #


class GeneratorNoise(WithLinear):
    """Per-sample noise ``torch.randn(h.shape, generator=self.g)``; mutate reseeds."""

    seed = 7

    def forward(self, h, x):
        noise = torch.randn(h.shape, generator=self.g, dtype=h.dtype)
        return h + torch.tanh(self.lin(h)) + 0.1 * noise, None, None

    def mutate(self, root):
        self.g.manual_seed(1234)


class GeneratorShared(WithLinear):
    """One draw shared by all samples, ``torch.randn(4, generator=self.g)`` (batch-free)."""

    seed = 11

    def forward(self, h, x):
        noise = torch.randn(WIDTH, generator=self.g, dtype=DTYPE)
        return h + torch.tanh(self.lin(h)) + 0.1 * noise, None, None


# ----- parametrizations -------------------------------------------------------------- #


class SpectralNorm(Construct):
    """``parametrizations.spectral_norm``: a power iteration per weight access in training
    (updating ``_u``, ``_v``); mutate puts it in eval (no iteration)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = parametrizations.spectral_norm(_lin())

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        self.lin.eval()


class SpectralNormLegacy(Construct):
    """The legacy ``torch.nn.utils.spectral_norm`` (a forward pre-hook; buffers ``weight_u``,
    ``weight_v``); mutate puts it in eval."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lin = torch.nn.utils.spectral_norm(_lin())

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        self.lin.eval()


class WeightNorm(Construct):
    """``parametrizations.weight_norm`` (stateless); mutate rescales its magnitude in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = parametrizations.weight_norm(_lin())

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        with torch.no_grad():
            self.lin.parametrizations.weight.original0.mul_(2.0)
