"""Shape twins of losses that read values: what a fake-tensor run calls in their place.

The shape pass and the cost model run graphs on fake tensors (``fake_probe``), which carry
shapes and no data. Two losses read data on the way to a result whose shape the inputs'
shapes fix:

- ``F.gaussian_nll_loss`` checks ``torch.any(var < 0)`` in Python (a bool of a tensor);
- ``F.ctc_loss`` sizes its workspace by the longest target (``max(target_lengths)``), so
  torch has no fake kernel for it.

While a probe runs, ``shape_twins()`` sends their calls (as the functional, as the module,
and inside the partials the rewrite puts in their place) to a twin with the same output
shape, dtype and autograd connection. The real step calls torch's own loss, check and all::

    with shape_twins():                                  # inside FakeProbe.run
        F.ctc_loss(lp, tg, il, tl)   # -> ctc_loss(lp, tg, il, tl): a fake () tensor

>>> with shape_twins(): loss = F.gaussian_nll_loss(mu, y, var)  # no read of var's values
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["ctc_loss", "gaussian_nll_loss", "needs_shape_twins", "shape_twins"]


def gaussian_nll_loss(input: torch.Tensor, target: torch.Tensor, var: Any, full: bool = False,
                      eps: float = 1e-6, reduction: str = "mean") -> torch.Tensor:
    """``F.gaussian_nll_loss``'s maths without its check that ``var >= 0``."""
    if isinstance(var, float):
        var = var * torch.ones_like(input)
    elif var.size() != input.size() and input.size()[:-1] == var.size():
        var = var.unsqueeze(-1)  # homoscedastic: one variance per row
    var = var.clamp(min=eps)
    loss = 0.5 * (torch.log(var) + (input - target) ** 2 / var)
    return _reduced(loss, reduction)


def ctc_loss(log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any,
             target_lengths: Any, blank: int = 0, reduction: str = "mean",
             zero_infinity: bool = False) -> torch.Tensor:
    """One value per sample of ``(T, N, C)`` log-probs (``()`` for an unbatched ``(T, C)``),
    reduced as ``F.ctc_loss`` reduces: a mean divides each by its target length first."""
    values = log_probs.logsumexp(-1).sum(0)
    if reduction == "mean":
        lengths = torch.as_tensor(target_lengths, device=values.device)
        return (values / lengths.clamp_min(1)).mean()
    return _reduced(values, reduction)


def _reduced(values: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return values.mean()
    return values.sum() if reduction == "sum" else values


_TWINS = {F.gaussian_nll_loss: gaussian_nll_loss, F.ctc_loss: ctc_loss}


_MODULES = (nn.GaussianNLLLoss, nn.CTCLoss)


def needs_shape_twins(module: nn.Module) -> bool:
    """Whether a run of ``module`` may call one of the losses above: a loss module inside
    it, or a graph node (in it or a graph it holds) calling the functional or its partial.
    The mode costs a Python call per torch call, so a probe enters it only then."""
    for m in module.modules():
        if isinstance(m, _MODULES):
            return True
        if isinstance(m, fx.GraphModule) and any(
                n.op == "call_function" and (n.target in _TWINS or _partial_of_twin(n.target))
                for n in m.graph.nodes):
            return True
    return False


def _partial_of_twin(target: object) -> bool:
    from .partials import LOSSES

    return any(target is loss.partial for loss in LOSSES if loss.fn in _TWINS)


class shape_twins(TorchFunctionMode):  # noqa: N801 (used as a context manager)
    """While a fake-tensor run lasts: the losses above call their twins."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        return _TWINS.get(func, func)(*args, **(kwargs or {}))
