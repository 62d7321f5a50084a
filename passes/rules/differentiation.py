"""The rule of ``torch.autograd.grad`` in forward (a gradient penalty: WGAN-GP, R1).

``g = grad(y, x)`` with ``y`` and ``x`` per-sample: ``g[i] = ∂y[i]/∂x[i]`` when nothing
between ``x`` and ``y`` mixes samples, which the facts of ``y`` prove (a per-sample fact is
proved op by op from the graph's inputs, so every path from ``x`` to ``y`` keeps samples
apart). Each microbatch then takes its own rows' gradient, exactly: the graph calls
``torch.autograd.grad`` per microbatch and the step's backward runs through it.

- ``y`` a sum over the whole batch (``d(x).sum()``): each sample's gradient is the
  per-sample outputs' with ones as ``grad_outputs``; the node is specialised to
  ``penalties.grad_of_sums`` so that the sum, a reduction the loop would move behind it,
  is not needed (``penalties.py``).
- ``y`` a mean over the batch, or any other reduction: its gradient is divided by the
  batch size (a microbatch would divide by its own): refused, with ``.sum()`` as the fix.
- ``x`` batch-free (a parameter): the gradient sums over the samples: refused.
- A ``y`` that a mixing op reaches (BatchNorm in training, ``x - x.mean(0)``) is coupled:
  the analysis refuses the differentiation then (``batch_analysis``), as it does in a step
  whose loss couples samples, where the per-sample part first runs without gradients.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import penalties
from ..facts import REDUCTION, Batched, Fact, Free, Reduced
from .context import RuleContext

__all__ = ["autograd_grad_rule"]

_PER_SAMPLE_FIX = ("differentiate the per-sample values themselves: grad(d(x), x, "
                   "grad_outputs=torch.ones_like(d(x))), or their sum: grad(d(x).sum(), x)")


def autograd_grad_rule(ctx: RuleContext) -> Fact:
    """``grad(outputs, inputs)``: per-sample outputs (or their full sum) with respect to
    per-sample inputs give per-sample gradients, one per input."""
    outputs, inputs = _as_tuple(ctx.arg(0, "outputs")), _as_tuple(ctx.arg(1, "inputs"))
    seeds = ctx._kwargs.get("grad_outputs")
    seeds = _as_tuple(seeds) if seeds is not None else (None,) * len(outputs)
    for x in inputs:
        if _made_to_require_grad(x):
            ctx.mix("it differentiates with respect to the caller's own input, made to require "
                    "gradients in place (x.requires_grad_()): eager then also accumulates the "
                    "loss's gradient into the caller's x.grad, and the compiled step never "
                    "writes the caller's tensors",
                    "differentiate with respect to a copy: x = x.detach().requires_grad_(True)")
        if not isinstance(ctx.fact(x), Batched):
            ctx.mix("it differentiates with respect to a value that is not per-sample (a "
                    "parameter, or a statistic of the batch): that gradient adds up every "
                    "sample's part, which a penalty then transforms non-linearly",
                    "differentiate with respect to per-sample inputs (x.requires_grad_())")
    if ctx._kwargs.get("is_grads_batched"):
        ctx.mix("it takes a batch of vector-Jacobian products (is_grads_batched=True), whose "
                "leading dim of grad_outputs is not the samples'", _PER_SAMPLE_FIX)
    values, summed = [], []
    for y, seed in zip(outputs, seeds):
        fact = ctx.fact(y)
        if isinstance(fact, Batched) and isinstance(ctx.fact(seed), (Batched, Free)):
            values.append(y)
            summed.append(False)
        elif seed is None and _full_sum_of_batched(ctx, y):
            values.append(y.args[0])
            summed.append(True)
        elif isinstance(fact, Reduced) and _summing_loss(y):
            name = _summing_loss(y)
            ctx.mix(f"it differentiates {name}(..., reduction='sum'), a plain sum over the "
                    "batch, but one the loss takes inside itself: the per-sample values a "
                    "microbatch differentiates on its own rows are not in the graph",
                    f"spell it {name}(..., reduction='none').sum() (the same value and "
                    f"gradient): grad({name}(..., reduction='none').sum(), x)")
        elif isinstance(fact, Reduced):
            ctx.mix("it differentiates a reduction over the batch other than a plain sum "
                    "(a mean divides each sample's gradient by the batch size, which a "
                    "microbatch does not know)", _PER_SAMPLE_FIX)
        else:
            ctx.mix("it differentiates a value that is not per-sample", _PER_SAMPLE_FIX)
    if any(summed):
        kwargs = {k: v for k, v in ctx._kwargs.items() if k != "grad_outputs"}
        kwargs["summed"] = tuple(summed)
        if seeds != (None,) * len(outputs):
            kwargs["grad_outputs"] = seeds
        ctx.specialise((tuple(values), inputs), kwargs, target=penalties.grad_of_sums)
    return ctx.batched_out()


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _made_to_require_grad(x: Any) -> bool:
    """Whether ``x`` is ``p.requires_grad_()`` of a graph input ``p`` itself."""
    return (isinstance(x, fx.Node) and x.op == "call_method" and x.target == "requires_grad_"
            and isinstance(x.args[0], fx.Node) and x.args[0].op == "placeholder")


def _summing_loss(y: Any) -> str:
    """The name of the loss function ``y`` calls with ``reduction="sum"`` ("" if none)."""
    if not (isinstance(y, fx.Node) and y.op == "call_function"
            and y.kwargs.get("reduction") == "sum"):
        return ""
    name = getattr(y.target, "__name__", "")
    return f"F.{name.removesuffix('_partial')}" if name else "the loss"


def _full_sum_of_batched(ctx: RuleContext, y: Any) -> bool:
    """Whether ``y`` is ``v.sum()`` (every dim, no dtype) of a per-sample ``v``."""
    if not isinstance(y, fx.Node) or y.meta.get(REDUCTION) is None:
        return False
    spec = y.meta[REDUCTION]
    if spec.kind != "sum" or len(y.args) != 1 or y.kwargs:
        return False
    name = y.target if isinstance(y.target, str) else getattr(y.target, "__name__", "")
    return name == "sum" and isinstance(ctx.fact(y.args[0]), Batched)
