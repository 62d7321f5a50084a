"""Calls the fx tracer refuses where forward makes them: a graph of values cannot keep them.

``FlatOutputTracer.create_proxy`` asks ``refused_call`` about every call it records, and
raises what it returns, naming the user's line (nothing of the model has changed yet):

- ``self.a.weight.register_hook(fn)`` (or a buffer's): a hook on the model's state stays
  on it after the call, for every later step (and stacks, registered on each call); the
  traced graph only has a hook on the value, for the step (``ops.TensorHook``).
- ``h.register_hook(lambda g: g * m)`` with ``m`` computed in forward: the hook's closure
  holds a traced value, which the hook would be called with at every step.
- ``h.retain_grad()``: the step's backward runs inside the call, per microbatch, so
  ``h.grad`` could never be the step's gradient.
- ``h.t_()``, ``h.swapdims_(0, 1)``: an in-place transpose moves the batch dim of a
  tensor other names may hold; the out-of-place form is followed by the batch analysis.

>>> refused_call("call_method", "retain_grad", (h,), "Net")   # a CaptureError to raise
"""

from __future__ import annotations

import functools
import traceback
import types
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from .errors import CaptureError
from .sources import user_frame

__all__ = ["HOOK_METHODS", "refused_call", "state_hook_error"]

HOOK_METHODS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})
_TRANSPOSES = {"t_": "h = h.t()", "swapdims_": "h = h.swapdims(d0, d1)",
               "swapaxes_": "h = h.swapaxes(d0, d1)"}


def refused_call(kind: str, target: Any, args: tuple[Any, ...], model_name: str
                 ) -> CaptureError | None:
    """The error for a call forward makes that the traced graph cannot keep, or None."""
    if kind == "call_function" and getattr(target, "__name__", None) in OBSERVER_KERNELS:
        return observer_kernel_error(model_name, target.__name__)
    if kind != "call_method" or not args or not isinstance(args[0], fx.Proxy):
        return None
    node = args[0].node
    if target in HOOK_METHODS and node.op == "get_attr":
        return state_hook_error(model_name, str(node.target), target)
    if target == "register_hook" and len(args) == 2:
        held = _traced_value_held(args[1])
        if held is not None:
            m = held if held.isidentifier() else "m"
            return CaptureError(
                f"{model_name}.forward registers a tensor hook whose closure holds "
                f"{held!r}, a value computed in forward, at {_here()}; the hook would be "
                "called with the value of the trace, not of each step. Fix: scale the "
                "gradient in forward instead, keeping the value: for g * "
                f"{m}, h = h.detach() + (h - h.detach()) * {m} (or torch.where(mask, "
                "h, h.detach()) for a boolean mask), or write a torch.autograd.Function whose "
                "backward does it")
    if target == "retain_grad":
        return CaptureError(
            f"{model_name}.forward asks for the gradient of an intermediate at {_here()} "
            "(Tensor.retain_grad()); the compiled step's backward runs inside the call, per "
            "microbatch, so that tensor's .grad would stay None where eager's holds the "
            "gradient. Fix: take the gradient in forward with a tensor hook marked "
            "mbcompile.per_microbatch (h.register_hook(mbcompile.per_microbatch(fn)): fn "
            "gets the gradient's rows of one microbatch per call), or run that step on "
            "the model itself (cm.module)")
    if target in _TRANSPOSES:
        return CaptureError(
            f"{model_name}.forward transposes a tensor in place at {_here()} (Tensor.{target}()), "
            "which moves its batch dim under every name that holds it. Fix: use the "
            f"out-of-place form and its result ({_TRANSPOSES[target]}), or compile with "
            "capture='auto' or capture='export' (torch.export follows the write)")
    return None


#: torch.ao's fused observer kernels: they write the observer's buffers in place without
#: an in-place method fx records (``torch.ao.quantization.FusedMovingAvgObsFakeQuantize``)
OBSERVER_KERNELS = frozenset({"fused_moving_avg_obs_fake_quant",
                              "_fused_moving_avg_obs_fq_helper"})


def observer_kernel_error(model_name: str, kernel: str) -> CaptureError:
    """The error for torch.ao's fused observer ``kernel`` called in forward (QAT)."""
    return CaptureError(
        f"{model_name}.forward calls torch.{kernel} at {_here()}: a quantization observer "
        "(torch.ao's QAT) whose kernel updates the observer's statistics, scale and zero "
        "point in place, unseen by torch.fx, so each microbatch would move them where eager "
        "moves them once per step. Fix: compile with capture='auto' or capture='export' "
        "(torch.export makes those updates values, written once per step; an observer of "
        "activations, which sees the whole batch, is refused there)")


def state_hook_error(model_name: str, state: str, method: str) -> CaptureError:
    """The error for ``method`` (``register_hook``) called in forward on the parameter or
    buffer named ``state``; ``StateAsProxies`` asks it for a call on the tensor itself
    (``for p in self.parameters(): p.register_hook(fn)``), before the call runs."""
    return CaptureError(
        f"{model_name}.forward registers a gradient hook on {state!r} at {_here()}: a hook "
        "on a parameter or buffer stays on it after the call, for every later step "
        "(registered on each call, it stacks), which a traced step cannot replay. Fix: "
        f"register it once outside forward (model.{state}.{method}(fn)), before or after "
        "mbcompile.compile: the compiled step runs it once per step, on the whole step's "
        "gradient, as eager does")


def _here() -> str:
    return user_frame(traceback.extract_stack())


def _traced_value_held(fn: Any) -> str | None:
    """The name of a traced value (an fx proxy, maybe in a list or dict) that ``fn``'s
    closure, defaults or bound arguments hold, or None."""
    for name, value in _held(fn):
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves(value)):
            return name
    return None


def _held(fn: Any) -> list[tuple[str, Any]]:
    """What ``fn`` carries besides its code, by name: closure cells, defaults, a
    ``functools.partial``'s arguments (through ``mbcompile.per_microbatch``'s wrapper)."""
    held: list[tuple[str, Any]] = []
    while True:
        if isinstance(fn, functools.partial):
            held += [("a bound argument", v) for v in (*fn.args, *fn.keywords.values())]
            fn = fn.func
        elif isinstance(getattr(fn, "fn", None), types.FunctionType):  # per_microbatch's
            fn = fn.fn
        else:
            break
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return held
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            held.append((name, cell.cell_contents))
        except ValueError:  # a cell not yet filled
            continue
    defaults = fn.__defaults__ or ()
    positional = code.co_varnames[:code.co_argcount]
    held += list(zip(positional[len(positional) - len(defaults):], defaults))
    held += list((fn.__kwdefaults__ or {}).items())
    return held


def layer_settings_refused(changes: Sequence[Any], model_name: str) -> None:
    """Refuse a setting forward writes into a torch layer (``self.teacher.eval()``,
    ``self.drop.p = 0``, ``bn.momentum = ...``): fx replays forward's writes after the step,
    but a torch layer kept as one call reads its settings when it runs, inside the step, so
    the first step ran a BatchNorm in training where eager's ran it in eval (its running
    statistics overwritten for good; found by a hunt). torch.export traces the layer with
    the setting forward made, so ``capture="auto"`` takes it there."""
    for change in changes:
        owner = change.owner
        if change.kind == "attr" and isinstance(owner, nn.Module) and isinstance(
                change.value, (bool, int, float, str, type(None))) and (  # (a tensor: traced)
                change.key == "training" or type(owner).__module__.startswith("torch.")):
            raise CaptureError(
                f"{model_name}.forward sets {change.where} = {change.value!r} (a layer's "
                "setting: .eval(), .train(), p, eps, momentum); torch.fx replays forward's "
                "writes after the step, where a torch layer reads its settings as it runs, "
                "so the first step would run with the old one. Fix: set it outside forward "
                "(teacher.eval() after model.train(), or override train()), or compile with "
                "capture='auto' or 'export' (torch.export traces the setting forward made)")
