"""Check a compiled module against one eager full-batch step.

>>> report = compare_to_eager(model, cm, batch)
>>> report.max_relative_error          # outputs, loss and every gradient, worst case

The eager step runs on a deep copy of the model, so the user's parameters and
gradients are untouched by the reference run.

A check that cannot pass by accident: every error here is a float in ``[0, inf]``,
never NaN, so ``error <= tol`` is false for anything that went wrong. A NaN or an
infinity that the other side does not have at the same place, a shape mismatch, an
output or a gradient present on one side only: each is an error of ``inf``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

__all__ = ["EquivalenceReport", "compare_to_eager", "relative_error"]


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """``max|got - want| / max(max|want|, floor)``, or ``max|got - want|`` when that is 0.

    >>> relative_error(torch.tensor([1.0, -3.0]), torch.tensor([1.0, -2.0]))
    0.5
    >>> relative_error(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.0]))
    inf

    The rule for values that are not finite: ``got`` and ``want`` must hold the same
    NaNs and the same infinities at the same places (NaN matching NaN, as
    ``equal_nan=True``), and the error is then taken over the finite entries alone;
    any other NaN or infinity, on either side, is an error of ``inf``. So is a shape
    mismatch. Empty tensors of the same shape have error 0. Integer and bool
    tensors are compared as float64, complex ones as complex128. ``floor`` keeps
    a tensor whose eager values are all near zero from dividing by its own rounding.
    The result is never NaN.
    """
    if got.shape != want.shape:
        return math.inf
    dtype = torch.complex128 if got.is_complex() or want.is_complex() else torch.float64
    got, want = got.detach().to(want.device, dtype), want.detach().to(dtype=dtype)
    finite = want.isfinite()
    if not torch.equal(got.isfinite(), finite):
        return math.inf
    if not torch.allclose(got[~finite], want[~finite], rtol=0.0, atol=0.0, equal_nan=True):
        return math.inf
    got, want = got[finite], want[finite]
    if not want.numel():
        return 0.0
    diff = (got - want).abs().max().item()  # inf if two finite values overflow apart
    scale = max(want.abs().max().item(), floor)
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class EquivalenceReport:
    """Worst relative errors of the compiled step against the eager full batch."""

    outputs: float
    gradients: float
    worst_gradient: str
    worst_output: str = ""

    @property
    def max_relative_error(self) -> float:
        """The larger of the two errors; ``inf`` if either is NaN (a NaN never passes)."""
        errors = (self.outputs, self.gradients)
        return math.inf if any(math.isnan(e) for e in errors) else max(errors)

    def __str__(self) -> str:
        return (f"max relative error: outputs {self.outputs:.2e} (worst: "
                f"{self.worst_output or '-'}), gradients {self.gradients:.2e} "
                f"(worst: {self.worst_gradient or '-'})")


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    scalars = [t for t in leaves if t.dim() == 0 and t.requires_grad]
    return scalars[0] if scalars else sum(t.sum() for t in leaves if t.requires_grad)


def _output_errors(got: Any, want: Any) -> dict[str, float]:
    """Relative error per tensor leaf by its path (``[0]``, ``['loss']``); a leaf on
    one side only, or a tensor where the other side has none, is ``inf``."""
    a = {pytree.keystr(p): v for p, v in pytree.tree_flatten_with_path(got)[0]}
    b = {pytree.keystr(p): v for p, v in pytree.tree_flatten_with_path(want)[0]}
    errors = {}
    for path in {**b, **a}:
        g, w = a.get(path), b.get(path)
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor):
            errors[path or "output"] = relative_error(g, w)
        elif path not in a or path not in b or isinstance(g, torch.Tensor) \
                or isinstance(w, torch.Tensor):
            errors[path or "output"] = math.inf
    return errors


def _grad_errors(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]
                 ) -> dict[str, float]:
    """Relative error per parameter; no gradient on both sides is no error, on one is ``inf``."""
    errors = {}
    for name in {**want, **got}:
        g, w = got.get(name), want.get(name)
        if g is not None or w is not None:
            errors[name] = math.inf if g is None or w is None else relative_error(g, w)
    return errors


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    # The errors are never NaN, so max is safe; the first of equal errors wins.
    return max(errors.items(), key=lambda kv: kv[1], default=("", 0.0))


def compare_to_eager(model: nn.Module, compiled: nn.Module, batch: Sequence[Any]
                     ) -> EquivalenceReport:
    """Run one training step both ways (backward on the first scalar output) and compare.

    The compiled step runs on ``model``'s own parameters with their gradients set
    aside and restored afterwards; the eager step runs on a deep copy. Errors follow
    ``relative_error``: any NaN or infinity the eager step does not have at the same
    place, a shape mismatch, or an output or a gradient present on one side only makes
    that error ``inf``, so ``report.max_relative_error <= tol`` fails.
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
    worst_output, out_err = _worst(_output_errors(got, want))
    worst_gradient, grad_err = _worst(
        _grad_errors(grads, {n: p.grad for n, p in reference.named_parameters()}))
    return EquivalenceReport(out_err, grad_err, worst_gradient, worst_output)
