"""Hooks on the model itself under ``torch.export``: traced, or refused where they read
the call.

Export calls the model with every input by keyword (defaults included), so a forward hook
or pre-hook of the model itself sees ``args=()`` and a ``kwargs`` of every input, where
eager's call hands it what the caller passed. A hook that reads neither (``out * 2``, a
loss scaled, a flag set) is traced as eager runs it; one that reads them
(``tuple(a.flip(1) for a in args)``, ``args[0]``, ``len(args)``) would silently see other
values (a pre-hook mapping over ``args`` sees none and changes nothing), so it is refused
once export has run, with nothing changed. A submodule's hooks see what forward passes
it, as in eager; ``capture.py`` refuses every root hook for torch.fx, which never calls
them. mbcompile's own hooks (``sharded_export``'s brackets) are its business.

>>> with root_hooks_watched(model, "Net"):
...     program = torch.export.export(...)   # CaptureError after it, if a hook read args
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .errors import CaptureError

__all__ = ["root_hooks_watched"]


class _Read:
    """The hooks that read the call's arguments, by name, in the order they did."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def mark(self, fn: Callable[..., Any]) -> None:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if name not in self.names:
            self.names.append(name)


def _watch_methods(cls: type, base: type, names: tuple[str, ...]) -> None:
    """Each method of ``names`` on ``cls`` marks the hook as reading, then is ``base``'s."""
    for name in names:
        method = getattr(base, name)

        def read(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            self._read.mark(self._hook)
            return _method(self, *args, **kwargs)

        setattr(cls, name, read)


class _Args(tuple):
    """The ``args`` a root hook is handed under export, noting any look at them."""

    _read: _Read
    _hook: Callable[..., Any]

    def __new__(cls, args: tuple[Any, ...], read: _Read, hook: Callable[..., Any]) -> _Args:
        watched = super().__new__(cls, args)
        watched._read, watched._hook = read, hook
        return watched


class _Kwargs(dict):
    """The ``kwargs`` a ``with_kwargs`` root hook is handed under export, likewise."""

    _read: _Read
    _hook: Callable[..., Any]

    def __init__(self, kwargs: dict[str, Any], read: _Read, hook: Callable[..., Any]) -> None:
        super().__init__(kwargs)
        self._read, self._hook = read, hook


_watch_methods(_Args, tuple, ("__iter__", "__getitem__", "__len__", "__contains__",
                              "__add__", "__mul__", "__eq__", "__ne__", "__lt__", "__le__",
                              "__gt__", "__ge__", "__hash__", "__repr__", "index", "count"))
_watch_methods(_Kwargs, dict, ("__iter__", "__getitem__", "__len__", "__contains__", "get",
                               "keys", "values", "items", "copy", "pop", "popitem",
                               "setdefault", "update", "clear", "__setitem__", "__delitem__",
                               "__reversed__", "__eq__", "__ne__", "__repr__", "__or__",
                               "__ror__", "__ior__"))


def _flattened(watched: Any) -> tuple[list[Any], Any]:
    """torch's pytree reads a watched ``args``/``kwargs`` (``tree_leaves(args)``) as a
    read: it flattens them as the plain tuple and dict they hold."""
    watched._read.mark(watched._hook)
    if isinstance(watched, dict):
        keys = list(dict.keys(watched))
        return [dict.__getitem__(watched, k) for k in keys], keys
    return list(tuple.__iter__(watched)), None


pytree.register_pytree_node(_Args, _flattened, lambda values, _: tuple(values))
pytree.register_pytree_node(_Kwargs, _flattened, lambda values, keys: dict(zip(keys, values)))


def _watching(fn: Callable[..., Any], with_kwargs: bool, pre: bool, read: _Read
              ) -> Callable[..., Any]:
    def watched(module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
        seen_args, seen = _Args(args, read, fn), rest
        if with_kwargs:
            seen = (_Kwargs(rest[0], read, fn), *rest[1:])
        out = fn(module, seen_args, *seen)
        if not pre or out is None:
            return out
        # a pre-hook's result is the call's arguments: handed back as they came, they are
        # torch's own again (its call unpacks them, which is no read of the hook's); any
        # other result rewrites them from what the hook saw, which is not eager's
        if out is seen_args:
            return args
        if with_kwargs and isinstance(out, tuple) and len(out) == 2 and \
                out[0] is seen_args and out[1] is seen[0]:
            return args, rest[0]
        read.mark(fn)
        return out

    watched.__wrapped__ = fn  # type: ignore[attr-defined]
    return watched


@contextlib.contextmanager
def root_hooks_watched(model: torch.nn.Module, model_name: str,
                       fx_error: BaseException | None = None) -> Iterator[None]:
    """While the block exports ``model``: its own forward hooks and pre-hooks handed
    watched arguments; a ``CaptureError`` after it where one read them (``fx_error``, why
    torch.fx failed first, is quoted unless it was this same refusal)."""
    read = _Read()
    swapped: list[tuple[dict[int, Any], int, Any]] = []
    for hooks, keyed in ((model._forward_pre_hooks, model._forward_pre_hooks_with_kwargs),
                         (model._forward_hooks, model._forward_hooks_with_kwargs)):
        for key, fn in list(hooks.items()):
            if getattr(fn, "__module__", "").startswith("mbcompile."):
                continue
            swapped.append((hooks, key, fn))
            hooks[key] = _watching(fn, key in keyed, hooks is model._forward_pre_hooks, read)
    failed: BaseException | None = None
    try:
        yield
    except BaseException as exc:  # a hook that read them may be why export failed
        if not read.names:
            raise
        failed = exc
    finally:
        for hooks, key, fn in swapped:
            if key in hooks:
                hooks[key] = fn
    if read.names:
        if fx_error is not None and "hooks on the model itself" in str(fx_error):
            fx_error = None  # torch.fx's words for the same hooks
        raise CaptureError(
            f"{model_name} has a hook on the model itself that reads the call's arguments "
            f"({', '.join(repr(n) for n in read.names)}); torch.export calls the model with "
            "every input by keyword, so it would not see the arguments eager's call passes "
            "it, and the step would differ silently. Fix: register it on a submodule (its "
            "hooks see what forward passes it), move its work into forward, or compile a "
            "wrapper Module whose forward calls the model; nothing was changed"
            + (f"\n  torch.fx.symbolic_trace failed first: {fx_error}" if fx_error else "")
        ) from failed
