"""Autograd-only tensor methods ``torch.export`` would drop, refused at the user's line.

Export records a forward's ops on fake tensors; what only changes a tensor's autograd
state leaves no value in the graph, and the compiled step would differentiate as if the
call had not been made:

- ``t = h.detach_()``: lowering drops the in-place detach (it changes no value), so the
  layers that computed ``h`` get a gradient where eager's ``.grad`` stays None;
- ``h.retain_grad()``: it asks for the gradient of the trace's fake tensor; the step's
  ``h`` (one per microbatch) keeps none, so ``h.grad`` stays None where eager's holds it;
- ``t.requires_grad_()`` (or ``(False)`` on a parameter): only the fake tensor's flag
  changes, so nothing is differentiated with respect to ``t``, and what it feeds does
  not require grad as eager's does.

Only calls made by the user's own code (a frame outside torch and mbcompile) that change
something are refused: torch itself calls these methods on its fake tensors while it
traces. A ``requires_grad_`` is refused when the trace ends, so that a gradient penalty
(``x = x.detach().requires_grad_()``, then ``torch.autograd.grad``) is refused for its
differentiation, which is the reason it cannot be kept (``forward_modes.py``).

Before (``forward``)::

    t = self.c(x).detach_()            # a gate computed without gradient

After (``with autograd_state_refused("M"): export(...)``)::

    CaptureError: M.forward detaches a tensor in place at model.py:12: t = self.c(x).detach_()
    ... Fix: use the out-of-place form and its result: t = t.detach()
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .errors import CaptureError
from .shared_patch import SharedPatch
from .sources import user_frame
from .whose_code import user_code

__all__ = ["autograd_state_refused"]

_TENSOR = torch.Tensor
_METHODS = ("detach_", "retain_grad", "requires_grad_")
_ORIGINAL = {name: getattr(_TENSOR, name) for name in _METHODS}
_OWN = {name: name in _TENSOR.__dict__ for name in _METHODS}  # else inherited from TensorBase


class _Recorder:
    """One export's refusals: ``detach_`` and ``retain_grad`` raise at once, a flag change
    is kept (``flipped``) until the trace ends."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.flipped: list[tuple[str, bool]] = []

    def detach_(self, where: str) -> CaptureError:
        return CaptureError(
            f"{self.model_name}.forward detaches a tensor in place at {where} "
            "(Tensor.detach_()); torch.export keeps no in-place detach, so the compiled step "
            "would differentiate through it and train what eager leaves without a gradient. "
            "Fix: use the out-of-place form and its result: t = t.detach()")

    def retain_grad(self, where: str) -> CaptureError:
        return CaptureError(
            f"{self.model_name}.forward asks for the gradient of an intermediate at {where} "
            "(Tensor.retain_grad()); torch.export traces fake tensors and keeps no such "
            "request, and the compiled step runs forward once per microbatch, so that "
            "tensor's .grad would stay None where eager's holds the gradient. Fix: take the "
            "gradient in forward with a tensor hook marked mbcompile.per_microbatch "
            "(h.register_hook(mbcompile.per_microbatch(fn)): fn gets each microbatch's rows "
            "of the gradient, in order) and compile with capture='fx' (torch.export keeps no "
            "tensor hook), or run that step on the model itself (cm.module)")

    def requires_grad_(self, where: str, flag: bool) -> CaptureError:
        return CaptureError(
            f"{self.model_name}.forward sets requires_grad={flag} on a tensor at {where} "
            "(Tensor.requires_grad_()); torch.export records no autograd flag, so the "
            "compiled step would not differentiate as eager does (with respect to that "
            "tensor, or a parameter frozen or unfrozen there), and what it feeds would not "
            "require grad as eager's does. Fix: leave autograd flags alone inside forward: "
            "to keep a gradient, do not detach the value; to freeze or unfreeze a parameter, "
            "set its requires_grad outside forward, between steps")


def _user_caller() -> str | None:
    """``file:line: code`` of the code that called the patched method, when it is the
    user's (not torch's, not mbcompile's, not an installed package's: transformers'
    ``enable_input_require_grads`` hook calls ``requires_grad_`` on the embeddings' output
    for gradient checkpointing, which the compiled step does not need); else None."""
    frame = sys._getframe(2)  # this helper, the patched method, its caller
    if not user_code(frame.f_code.co_filename):
        return None
    return user_frame(traceback.extract_stack(frame, limit=1))


def _recorder() -> _Recorder | None:
    recorder: _Recorder | None = _PATCH.current()
    return recorder


def _detach_(self: torch.Tensor) -> torch.Tensor:
    recorder = _recorder()
    if recorder is not None and self.requires_grad:
        where = _user_caller()
        if where is not None:
            raise recorder.detach_(where)
    return _ORIGINAL["detach_"](self)


def _retain_grad(self: torch.Tensor) -> None:
    recorder = _recorder()
    if recorder is not None and not self.is_leaf:  # on a leaf it does nothing
        where = _user_caller()
        if where is not None:
            raise recorder.retain_grad(where)
    return _ORIGINAL["retain_grad"](self)


def _requires_grad_(self: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    recorder = _recorder()
    if recorder is not None and self.is_leaf and bool(requires_grad) != self.requires_grad:
        where = _user_caller()
        if where is not None:
            # refused when the trace ends, and no flag changes meanwhile: the tensor may be
            # real (a plain tensor attribute of the model)
            recorder.flipped.append((where, bool(requires_grad)))
            return self
    return _ORIGINAL["requires_grad_"](self, requires_grad)  # raises as eager does


_PATCHES: dict[str, Callable[..., Any]] = {
    "detach_": _detach_, "retain_grad": _retain_grad, "requires_grad_": _requires_grad_}


def _install() -> None:
    for name, patch in _PATCHES.items():
        setattr(_TENSOR, name, patch)


def _remove() -> None:
    for name in _METHODS:
        if _OWN[name]:
            setattr(_TENSOR, name, _ORIGINAL[name])
        else:
            delattr(_TENSOR, name)


_PATCH = SharedPatch(_install, _remove)


@contextlib.contextmanager
def autograd_state_refused(model_name: str) -> Iterator[None]:
    """While export traces ``model_name`` on this thread: the user's ``Tensor.detach_()``
    and ``retain_grad()`` in forward raise a ``CaptureError`` at their line, and a
    ``requires_grad_()`` that changes a flag raises one when the trace ends. The patch is
    installed by the first export in progress and removed by the last; other threads'
    calls go straight to torch's methods."""
    recorder = _Recorder(model_name)
    with _PATCH.entered(recorder):
        yield
    if recorder.flipped:
        raise recorder.requires_grad_(*recorder.flipped[0])
