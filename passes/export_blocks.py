"""Capturing a model by its repeated block, also for training: trace two layers, copy the
rest, and only where the copies compute what each layer computes.

``torch.export`` costs about a quarter of a second of CPU per GPT-2 layer.
``block_capture.capture_by_blocks`` traces a copy of the model whose layer list is cut to
its first two layers and copies the second layer's graph for the others; a plan only
costs that graph, a trained model runs it. So, as torch's regional compilation reuses one
compiled block for every layer whose guards hold, the copies are used only when nothing
the two-layer trace could not see differs:

1. the trace only iterates the cut list (or slices all of it): a forward that reads its
   length or picks layers (``len(self.layers)``, ``self.layers[-1]``, ``self.layers[:3]``)
   computes something else with two layers than with all of them;
2. each later layer is the second's twin in what a graph does not show: the same hooks on
   each of its modules, buffers of the same shapes, equal Python attributes other than
   plain values (plain values the trace read are its guards, which
   ``capture_by_blocks`` checks hold in every later layer);
3. the guards are the user's: those recorded on the cut model's shallow copies move to
   the user's modules, and those of the second layer are repeated for each later one, so
   a later change to any layer's value compiles again.

Otherwise the model is captured whole (None)::

    captured = capture_once_per_block(model, exported) or exported(model)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.nn as nn

from .block_capture import capture_by_blocks, repeated_layers
from .capture import CaptureResult
from .guard_values import fingerprint
from .guards import Guard
from .guards import plain as guarded  # a value the capture guards when forward reads it
from .same_code import HOOKS, MODULE_STATE, helpers_alike

__all__ = ["capture_once_per_block"]

#: What every module keeps in its ``__dict__``: compared by the checks below, or not at all.
_WATCH = threading.local()  # .full: the real number of layers; .reads: what the trace did
_WATCHED: dict[type, type] = {}  # a layer list's class -> its watched subclass


def capture_once_per_block(model: nn.Module, capture: Callable[[nn.Module], CaptureResult]
                           ) -> CaptureResult | None:
    """``capture`` of ``model`` made from its first two layers, its graph grown to all of
    them, or None where that could differ from capturing ``model`` whole."""
    found = repeated_layers(model)
    if found is None:
        return None
    path, layers = found
    if not all(_twins(layers[1], later) for later in list(layers)[2:]):
        return None
    cut: list[nn.Module] = []
    reads: list[str] = []

    def traced(shallow: nn.Module) -> CaptureResult:
        cut.append(shallow)
        with _watched(shallow.get_submodule(path), len(layers), reads):
            return capture(shallow)

    result = capture_by_blocks(model, traced)
    if result is None or reads:
        return None
    return replace(result, guards=_users_guards(result.guards, model, cut[0], path, len(layers)))


def _twins(second: nn.Module, later: nn.Module) -> bool:
    """Whether ``later`` holds what ``second`` does beside its parameters (which
    ``repeated_layers`` compared): hooks, buffer shapes, non-plain attributes."""
    for a, b in zip(second.modules(), later.modules()):
        if any(list(getattr(a, h).values()) != list(getattr(b, h).values()) for h in HOOKS):
            return False
        if [(n, t.shape, t.dtype) for n, t in a.named_buffers(recurse=False)] != \
                [(n, t.shape, t.dtype) for n, t in b.named_buffers(recurse=False)]:
            return False
        mine, theirs = ({k: v for k, v in vars(m).items() if k not in MODULE_STATE}
                        for m in (a, b))
        if mine.keys() != theirs.keys() or not all(
                guarded(mine[k]) or _equal(mine[k], theirs[k])
                or helpers_alike(mine[k], theirs[k]) for k in mine):
            return False
    return True


def _equal(x: Any, y: Any) -> bool:
    """``x`` and ``y`` hold the same: tensors of one shape, dtype, device and values (a meta
    tensor has no values to differ), other objects equal."""
    if x is y:
        return True
    tensors = [isinstance(v, torch.Tensor) for v in (x, y)]
    try:
        if all(tensors):
            return (x.shape, x.dtype, x.device) == (y.shape, y.dtype, y.device) and (
                x.device.type == "meta" or bool(torch.equal(x, y)))
        return not any(tensors) and bool(x == y)
    except Exception:  # an object that does not compare, a fake tensor: not known equal
        return False


@contextlib.contextmanager
def _watched(layers: nn.ModuleList, full: int, reads: list[str]) -> Iterator[None]:
    """While the block runs: what ``layers`` (the cut list) is asked that iterating all of
    it does not answer alike for two layers and for ``full``, appended to ``reads``."""
    cls = type(layers)
    if cls not in _WATCHED:
        _WATCHED[cls] = type(cls.__name__, (cls,), {
            "__len__": _len, "__getitem__": _getitem,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    outer = getattr(_WATCH, "state", None)
    _WATCH.state = (full, reads)
    layers.__class__ = _WATCHED[cls]
    try:
        yield
    finally:
        layers.__class__ = cls
        _WATCH.state = outer


def _len(self: nn.ModuleList) -> int:
    state = getattr(_WATCH, "state", None)
    if state is not None:
        state[1].append("len()")
    return len(self._modules)


def _getitem(self: nn.ModuleList, index: int | slice) -> Any:
    state = getattr(_WATCH, "state", None)
    if state is None:
        return nn.ModuleList.__getitem__(self, index)
    full = range(state[0])
    if not isinstance(index, slice) or full[index] != full:
        state[1].append(f"[{index}]")  # a layer picked, or only some layers
    _WATCH.state = None  # the slice is built with len() of its own: not the model's read
    try:
        return nn.ModuleList.__getitem__(self, index)
    finally:
        _WATCH.state = state


def _moved(guard: Guard, module: nn.Module) -> Guard:
    """``guard`` on ``module``: a container's contents fingerprinted afresh there, since a
    later layer's helper modules are its own (``capture_by_blocks`` checked they run the
    same code as the second layer's)."""
    moved = replace(guard, module=module)
    if guard.contents is None or guard.feeds is not None:
        return moved
    contents, reached = fingerprint(moved.now())
    return replace(moved, value=moved.now(), contents=contents, reached=reached)


def _users_guards(guards: tuple[Guard, ...], model: nn.Module, cut: nn.Module, path: str,
                  count: int) -> tuple[Guard, ...]:
    """The two-layer trace's guards on the user's own modules: the cut model's shallow
    copies give way to the modules they copy, and each guard on the second layer is
    repeated for layers 2 .. ``count``-1 (whose values ``capture_by_blocks`` checked)."""
    names = {id(m): name for name, m in cut.named_modules()}
    second = f"{path}.1"
    out: dict[tuple[int, str], Guard] = {}
    for guard in guards:
        name = names.get(id(guard.module))
        if name is None:  # not a module of the cut model: already the user's
            out.setdefault((id(guard.module), guard.name), guard)
            continue
        copies = [name]
        if name == second or name.startswith(second + "."):
            copies += [f"{path}.{k}{name[len(second):]}" for k in range(2, count)]
        for target in copies:
            module = model.get_submodule(target)
            out.setdefault((id(module), guard.name), _moved(guard, module))
    return tuple(out.values())
