"""Constructs: module hooks (forward, pre, backward; on leaves, traced submodules and the
root; present at compile or added after)."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from .base import (
    Construct,
    WithLinear,
    _center_output,
    _double_input,
    _halve_output,
    _halve_root_x,
    _lin,
    _scale_root_loss,
    _shift_input,
)

# ----- module hooks ------------------------------------------------------------- #


class _Inner(nn.Module):
    """A non-leaf submodule (fx traces into it, hooks and all)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _lin()

    def forward(self, h):
        return torch.tanh(self.lin(h))


class ForwardHookLeaf(WithLinear):
    """A forward hook on a leaf ``nn.Linear``, present at compile; mutate removes it."""

    def __init__(self) -> None:
        super().__init__()
        self.handle = self.lin.register_forward_hook(_halve_output)

    def mutate(self, root):
        self.handle.remove()


class ForwardPreHookLeaf(WithLinear):
    """A forward pre-hook on a leaf ``nn.Linear``, present at compile; mutate adds another."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.register_forward_pre_hook(_double_input)

    def mutate(self, root):
        self.lin.register_forward_pre_hook(_shift_input)


class ForwardHookInner(Construct):
    """A forward hook on a non-leaf submodule, present at compile; mutate removes it."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.handle = self.inner.register_forward_hook(_halve_output)

    def forward(self, h, x):
        return h + self.inner(h), None, None

    def mutate(self, root):
        self.handle.remove()


class HookAddedLeaf(WithLinear):
    """No hook at compile; mutate adds a forward hook to a leaf ``nn.Linear``."""

    def mutate(self, root):
        self.lin.register_forward_hook(_halve_output)


class ReadingHookAddedLeaf(WithLinear):
    """No hook at compile; mutate adds a hook to a leaf ``nn.Linear`` that only records
    (returns None, appends to a list): the fuzzer's F6, where it recorded each microbatch's
    rows; now refused, with the list as it was."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    mutation_only_observes = True

    def mutate(self, root):
        self.lin.register_forward_hook(lambda m, args, out: self.seen.append(out.shape[0]))


def _halve_grad_input(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def _center_grad_input(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
    return tuple(None if g is None else g - g.mean(0) for g in grad_input)  # mixes samples


class BackwardHookLeaf(WithLinear):
    """A full backward hook on a leaf ``nn.Linear`` halving the gradient it passes back,
    present at compile; mutate removes it (a live layer's backward hooks recompile)."""

    def __init__(self) -> None:
        super().__init__()
        self.handle = self.lin.register_full_backward_hook(_halve_grad_input)

    def mutate(self, root):
        self.handle.remove()


class BackwardHookMixing(WithLinear):
    """A full backward hook centring the gradient over the batch: couples samples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.register_full_backward_hook(_center_grad_input)


class HookAddedInner(Construct):
    """No hook at compile; mutate adds a forward pre-hook to a non-leaf submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, h, x):
        return h + self.inner(h), None, None

    def mutate(self, root):
        self.inner.register_forward_pre_hook(_double_input)


class ForwardHookMixing(WithLinear):
    """A forward hook that centres a Linear's output over the batch (``out - out.mean(0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin.register_forward_hook(_center_output)


class RootForwardHook(Construct):
    """A forward hook on the model itself, doubling the loss; mutate removes it."""

    def forward(self, h, x):
        return h, None, None

    def install(self, root):
        self.handle = root.register_forward_hook(_scale_root_loss)

    def mutate(self, root):
        self.handle.remove()


class RootPreHook(Construct):
    """A forward pre-hook on the model itself, halving its input ``x``."""

    def forward(self, h, x):
        return h, None, None

    def install(self, root):
        root.register_forward_pre_hook(_halve_root_x)


class RootHookAdded(Construct):
    """No hook at compile; mutate adds a forward hook on the model itself."""

    def forward(self, h, x):
        return h, None, None

    def mutate(self, root):
        root.register_forward_hook(_scale_root_loss)


def _halve_grad_output(module: nn.Module, grad_output: tuple) -> tuple:
    return tuple(None if g is None else g * 0.5 for g in grad_output)


class BackwardPreHookLeaf(WithLinear):
    """A full backward pre-hook on a leaf ``nn.Linear`` halving the gradient it receives,
    present at compile; mutate removes it."""

    def __init__(self) -> None:
        super().__init__()
        self.handle = self.lin.register_full_backward_pre_hook(_halve_grad_output)

    def mutate(self, root):
        self.handle.remove()


class WeightNormLegacy(Construct):
    """The legacy ``torch.nn.utils.weight_norm`` (a forward pre-hook that sets the plain
    attribute ``weight`` from ``weight_g`` and ``weight_v``); mutate rescales ``weight_g``."""

    def __init__(self) -> None:
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.lin = torch.nn.utils.weight_norm(_lin())

    def forward(self, h, x):
        return h + torch.tanh(self.lin(h)), None, None

    def mutate(self, root):
        with torch.no_grad():
            self.lin.weight_g.mul_(2.0)


class RecordingHookLeaf(WithLinear):
    """A forward hook on a leaf ``nn.Linear``, present at compile, that records the layer's
    output in a dict (the usual feature-extraction hook) and counts its calls: F6, refused
    (it would record each microbatch); nothing it wrote at compile or in the refused step
    stays."""

    def __init__(self) -> None:
        super().__init__()
        self.acts: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.lin.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.acts["lin"] = out.detach()
        self.calls += 1


class _Recorded(nn.Module):
    """A module of the user's own around a leaf layer: its hooks are traced."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _lin()

    def forward(self, h):
        return self.lin(h)


def _record_last(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    module.last = out.detach()


class RecordingHookWrapped(Construct):
    """F6's fix: the recording hook on a module of the user's own that wraps the layer,
    keeping what it records on that module: traced, replayed once per step with the whole
    batch's output (exact)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Recorded()
        self.inner.register_forward_hook(_record_last)

    def forward(self, h, x):
        return h + torch.tanh(self.inner(h)), None, None
