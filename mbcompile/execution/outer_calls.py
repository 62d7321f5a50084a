"""Calls that wrap a compiled module's training step and cannot wrap it: refused by name.

The training step runs every microbatch's forward and backward inside the call and hands
the gradients to the caller's ``loss.backward()`` (``handover.py``). What transforms or
replays that call from outside sees an ``autograd.Function`` whose forward already ran
backwards, and fails deep inside with torch's words:

- ``torch.func`` (``grad``, ``jacrev`` over ``functional_call(cm, ...)``: per-sample
  gradients, meta-learning): functorch cannot transform that Function;
- ``torch.utils.checkpoint`` (non-reentrant) around the call: its saved-tensor hooks meet
  the step's own backwards (``Unexpected state: target_frame.early_stop``);
- ``torch.autograd.forward_ad.dual_level()`` around the call (a JVP through a training
  step, ``make_dual(x, t)``): the step's Function has no ``jvp``, so the loss and outputs
  came back without tangents, silently, where eager's carry them;
- ``FlopCounterMode`` (Lightning's ``measure_flops``, MFU loggers): its ``ModuleTracker``'s
  global hooks would see each microbatch's layers and a gradient hook on outputs whose
  backward already ran (they were refused as the user's hooks, also in a step without
  a loss inside: ``flop_counter_refused``).

Each is refused when the call is about to run that step (grad enabled, a parameter
trained, the loss inside the model: ``runtime._run``), before any microbatch runs. A call
that trains nothing (``no_grad``, frozen parameters, ``vmap`` of a forward) is not a step,
and runs as before (it carries forward-mode tangents as eager's does). A reentrant
checkpoint calls its function under ``no_grad``: the compiled call is then forward-only,
as eager's, and eager's own error follows at backward where no input required grad.

A call under ``torch.no_grad()`` whose forward takes a gradient inside (an energy model's
score: ``torch.enable_grad()`` around ``torch.autograd.grad``) runs its body with grad
on, as eager's region does, and returns its outputs detached (``forward_only``).

One wrapper is let through: ``torch.compile(cm)`` (``Trainer(torch_compile=True)``,
``Accelerator(dynamo_backend=...)``). Dynamo would trace into the step's Python (its
split, the seeding, the hand-over) and fail there; ``outside_dynamo`` makes the call a
graph break, so the step runs as it does uncompiled (``compile(..., torch_compile=True)``
is the way to have inductor compile the microbatch body).

Under ``capture="export"``, ``functional_call(cm, ...)`` puts plain tensors in the model's
parameter slots, which torch.export refuses to capture (``SpecViolationError``), grad on
or off: ``live_hooks.capture_refused`` names that cause and the fix in place of export's own advice.
(Under ``capture="fx"`` it runs: computed weights, MAML's fast weights, are handed their
gradient by the step's backward, ``handover.FusedStep``.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
import torch.fx as fx

from mbcompile.execution.live_hooks import UncheckedHookError, called_as
from mbcompile.passes import global_hooks
from mbcompile.passes.errors import InputError
from mbcompile.passes.penalties import takes_gradients

__all__ = ["forward_only", "flop_counter_refused", "outer_calls_refused",
           "outside_dynamo"]

_DIFFERENTIATES: weakref.WeakKeyDictionary[fx.GraphModule, bool] = weakref.WeakKeyDictionary()


def forward_only(run: Callable[[], list[tuple[Any, ...]]], body: Any
                 ) -> list[tuple[Any, ...]]:
    """``run()``, a call that trains nothing. Under ``torch.no_grad()`` a ``body`` that
    takes a gradient inside runs with grad on: the graph keeps no grad-mode switch for an
    ``enable_grad()`` region (the trace ran with grad on throughout), and eager's region
    turns it on for its ``torch.autograd.grad`` (it failed: "element 0 of tensors does
    not require grad"). Its outputs come back detached, as eager's computed outside that
    region."""
    if torch.is_grad_enabled() or not isinstance(body, fx.GraphModule):
        return run()
    if body not in _DIFFERENTIATES:
        _DIFFERENTIATES[body] = takes_gradients(body)
    if not _DIFFERENTIATES[body]:
        return run()
    with torch.enable_grad():
        results = run()
    return [tuple(v.detach() if isinstance(v, torch.Tensor) else v for v in r) for r in results]


@torch._disable_dynamo
def outside_dynamo(compiled: torch.nn.Module, call: Callable[..., Any],
                   args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``called_as`` out of dynamo's trace: what ``torch.compile(cm)`` runs at the call
    (torch imports dynamo only here, where it is already imported)."""
    return called_as(compiled, compiled.module, call, args, kwargs)


def outer_calls_refused() -> None:
    """Raise ``InputError`` where a training step is called inside a ``torch.func``
    transform, a non-reentrant ``torch.utils.checkpoint`` or a forward-mode AD level, and
    ``UncheckedHookError`` inside ``FlopCounterMode`` (two C reads, a global's, and two
    truth tests of torch's global hook tables)."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise InputError(
            "a compiled module's training step was called inside a torch.func transform "
            "(grad, jacrev, ... over functional_call(cm, ...)); the step runs each "
            "microbatch's backward inside the call, which functorch cannot transform. Fix: "
            "transform the model itself (functional_call(cm.module, ...)); nothing was changed")
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint":
        raise InputError(
            "a compiled module's training step was called inside torch.utils.checkpoint; the "
            "step runs each microbatch's forward and backward inside the call, keeping one "
            "microbatch's activations at a time, which a checkpoint around it would run "
            "again. Fix: call it directly, and checkpoint inside each microbatch with "
            "compile(..., recompute=True) (activation checkpointing per block, exact); "
            "nothing was changed")
    if forward_ad._current_level >= 0:  # inside ``with forward_ad.dual_level():``
        raise InputError(
            "a compiled module's training step was called inside "
            "torch.autograd.forward_ad.dual_level(); the step runs each microbatch's "
            "backward inside the call and carries no forward-mode tangents, so the loss's "
            "and outputs' tangents would be None where eager's has them. Fix: call the "
            "training step outside the dual level, and take the JVP on a forward-only call "
            "(under torch.no_grad(): exact) or on the model itself (cm.module); nothing was "
            "changed")
    flop_counter_refused()


def flop_counter_refused() -> None:
    """Raise ``UncheckedHookError`` (the error a hook that would run per microbatch gets)
    where a training step runs inside ``FlopCounterMode``: its ``ModuleTracker``'s global
    module hooks are registered."""
    if global_hooks.module_tracker():
        raise UncheckedHookError(
            "a compiled module's training step was called inside "
            "torch.utils.flop_counter.FlopCounterMode: the global module hooks are "
            "torch.utils.module_tracker.ModuleTracker's, which FlopCounterMode installs while "
            "it is active (Lightning's measure_flops, an MFU logger, ModelSummary at "
            "max_depth other than 1 with example_input_array), and they register gradient "
            "hooks on each module's outputs; the step runs each microbatch's forward and "
            "backward inside the call, so they would see each microbatch's layers and outputs "
            "whose backward already ran, and the counts would not be eager's. Fix: count a "
            "forward-only call (under torch.no_grad(): the counts of the model's forward), or "
            "count the training step on the model itself (cm.module); in Lightning: "
            "ModelSummary(max_depth=1), or leave example_input_array unset. Nothing was "
            "changed")
