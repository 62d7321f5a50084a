"""Gradient penalties in forward: ``torch.autograd.grad`` of per-sample values, per microbatch.

A WGAN-GP or R1 penalty differentiates the critic's per-sample output with respect to its
per-sample input inside forward, keeps that gradient's graph (``create_graph=True``) and
puts a function of it into the loss; the step's backward then runs through the gradient (a
double backward). Sample ``i``'s gradient depends only on sample ``i`` when the critic keeps
samples apart, which the batch analysis proves (``rules/differentiation.py``). The graph then
calls ``torch.autograd.grad`` as it is, on each microbatch, and the loss's mean over the batch
is combined as every other mean is.

The usual spelling differentiates a sum over the batch, ``grad(d(x).sum(), x)``: a reduction
that the microbatch loop would move behind the loop. Its gradient is the per-sample outputs'
gradient with ones as ``grad_outputs`` (the backward of ``sum`` is exactly that), which keeps
the call inside the microbatch body::

    s = d(x).sum()                                 out = d(x)
    g = torch.autograd.grad((s,), (x,), ...)   ->  g = grad_of_sums((out,), (x,),
                                                                    summed=(True,), ...)

>>> grad_of_sums((out,), (x,), summed=(True,), create_graph=True)  # = grad(out.sum(), x, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["DIFFERENTIATIONS", "grad_of_sums", "takes_gradients"]


def grad_of_sums(outputs: Sequence[torch.Tensor], inputs: Any, *, summed: Sequence[bool],
                 grad_outputs: Sequence[torch.Tensor | None] | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, ...)`` where ``outputs[i]`` stands for its own
    sum when ``summed[i]``: that output's ``grad_outputs`` are ones of its shape."""
    given = list(grad_outputs) if grad_outputs is not None else [None] * len(outputs)
    seeds = [torch.ones_like(y) if s else g for y, s, g in zip(outputs, summed, given)]
    return torch.autograd.grad(tuple(outputs), inputs, grad_outputs=seeds, **kwargs)


#: The differentiations a graph may call inside forward (the fx capture keeps them).
DIFFERENTIATIONS = (torch.autograd.grad, grad_of_sums)


def takes_gradients(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` takes a gradient inside (then ``torch_compile`` leaves it to autograd:
    torch.compile's aot_autograd has no double backward)."""
    return any(n.op == "call_function" and n.target in DIFFERENTIATIONS for n in gm.graph.nodes)
