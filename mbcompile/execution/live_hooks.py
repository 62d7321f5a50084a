"""Forward hooks added after compile to a layer the graph calls live.

A layer the fx graph calls as one node (``nn.Linear``, ...) runs its own hooks at each
call, so on each microbatch. compile checks the hooks present when it runs (on a copy of
the layer: ``passes.forward_modes.check_layer_hooks``). A forward hook registered later
is not called on made-up data, since users and tests inject hooks that count rows or fail
on purpose: it is wrapped in ``WatchedHook`` for each call of the compiled module, and put
back after it.
Outside a compiled step the wrapper only calls the hook. Inside one, a hook that only
reads (returns None and changes no tensor in place) runs as written, once per microbatch.
A hook that changes what the layer receives or returns is refused with
``UncheckedHookError`` before the step changes anything, since nothing tells whether it
reads the whole batch (``out - out.mean(0)``).

Example: ``cm = compile(model, ...)``, then ``model.fc.register_forward_hook(lambda m, a, out:
out * 3)``; the next ``cm(x)`` raises, naming ``fc``, and works again after
``handle.remove()`` or after compiling again (which checks the hook).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbcompile.errors import UncheckedHookError

__all__ = ["UncheckedHookError", "WatchedHook", "hook_keys", "in_step", "unwatch",
           "watch_new_hooks"]


class _Steps:
    """How many compiled microbatch calls are running (the wrapper acts only inside one)."""

    depth = 0


in_step = _Steps


class WatchedHook:
    """A user's forward (pre-)hook, called as registered; inside a compiled step it must
    not change the layer's arguments or result (see the module docstring)."""

    __slots__ = ("fn", "layer")

    def __init__(self, fn: Any, layer: str) -> None:
        self.fn, self.layer = fn, layer

    def __call__(self, module: torch.nn.Module, *args: Any) -> Any:
        if not _Steps.depth:
            return self.fn(module, *args)
        tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        result = self.fn(module, *args)
        if result is not None or any(t._version != v for t, v in zip(tensors, versions)):
            raise UncheckedHookError(
                f"a forward hook registered on {type(module).__name__} {self.layer!r} after "
                f"compile changes what the layer {'returns' if len(args) > 1 else 'receives'}"
                " (it returned a value or wrote a tensor in place); the layer runs its hooks "
                "once per microbatch, and compile checks only the hooks present when it ran, "
                "so the step could differ from eager. Fix: register the hook before "
                "mbcompile.compile() (or compile again after registering it), or make it only "
                "read (return None). The step was not run: parameters and gradients are as "
                "they were")
        return result

    def __repr__(self) -> str:
        return f"WatchedHook({self.fn!r})"


def _forward_hook_dicts(layer: torch.nn.Module) -> tuple[dict[int, Any], dict[int, Any]]:
    """The hooks a live layer runs at its call (its backward hooks are in the mode key)."""
    return layer._forward_pre_hooks, layer._forward_hooks


def hook_keys(layers: Iterable[tuple[str, torch.nn.Module]]) -> frozenset[int]:
    """The keys of ``layers``' forward (pre-)hooks: at compile, the ones it checked."""
    return frozenset(k for _, layer in layers for hooks in _forward_hook_dicts(layer)
                     for k in hooks)


def watch_new_hooks(layers: Iterable[tuple[str, torch.nn.Module]], known: frozenset[int]
                    ) -> list[tuple[dict[int, Any], int, Any]]:
    """Wrap, in place, every forward (pre-)hook of ``layers`` whose key is not in ``known``
    (the keys present at compile; ``RemovableHandle`` numbers hooks across all modules), and
    return what ``unwatch`` puts back: the wrapping lasts one call of the compiled module,
    so the user's hook dictionaries are theirs again after it, refused or not."""
    watched = []
    for name, layer in layers:
        for hooks in _forward_hook_dicts(layer):
            if not hooks or known.issuperset(hooks):  # per call: two truth tests a layer
                continue
            for key in [k for k in hooks if k not in known]:
                watched.append((hooks, key, hooks[key]))
                hooks[key] = WatchedHook(hooks[key], name)
    return watched


def unwatch(watched: list[tuple[dict[int, Any], int, Any]]) -> None:
    for hooks, key, fn in watched:
        if key in hooks:  # a hook may remove itself
            hooks[key] = fn
