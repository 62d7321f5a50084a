"""Constructs: every place Python state lives that forward reads or writes (issue 35).

Reads are guarded (a change compiles again, or a number that changes on every call becomes
a graph input); writes (an attribute, a dict key, a list appended to, a private counter)
are replayed once per step with the full batch's values. The oracle compares the Python
state of every module after each step against eager's (``oracle.python_state``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from .base import WithLinear


class Mode(enum.Enum):
    SOFT = "soft"
    HARD = "hard"


@dataclass
class Config:
    beta: float = 0.5
    centred: bool = False


class FlagsDict(WithLinear):
    """``if self.flags["hard"]`` and ``self.flags["scale"]``: a dict of flags; mutate flips."""

    def __init__(self) -> None:
        super().__init__()
        self.flags = {"hard": False, "scale": 0.5}

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h)) * self.flags["scale"]
        return (h.clamp(-0.5, 0.5) if self.flags["hard"] else h), None, None

    def mutate(self, root):
        self.flags["hard"] = True


class EnumMode(WithLinear):
    """``self.mode is Mode.HARD``: an enum member in a branch; mutate switches it."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = Mode.SOFT

    def forward(self, h, x):
        out = torch.tanh(self.lin(h))
        return h + (out.sign() * out.abs().sqrt() if self.mode is Mode.HARD else out), None, None

    def mutate(self, root):
        self.mode = Mode.HARD


class ConfigObject(WithLinear):
    """``self.cfg.beta`` of a dataclass config held by the block; mutate changes a field."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = Config()

    def forward(self, h, x):
        return h + self.cfg.beta * torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        self.cfg.beta = 2.0


class PrivateCounter(WithLinear):
    """``self._step += 1`` read by a schedule in the same forward: moves once per step."""

    def __init__(self) -> None:
        super().__init__()
        self._step = 0

    def forward(self, h, x):
        self._step += 1
        return h + torch.tanh(self.lin(h)) * (1.0 + 0.1 * self._step), None, None

    def mutate(self, root):
        self._step = 10


class LogsStats(WithLinear):
    """Logging in forward: ``self.last = ...``, ``self.stats["mean"] = ...`` and
    ``self.history.append(...)`` of detached full-batch values, and a counter in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.last = None
        self.stats: dict[str, object] = {"calls": 0}
        self.history: list[torch.Tensor] = []

    def forward(self, h, x):
        h = h + torch.tanh(self.lin(h))
        self.last = h.detach().pow(2).mean()
        self.stats["mean"] = h.detach().mean(0)
        self.stats["calls"] = self.stats["calls"] + 1
        self.history.append(h.detach().sum())
        return h, None, None
