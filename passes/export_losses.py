"""What torch.export cannot capture of losses and norms that read values, said at the source.

Three calls read tensor values on their way to a result whose shape the inputs fix, which
torch.export, tracing with a dynamic batch, cannot follow (it fails with a bare
``GuardOnDataDependentSymNode`` or ``DynamicOutputShapeException``):

- ``F.gaussian_nll_loss``: its check ``torch.any(var < 0)`` is a Python ``if``;
- ``F.ctc_loss``: torch has no shape-only kernel (the workspace is sized by the longest
  target);
- ``BatchNorm(momentum=None)`` in training: its cumulative average weighs each batch by
  ``1 / float(num_batches_tracked)``.

The torch.fx capture runs all three exactly (``loss_shapes``, ``fake_probe``), and
``capture="auto"`` tries it first; when export is used, these refusals say so::

    with losses_read_values_refused("Net", fx_error):
        torch.export.export(...)        # F.ctc_loss(...) -> CaptureError at the user's line
"""

from __future__ import annotations

import traceback
from typing import Any

import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import CaptureError
from .sources import user_frame

__all__ = ["layers_export_refuses", "losses_read_values_refused"]

_WHY = {F.gaussian_nll_loss: "its check that var >= 0 reads the variances' values",
        F.ctc_loss: "torch has no shape-only kernel for it (it sizes its work by the longest "
                    "target, a value)"}


def _fix(fx_error: BaseException | None) -> str:
    tried = f" torch.fx failed first: {fx_error}." if fx_error is not None else ""
    return (f"the torch.fx capture runs it exactly (capture='fx').{tried} Fix: make forward "
            "traceable by torch.fx, or compute this part outside the compiled module")


class losses_read_values_refused(TorchFunctionMode):  # noqa: N801 (a context manager)
    """While torch.export traces: ``F.gaussian_nll_loss`` and ``F.ctc_loss`` are refused at
    the user's line, with why and the fx way."""

    def __init__(self, model_name: str, fx_error: BaseException | None = None) -> None:
        super().__init__()
        self.model_name, self.fx_error = model_name, fx_error

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func in _WHY:
            where = user_frame(traceback.extract_stack()[:-1])
            raise CaptureError(
                f"{self.model_name}.forward calls F.{func.__name__} ({where}); torch.export "
                f"cannot capture it with a dynamic batch: {_WHY[func]}; "
                + _fix(self.fx_error))
        return func(*args, **(kwargs or {}))


def layers_export_refuses(model: nn.Module, model_name: str,
                          fx_error: BaseException | None = None) -> None:
    """Refuse before export traces a BatchNorm in training with ``momentum=None``, or an
    embedding with ``max_norm`` (its rows renormalised in place at every call: export
    records a write into a trained parameter, with no line to show)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None \
                and module.weight.requires_grad:
            raise CaptureError(
                f"{model_name}: {type(module).__name__} {name!r} has max_norm="
                f"{module.max_norm}: it renormalises the rows it looks up in place, in its "
                "trained weight, which torch.export cannot keep; " + _fix(fx_error).replace(
                    "compute this part outside the compiled module",
                    "renormalise the weight outside forward (max_norm=None)"))
        if (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None
                and module.training and module.track_running_stats):
            raise CaptureError(
                f"{model_name}: {type(module).__name__} {name!r} has momentum=None in "
                "training: its cumulative average weighs each batch by 1 / "
                "num_batches_tracked, read as a Python number, which torch.export cannot "
                "trace with a dynamic batch; " + _fix(fx_error).replace(
                    "compute this part outside the compiled module",
                    "give it a momentum (momentum=0.1)"))

