"""Failures injected into a microbatch's backward, for the tests of failed steps.

A parameter's own tensor hooks wait for the caller's ``loss.backward()`` (they fire once
per step, on the step's gradient, as in eager: ``handover.hooks_aside``), so they cannot
put a failure inside the step. A tensor hook on a layer's output can: the layer's forward
hook, marked ``mbcompile.per_microbatch`` (a hook that registers a tensor hook is refused
otherwise), puts it on each microbatch's output, and it fires in that microbatch's
backward, which mbcompile runs inside the call.

Example::

    handle = on_output_gradient(model.net[0], lambda g: 1 / 0)  # every backward raises
    ...
    handle.remove()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

import mbcompile

__all__ = ["on_output_gradient"]


def on_output_gradient(layer: torch.nn.Module, fn: Callable[[torch.Tensor], Any]
                       ) -> RemovableHandle:
    """``fn(grad)`` on the gradient of each output of ``layer`` that requires grad, in the
    backward of the call that made it (a forward hook of ``layer``; remove it with the
    handle returned)."""

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(fn)

    # run on each microbatch on purpose: the failure belongs inside that microbatch
    return layer.register_forward_hook(mbcompile.per_microbatch(hook))
