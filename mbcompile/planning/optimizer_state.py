"""The optimizer's state in the plan: its bytes, from the optimizer's own state layout.

``compile(..., optimizer=...)`` sizes the plan's optimizer state from what the user
trains with, and ``with_optimizer`` folds it into the ``SystemSpec`` the cost model
reads (``optimizer_bytes_per_param``, with ``optimizer_source`` saying where it came
from). ``optimizer`` is:

- ``None``: the system's own assumption (8 B per parameter: Adam's two fp32 moments);
- an optimizer instance: the state one step of its class, with its parameter groups
  (and their options: AMSGrad, momentum, ...), creates on meta tensors of the
  parameters' shapes and dtypes (no memory touched, no real step), so a parameter with
  no state yet counts too. torch's Adam keeps its moments in each parameter's dtype: bf16
  moments for bf16 weights. A class that cannot be rebuilt so is read off its own state
  after a step, per element of the parameters that have some;
- a name, for compile-only planning without building one: ``"sgd"`` (no state),
  ``"sgd-momentum"`` (one buffer), ``"adam"``, ``"adamw"`` (two moments), ``"adagrad"``,
  ``"rmsprop"``, ``"adafactor"`` (factored second moments: a row and a column per
  matrix), each sized as that torch optimizer's step creates its state;
- a name with ``"-mixed"`` (``"adamw-mixed"``): mixed precision with fp32 master weights,
  the way mixed-precision trainers keep 16-bit models: every parameter that is not fp32
  gets an fp32 master copy, and the optimizer's state is that of fp32 parameters
  (AdamW over bf16 weights: 4 + 8 = 12 B per parameter, 16 with the weight and its
  gradient).

Counted: every state tensor with elements (moments, momentum buffers, factored
variances); not counted: 0-dim state such as the step count, a few bytes per tensor that
torch keeps on the host unless ``capturable``.

>>> state = optimizer_state("adamw", nn.Linear(4, 4).to(torch.bfloat16))
>>> state.bytes_per_param  # two bf16 moments
4.0
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from mbcompile.errors import ArgumentTypeError, InputError
from mbcompile.planning.systems import SystemSpec

__all__ = ["NAMES", "OptimizerState", "alternatives", "optimizer_state", "with_optimizer"]

#: ``compile(optimizer=<name>)``: the torch class and the arguments its state depends on.
NAMES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {}),                            # no state
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),    # momentum_buffer
    "adam": (torch.optim.Adam, {}),                          # exp_avg, exp_avg_sq
    "adamw": (torch.optim.AdamW, {}),                        # exp_avg, exp_avg_sq
    "adagrad": (torch.optim.Adagrad, {}),                    # sum
    "rmsprop": (torch.optim.RMSprop, {}),                    # square_avg
    "adafactor": (torch.optim.Adafactor, {}),                # row_var + col_var (matrices)
}
#: A name with this suffix keeps fp32 master weights (``"adamw-mixed"``).
MIXED = "-mixed"
#: Flags that place tensors on a device or pick a kernel; a meta step needs them off
#: (they move 0-dim state only, which is not counted).
_DEVICE_FLAGS = ("fused", "foreach", "capturable", "differentiable")


@dataclass(frozen=True)
class OptimizerState:
    """One optimizer's state over a model's trainable parameters; bytes."""

    name: str
    state_bytes: float  # moments, momentum buffers, ... (master weights included)
    master_bytes: float  # of which fp32 master weights ("-mixed")
    num_trainable: int  # trainable parameter elements of the model
    layout: str  # the state tensors and their dtypes, e.g. "exp_avg, exp_avg_sq (bfloat16)"
    how: str  # "its state after a step", "a meta step of torch.optim.AdamW", ...

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.num_trainable if self.num_trainable else 0.0

    def describe(self) -> str:
        master = (f", of which {self.master_bytes / max(self.num_trainable, 1):g} fp32 master "
                  "weights" if self.master_bytes else "")
        return (f"{self.name}: {self.bytes_per_param:.4g} B per parameter ({self.layout}"
                f"{master}; from {self.how})")


def with_optimizer(spec: SystemSpec, optimizer: Any, model: nn.Module) -> SystemSpec:
    """``spec`` with its optimizer state sized for ``optimizer`` (None: unchanged)."""
    if optimizer is None:
        return spec
    state = optimizer_state(optimizer, model)
    return replace(spec, optimizer_bytes_per_param=state.bytes_per_param,
                   optimizer_source=state.describe())


def optimizer_state(optimizer: Any, model: nn.Module) -> OptimizerState:
    """The state ``optimizer`` (an instance or a name, see the module docstring) keeps for
    ``model``'s trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in trainable)
    if isinstance(optimizer, str):
        return _named(optimizer, trainable, count)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(
            f"optimizer must be a torch.optim.Optimizer, one of the names "
            f"{', '.join(map(repr, _all_names()))}, or None, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [p for p in g["params"] if p.requires_grad]}
              for g in optimizer.param_groups]
    try:  # its class's layout for every parameter, even one with no state yet
        return _dry_run(type(optimizer), groups, {}, count, name, mixed=False)
    except InputError:
        held = [(p, optimizer.state[p]) for g in groups for p in g["params"]
                if optimizer.state.get(p)]
        if not held:
            raise
    # a class that cannot be rebuilt on meta tensors: its own state, per element, read off
    # the parameters that have some (a parameter with no gradient yet has none)
    size, layout = _measure(s for _, s in held)
    elements = sum(p.numel() for p, _ in held)
    wanted = sum(p.numel() for g in groups for p in g["params"])
    how = "its state after a step" + (
        f", scaled from the {len(held)} parameters that have state" if elements < wanted else "")
    return OptimizerState(name, size * wanted / elements, 0.0, count, layout, how)


def alternatives(model: nn.Module, spec: SystemSpec) -> dict[str, float]:
    """State bytes of the lighter named optimizers for ``model``: what a fix may suggest
    (with fp32 master weights when ``spec``'s optimizer keeps them: the precision stays)."""
    mixed = MIXED if spec.optimizer_source.split(":")[0].endswith(MIXED) else ""
    return {name + mixed: optimizer_state(name + mixed, model).state_bytes
            for name in ("sgd-momentum", "adafactor", "sgd")}


def _all_names() -> list[str]:
    return [*NAMES, *(n + MIXED for n in NAMES)]


def _named(name: str, trainable: list[torch.Tensor], count: int) -> OptimizerState:
    key = name.strip().lower()
    mixed = key.endswith(MIXED)
    base = key[:-len(MIXED)] if mixed else key
    if base not in NAMES:
        raise InputError(f"unknown optimizer name {name!r}; names are "
                         f"{', '.join(map(repr, _all_names()))}, or pass the optimizer itself")
    cls, kwargs = NAMES[base]
    return _dry_run(cls, [{"params": trainable}], kwargs, count, key, mixed=mixed)


def _dry_run(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
             kwargs: dict[str, Any], count: int, name: str, *, mixed: bool) -> OptimizerState:
    """The state one step of ``cls`` creates, on meta tensors shaped like ``groups``'
    parameters (fp32 copies of the 16-bit ones under ``mixed``)."""
    master = 0.0
    meta_groups = []
    for g in groups:
        clones = []
        for p in g["params"]:
            dtype = p.dtype
            if mixed and dtype in (torch.float16, torch.bfloat16):
                master += p.numel() * 4
                dtype = torch.float32
            clone = torch.empty(tuple(p.shape), dtype=dtype, device="meta", requires_grad=True)
            clone.grad = torch.empty_like(clone)
            clones.append(clone)
        flags = {k: False for k in _DEVICE_FLAGS if k in g}
        meta_groups.append({**g, **flags, "params": clones})
    try:
        opt = cls(meta_groups, **kwargs)
    except Exception as exc:  # a custom class with other required arguments
        raise InputError(
            f"cannot size the state of {cls.__name__}: building it again on meta tensors "
            f"failed ({type(exc).__name__}: {exc}); take one real step before compiling and "
            "pass it then (its state is read as it is), or pass a name such as "
            "optimizer='adamw'") from exc
    try:
        with torch.no_grad():
            opt.step()
    except Exception:  # a meta step stops at its first .item(), after creating the state
        pass
    clones = [p for g in meta_groups for p in g["params"]]
    held = [opt.state[p] for p in clones if p in opt.state]
    if len(held) < len(clones) and cls is not torch.optim.SGD:
        raise InputError(
            f"cannot size the state of {cls.__name__}: a step on meta tensors created state "
            f"for {len(held)} of {len(clones)} parameters; take one real step before compiling "
            "and pass it then, or pass a name such as optimizer='adamw'")
    size, layout = _measure(held)
    how = f"a step of torch.optim.{cls.__name__} on meta tensors"
    return OptimizerState(name, size + master, master, count, layout, how)


def _measure(states: Iterable[dict[str, Any]]) -> tuple[float, str]:
    """Bytes of the state tensors with elements, and their names and dtypes."""
    size = 0.0
    kinds: dict[str, set[str]] = {}
    for state in states:
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                size += value.numel() * value.element_size()
                kinds.setdefault(key, set()).add(str(value.dtype).removeprefix("torch."))
    if not kinds:
        return 0.0, "no state"
    return size, ", ".join(f"{k} ({'/'.join(sorted(d))})" for k, d in kinds.items())
