"""The mode a phase's module is compiled in: a training plan, also for validation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from mbcompile.errors import MbcompileError

__all__ = ["compiled_for_phase"]


def compiled_for_phase(model: nn.Module, validating: bool, compile: Callable[[], Any]) -> Any:
    """``compile()`` for a phase. While ``validating`` (a validation phase compiling a module
    of its own, with no train phase's module to run on), the compile sees the model as
    training does: every module's ``training`` flag set (not its ``train()``, whose
    overrides may do more) and grad enabled. Its plan is then a training step's, checked
    with what backward holds and with activation checkpointing where memory needs it, so
    a forward of that MBS fits; compiled in eval mode under ``no_grad`` it was planned as
    a training step without checkpointing, and could refuse a validation that fits. The
    validation's calls, in eval mode under ``no_grad``, compile their eval-mode graph once,
    on that plan. Where the model cannot be compiled in training mode (BatchNorm on a
    batch of one row) it is compiled as it is, in eval mode, as before. The flags are put
    back after."""
    if not validating:
        return compile()
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.enable_grad():
            for m, _ in modes:
                m.training = True
            return compile()
    except MbcompileError:
        pass  # (its traceback would hold the failed compile's tensors)
    finally:
        for m, training in modes:
            m.training = training
    return compile()
