"""Calls that wrap a compiled module's call and cannot wrap its step: refused by name.

The training step runs every microbatch's forward and backward inside the call and hands
the gradients to the caller's ``loss.backward()`` (``handover.py``). What transforms or
replays the call from outside sees an ``autograd.Function`` whose forward already ran
backwards, and fails deep inside with torch's words, or silently trains nothing:

- ``torch.func`` (``grad``, ``vmap``, ``jacrev`` over ``functional_call(cm, ...)``:
  per-sample gradients, meta-learning): functorch cannot transform that Function;
- ``torch.utils.checkpoint`` around the call: the non-reentrant one re-runs it in backward
  and meets the step's own backwards (``Unexpected state: target_frame.early_stop``); the
  reentrant one calls it under ``no_grad``, a forward-only step, and its backward finds no
  graph (``element 0 of tensors does not require grad``).

Each is refused at the call, before anything runs, naming the way that works.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.checkpoint import CheckpointFunction

from mbcompile.passes.errors import InputError

__all__ = ["outer_calls_refused"]

_REENTRANT = CheckpointFunction.forward.__code__
_NOTHING = "nothing was changed"


def outer_calls_refused() -> None:
    """Raise ``InputError`` where the call is made inside a ``torch.func`` transform or a
    ``torch.utils.checkpoint`` (a C read per call; the frames are walked only under
    ``no_grad``, where a reentrant checkpoint calls its function)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise InputError(
            "a compiled module was called inside a torch.func transform (grad, vmap, jacrev, "
            "... over functional_call(cm, ...)); its step runs each microbatch's backward "
            "inside the call, which functorch cannot transform. Fix: transform the model "
            f"itself (functional_call(cm.module, ...)); {_NOTHING}")
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if (hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint") \
            or (not torch.is_grad_enabled() and _in_reentrant_checkpoint()):
        raise InputError(
            "a compiled module was called inside torch.utils.checkpoint; its training step "
            "runs each microbatch's forward and backward inside the call, keeping one "
            "microbatch's activations at a time, which a checkpoint around it would run "
            "again (or, reentrant, under no_grad, training nothing). Fix: call it directly, "
            "and checkpoint inside each microbatch with compile(..., recompute=True) "
            f"(activation checkpointing per block, exact); {_NOTHING}")


def _in_reentrant_checkpoint(depth: int = 12) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is _REENTRANT:
            return True
        frame = frame.f_back
    return False
