"""The mode a phase's module is compiled in: a training plan, also for validation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["planned_for_training"]


@contextmanager
def planned_for_training(model: nn.Module, validating: bool) -> Iterator[None]:
    """While ``validating`` (a validation phase compiling a module of its own, with no train
    phase's module to run on), the compile sees the model as training does: train mode,
    grad enabled. Its plan is then a training step's, checked with what backward holds
    and with activation checkpointing where memory needs it, so a forward of that MBS
    fits; compiled in eval mode under ``no_grad`` it was planned as a training step
    without checkpointing, and could refuse a validation that fits. The validation's own
    calls, in eval mode under ``no_grad``, then compile their eval-mode graph once, on
    that plan. Every module's mode is put back after."""
    if not validating:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.enable_grad():
            model.train()
            yield
    finally:
        for m, training in modes:
            m.training = training
