"""Unwrap pass: a wrapper whose ``forward`` only calls an inner module gives way to it.

Users pass the module they train, which is often a wrapper with
``forward(*args, **kwargs)``: peft's ``PeftModel``, ``torch.compile``'s
``OptimizedModule``, ``DistributedDataParallel``, ``DataParallel``. Such a forward
names no inputs, so nothing can be bound to the graph's placeholders; but the
wrapper only hands the call to an inner module that does name them. This pass
finds that module, so the compiler binds and captures it instead.

Before::

    model = DataParallel(get_peft_model(llama, LoraConfig(...)))   # forward(*inputs, **kwargs)

After (``unwrap(model)``)::

    Unwrapped(module=llama,                        # LlamaForCausalLM, LoRA layers inside
              prefix="module.base_model.model",    # its name in model.named_modules()
              notes=("unwrapped DataParallel -> .module (PeftModel): ...",
                     "unwrapped PeftModel -> .base_model.model (LlamaForCausalLM): ..."))

Steps:

1. the first rule of ``RULES`` that matches the module says what its forward calls
   and what running that module directly changes (the note for ``plan.warnings``);
2. the inner module must be a submodule (so it holds the wrapper's own Parameter
   objects, and the wrapper's ``state_dict()`` keys are its keys under ``prefix``),
   and the wrapper must have no hooks of its own (they would not run);
3. repeat on the inner module until no rule matches.

Only wrappers whose forward is known are recognised: the classes' own forwards, not
a subclass's override, and no ``forward(*args, **kwargs)`` in general (it may do
more than forward). An unrecognised module comes back as it is, and binding its
forward fails as before.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .errors import CaptureError

__all__ = ["RULES", "Step", "Unwrapped", "held_modules_refused", "unwrap"]


@dataclass(frozen=True)
class Step:
    """What one recognised wrapper forwards to, and what running that module directly means."""

    inner: nn.Module  # the module the wrapper's forward calls with the same arguments
    note: str  # for plan.warnings: what the compiled module does differently from the wrapper
    world_size: int = 1  # processes whose gradients the wrapper all-reduces (DDP's group)


@dataclass(frozen=True)
class Unwrapped:
    """The module to bind and capture, where it sits in the user's model, and why."""

    module: nn.Module  # the innermost module; the user's model when nothing was unwrapped
    prefix: str = ""  # its qualified name in the user's model ("" when not wrapped)
    notes: tuple[str, ...] = ()  # one per wrapper removed, outermost first
    world_size: int = 1  # > 1: a DDP wrapper synchronised gradients over that many processes


def _torch_compile(m: nn.Module) -> Step | None:
    # torch._dynamo is imported by torch.compile; when it is not loaded, no OptimizedModule exists
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(m, eval_frame.OptimizedModule):
        return None
    return Step(m._orig_mod, "mbcompile captures the original module and runs its own graph, "
                             "without torch.compile's generated code")


def _distributed_data_parallel(m: nn.Module) -> Step | None:
    if not isinstance(m, DistributedDataParallel) or type(m).forward is not \
            DistributedDataParallel.forward:
        return None
    group = getattr(m, "process_group", None)
    world = group.size() if hasattr(group, "size") else 1
    return Step(m.module, "DistributedDataParallel's gradient all-reduce, buffer broadcast and "
                          "move of the inputs to its device do not run; with "
                          "backend='torch.distributed' mbcompile all-reduces the gradients "
                          "itself", world)


def _data_parallel(m: nn.Module) -> Step | None:
    if not isinstance(m, DataParallel) or type(m).forward is not DataParallel.forward:
        return None
    if len(m.device_ids) > 1:
        return Step(m.module, f"DataParallel's replicas on devices {m.device_ids} are not used: "
                              "the module runs on its own device and returns its full-batch "
                              "output, not outputs gathered per replica")
    return Step(m.module, "DataParallel on one device or none only calls it, after moving "
                          "the inputs to that device (pass them there)")


def _peft(m: nn.Module) -> Step | None:
    # peft is never imported here: its models are known by the forward peft wrote,
    # ``with self._enable_peft_forward_hooks(...): return self.get_base_model()(*args, **kwargs)``
    forward = type(m).forward
    if (not callable(getattr(type(m), "get_base_model", None))
            or getattr(forward, "__module__", "").split(".")[0] != "peft"
            or not _only_variadic(forward)):
        return None
    inner = m.get_base_model()
    if not isinstance(inner, nn.Module):
        return None
    return Step(inner, "peft's forward only calls it (its adapter_names and alora_offsets "
                       "arguments, which select adapters per sample, are not supported)")


def _only_variadic(fn: Callable[..., object]) -> bool:
    """``forward(self, *args, **kwargs)``: no named parameter at all."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return False
    return all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _compiled(m: nn.Module) -> Step | None:
    # mbcompile's own CompiledModule (its face: ``isinstance`` answers as its model's class,
    # so the type is asked): compile() of it (a notebook cell run twice) compiles its model
    face = sys.modules.get("mbcompile.face")
    if face is None or not issubclass(type(m), face.ModelFace):
        return None
    return Step(m._modules["module"], "a module mbcompile compiled: its model is compiled "
                                      "again, for this compile's plan (the first compiled "
                                      "module keeps its own)")


def held_modules_refused(model: nn.Module) -> None:
    """``CaptureError`` for a submodule no capture can trace, naming it and the fix: a
    module mbcompile compiled (a distillation teacher compiled to evaluate it), whose call
    is a microbatch loop, and a TorchScript module (``torch.jit.script``, ``trace``,
    ``load``), whose code is not Python. Checked before anything is traced or changed."""
    face = sys.modules.get("mbcompile.face")
    for name, sub in model.named_modules():
        if not name:
            continue
        if face is not None and issubclass(type(sub), face.ModelFace):
            raise CaptureError(
                f"{type(model).__name__}.{name} is a module mbcompile compiled; a compiled "
                "module's call runs its own microbatch loop, which cannot be traced into "
                f"another. Fix: hold its model instead ({name} = <compiled>.module: the same "
                "parameters, computed as one full batch, which the compiled step splits "
                "exactly); nothing was changed")
        if isinstance(sub, torch.jit.ScriptModule):
            raise CaptureError(
                f"{type(model).__name__}.{name} is a TorchScript module ({type(sub).__name__}: "
                "torch.jit.script, trace or load), whose code neither torch.fx nor "
                f"torch.export can trace. Fix: hold the eager module instead, or compute "
                f"{name}'s outputs outside the model and pass them in as inputs; nothing was "
                "changed")


# One rule per wrapper type: what its forward does with the call, and so what it forwards to.
RULES: tuple[Callable[[nn.Module], Step | None], ...] = (
    _compiled,  # a CompiledModule: -> .module, its model
    _torch_compile,  # OptimizedModule.forward runs _orig_mod through dynamo: -> ._orig_mod
    _distributed_data_parallel,  # syncs buffers, calls .module, arms the all-reduce: -> .module
    _data_parallel,  # scatters the batch over replicas of .module, gathers: -> .module
    _peft,  # PeftModel.forward calls get_base_model() with the same args: -> .base_model.model
)

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _match(m: nn.Module) -> Step | None:
    for rule in RULES:
        if (step := rule(m)) is not None:
            return step
    return None


def _name_in(wrapper: nn.Module, inner: nn.Module) -> str | None:
    return next((n for n, sub in wrapper.named_modules() if sub is inner and n), None)


def unwrap(model: nn.Module) -> Unwrapped:
    """The module that ``model``'s forward hands the call to, through every recognised wrapper.

    ``unwrap(DataParallel(net)).module is net``; a module that is not a recognised
    wrapper comes back as it is, with no notes, and so does the result's module
    (``unwrap(unwrap(m).module)`` unwraps nothing). Raises ``CaptureError`` for a
    recognised wrapper with hooks of its own, which running the inner module skips.
    """
    module, names, notes, world = model, [], [], 1
    while (step := _match(module)) is not None:
        wrapper = type(module).__name__
        hooks = [h for h in _HOOKS if getattr(module, h, None)]
        if hooks:
            raise CaptureError(
                f"{wrapper} has hooks of its own ({', '.join(hooks)}); mbcompile compiles the "
                f"module it wraps ({type(step.inner).__name__}), so they would never run. Fix: "
                f"register them on a submodule of the wrapped module, whose hooks are traced")
        name = _name_in(module, step.inner)
        if name is None:
            raise CaptureError(
                f"{wrapper} forwards to a {type(step.inner).__name__} that is not one of its "
                "submodules, so its parameters and state_dict() keys are not the wrapper's. "
                f"Fix: compile the {type(step.inner).__name__} itself")
        notes.append(f"unwrapped {wrapper} -> .{name} ({type(step.inner).__name__}): "
                     f"{step.note}")
        names.append(name)
        world = max(world, step.world_size)
        module = step.inner
    return Unwrapped(module, ".".join(names), tuple(notes), world)
