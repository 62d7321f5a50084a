"""The modes a phase runs in: the plan it is compiled for (a training plan, also for
validation) and the autocast its calls run under (the precision ``compile_options`` name)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from mbcompile.errors import MbcompileError
from mbcompile.planning.precision import parse_precision
from mbcompile.training.batches import TrainerError

__all__ = ["compiled_for_phase", "step_autocast"]


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


def step_autocast(model: nn.Module, options: Mapping[str, Any]
                  ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The autocast a Trainer's calls of the compiled module run under, as Lightning's
    precision plugin runs them: the precision ``options`` name (``"bf16-mixed"``: each
    step's call in bfloat16 autocast, the optimizer step outside it), none for
    ``"auto"`` (whatever autocast ``fit``'s caller holds). Without it a config's
    ``precision: bf16-mixed`` planned bfloat16 and trained in float32, silently.
    ``"fp16-mixed"`` needs a loss scaler between the backward and the optimizer step,
    which the Trainer does not run: refused, with the fix."""
    value = options.get("precision", "auto")
    if value == "auto":
        return contextlib.nullcontext
    precision = parse_precision(value)
    if precision.dtype == torch.float16:
        raise TrainerError(
            "precision fp16-mixed needs a GradScaler between each backward and optimizer "
            "step, which the Trainer does not run: use precision bf16-mixed, or train the "
            "compiled module in your own loop with torch.amp.GradScaler")
    device = next((p.device.type for p in model.parameters()), "cpu")
    return lambda: precision.autocast(device)
