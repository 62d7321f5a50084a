"""Another module's helpers and state, read and written by ``globalstate.py``'s forwards
(a fresh copy per construct: ``fresh.py``)."""

from __future__ import annotations

import torch

SCALE = 0.5
COUNT = 0
LAST = None


def scaled(h: torch.Tensor) -> torch.Tensor:
    """A global read two modules down from forward."""
    return h * SCALE


def activation(h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h)


def softsign(h: torch.Tensor) -> torch.Tensor:
    return h / (1 + h.abs())


def record(value: torch.Tensor) -> None:
    """Logging into this module's globals."""
    global COUNT, LAST
    COUNT += 1
    LAST = value.mean()
