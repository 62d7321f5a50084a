"""Hooks ``torch.export`` would drop, refused before it traces.

Export traces fake tensors through ``make_fx``: a module's forward hooks run and are traced
into the graph, but what only autograd sees is lost. A full backward hook
(``register_full_backward_hook``, ``register_full_backward_pre_hook``, the global ones) and
a ``Tensor.register_hook`` in forward leave no node, so the compiled step's gradients
would silently differ from eager's. torch.fx keeps both (a hooked leaf layer is a
``call_module`` the runtime calls with its hooks; a tensor hook is a ``tensor_hook`` node).

>>> lin = torch.nn.Linear(2, 2)
>>> _ = lin.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
>>> try:
...     backward_hooks_refused(torch.nn.Sequential(lin), "Sequential")
... except CaptureError as e:
...     print(str(e)[:64])
Sequential: torch.export cannot keep the backward hooks of '0' (
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules import module as module_globals

from .errors import CaptureError
from .global_hooks import forward_hooks
from .sources import user_frame

__all__ = ["backward_hooks_refused", "global_hooks_refused", "module_tracker_note",
           "tensor_hooks_refused"]


def backward_hooks_refused(model: torch.nn.Module, model_name: str,
                           fx_error: BaseException | None = None) -> None:
    """A ``CaptureError`` naming the modules of ``model`` with backward hooks (and the global
    backward hooks) that export would trace without; ``fx_error``, why torch.fx failed
    first, is quoted."""
    hooked = [repr(name) if name else "the model itself" for name, m in model.named_modules()
              if m._backward_hooks or m._backward_pre_hooks]
    if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
        hooked.append("every module (register_module_full_backward_hook)")
    if hooked:
        raise CaptureError(
            f"{model_name}: torch.export cannot keep the backward hooks of "
            f"{', '.join(hooked[:4])}{' ...' if len(hooked) > 4 else ''} (it traces without "
            "them), so their gradients would change silently. Fix: make the forward "
            "traceable by torch.fx and compile with capture='fx' (it calls a hooked layer "
            "with its hooks), or remove the hooks while training"
            + (f"\n  torch.fx.symbolic_trace failed first: {fx_error}" if fx_error else ""))


def global_hooks_refused(model_name: str, fx_error: BaseException | None = None) -> None:
    """A ``CaptureError`` where a global module forward hook is registered: export calls it
    on fake tensors, more than once per module, and on its own wrapper modules, so what it
    records would not be eager's (global backward hooks: ``live_hooks``)."""
    hooks = forward_hooks()  # hidden while compile runs
    if hooks:
        fn = getattr(hooks[0], "__wrapped__", hooks[0])
        raise CaptureError(
            f"{model_name}: torch.export cannot keep the global module hook "
            f"{getattr(fn, '__qualname__', type(fn).__name__)!r} (register_module_forward_hook)"
            ": it calls it on fake tensors, more than once per module, and on its own "
            "wrapper modules, so what it records or changes would not be eager's. Fix: make "
            "the forward traceable by torch.fx and compile with capture='fx' (it traces the "
            "hook where forward enters a module, and watches it on each torch layer), or "
            "remove the hook while compiling and training; nothing was changed"
            + module_tracker_note(fn)
            + (f"\n  torch.fx.symbolic_trace failed first: {fx_error}" if fx_error else ""))


def module_tracker_note(fn: Any) -> str:
    """Where the hook is torch's ``ModuleTracker``'s, who installed it (the user did not)."""
    if not getattr(fn, "__module__", "").startswith("torch.utils.module_tracker"):
        return ""
    return ("\n  That hook is torch.utils.module_tracker.ModuleTracker's, which "
            "FlopCounterMode installs while it is active (Lightning's ModelSummary does so at "
            "max_depth other than 1 when the module sets example_input_array): call the "
            "compiled module outside FlopCounterMode (in Lightning: ModelSummary(max_depth=1), "
            "or leave example_input_array unset)")


@contextlib.contextmanager
def tensor_hooks_refused(model_name: str) -> Iterator[None]:
    """While export traces: ``Tensor.register_hook`` in forward is an error at its line.

    Export traces fake tensors and keeps no hook; torch.fx keeps one as a ``tensor_hook``
    node (``passes/ops.py``), but only where no branch reads ``requires_grad``.
    """
    original = torch.Tensor.register_hook

    def refused(self: torch.Tensor, hook: Any) -> Any:
        where = user_frame(traceback.extract_stack()[:-1])
        raise CaptureError(
            f"{model_name}.forward registers a tensor hook at {where}; torch.export traces "
            "without hooks, so its gradient would change silently. Fix: register the hook "
            "without a branch on tensor values or requires_grad, and compile with "
            "capture='fx' or 'auto' (torch.fx keeps it); or use a module backward hook "
            "(register_full_backward_hook) on a submodule")

    torch.Tensor.register_hook = refused  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]
