"""Check a compiled module against one eager full-batch step.

>>> report = compare_to_eager(model, cm, batch)
>>> report.max_relative_error          # outputs, loss and every gradient, worst case

The eager step runs on a deep copy of the model, so the user's parameters and
gradients are untouched by the reference run.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["EquivalenceReport", "compare_to_eager", "relative_error"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are zero)."""
    got, want = got.detach().double(), want.detach().double()
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class EquivalenceReport:
    """Worst relative errors of the compiled step against the eager full batch."""

    outputs: float
    gradients: float
    worst_gradient: str

    @property
    def max_relative_error(self) -> float:
        return max(self.outputs, self.gradients)

    def __str__(self) -> str:
        return (f"max relative error: outputs {self.outputs:.2e}, gradients "
                f"{self.gradients:.2e} (worst: {self.worst_gradient or '-'})")


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    scalars = [t for t in leaves if t.dim() == 0 and t.requires_grad]
    return scalars[0] if scalars else sum(t.sum() for t in leaves if t.requires_grad)


def compare_to_eager(model: nn.Module, compiled: nn.Module, batch: Sequence[Any]
                     ) -> EquivalenceReport:
    """Run one training step both ways (backward on the first scalar output) and compare.

    The compiled step runs on ``model``'s own parameters with their gradients set
    aside and restored afterwards; the eager step runs on a deep copy.
    """
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    want = reference(*batch)
    _loss(want).backward()
    params = dict(model.named_parameters())
    saved = {n: p.grad for n, p in params.items()}
    try:
        for p in params.values():
            p.grad = None
        got = compiled(*batch)
        _loss(got).backward()
        grads = {n: p.grad for n, p in params.items()}
    finally:
        for n, p in params.items():
            p.grad = saved[n]
    out_err = max((relative_error(g, w) for g, w in zip(pytree.tree_leaves(got),
                                                        pytree.tree_leaves(want))
                   if isinstance(w, torch.Tensor)), default=0.0)
    worst, grad_err = "", 0.0
    for name, p in reference.named_parameters():
        if p.grad is None:
            continue
        err = relative_error(grads[name], p.grad)
        if err >= grad_err:
            worst, grad_err = name, err
    return EquivalenceReport(out_err, grad_err, worst)
