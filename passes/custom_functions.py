"""Custom ``torch.autograd.Function`` calls met while capturing a model: refused, or checked.

Both captures trace a Function's ``forward`` like any other code (``torch.fx`` on
proxies, ``torch.export`` on fake tensors), so the graph holds the forward's ops and
nothing of the Function's own ``backward``: the compiled step trains with autograd's
derivative of the forward. That is exact where ``backward`` *is* that derivative
(BLOOM's ``GeLUFunction``: a hand-written derivative of its tanh GELU) and silently
wrong where it is not (a gradient reversal, ``forward: x``, ``backward: -g``; a
straight-through estimator).

- fx (``refused_in_fx``): the values are proxies, without shapes to test with, so a
  call is an error at the user's line, with the way out: a module trusted with
  ``mbcompile.trust_module`` stays one node, is called as written, and keeps the
  Function's backward.
- export (``checked_in_export``): each distinct call of a Function (its inputs' shapes
  and dtypes and its other arguments) is recorded; after the export, its backward is
  compared with autograd's derivative of its forward on random inputs of those shapes
  (every float input differentiated, random masks, one vector-Jacobian product with
  the same random cotangent; NaN and infinity must fall at the same places): equal to
  the dtype's rounding, the inlined forward is kept; otherwise the capture is an error
  naming the Function. An output the Function marks non-differentiable
  (``ctx.mark_non_differentiable``) is detached where the trace returns it, as eager's
  has no gradient: export's inlined forward would differentiate it.

Functions of torch itself are traced as before. ``torch.utils.checkpoint``'s reentrant
``CheckpointFunction``, whose backward is its forward's derivative recomputed, is traced
as the function it checkpoints: its forward runs that function under ``torch.no_grad()``,
which is not a no-grad region of the model (``passes/forward_modes.py``).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from .errors import CaptureError
from .shared_patch import SharedPatch

__all__ = ["checked_in_export", "refused_in_fx"]

# normwise relative error allowed between the two derivatives, by dtype (rounding of
# two differently ordered computations; a wrong backward is off by order 1)
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}
_LOW_PRECISION = 5e-2


@dataclass(frozen=True)
class _Like:
    """A traced tensor argument, as shape (size hints) and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@contextlib.contextmanager
def refused_in_fx(model_name: str) -> Iterator[None]:
    """While fx traces ``model_name``: a user's ``Function.apply`` on a proxy raises."""
    def on_call(cls: type, where: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if any(isinstance(v, fx.Proxy) for v in pytree.tree_leaves((args, kwargs))):
            raise CaptureError(_message(
                model_name, cls, where, "fx traces it on symbolic values, with no shapes to "
                "check its backward on; capture='auto' or 'export' checks it numerically"))

    with _watching(on_call):
        yield


@contextlib.contextmanager
def checked_in_export(model_name: str) -> Iterator[None]:
    """While ``model_name`` is exported: record each user Function's call; after the
    export, raise unless every one's backward is its forward's derivative."""
    # every distinct call: a Function's backward may depend on its other arguments
    # (fairseq's GradMultiply(x, scale) is the forward's derivative only at scale 1)
    calls: dict[tuple[type, str], tuple[type, str, Any]] = {}

    def on_call(cls: type, where: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> _Finish | None:
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(v, torch.Tensor) for v in leaves):
            like = pytree.tree_map(_like, (args, kwargs))
            calls.setdefault((cls, repr(like)), (cls, where, like))
        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                           for v in leaves):
            return _non_differentiable_detached
        return None

    with _watching(on_call):
        yield
    for cls, where, like in calls.values():
        why = _derivative_mismatch(cls, like)
        if why is not None:
            raise CaptureError(_message(model_name, cls, where, why, export=True))


def _non_differentiable_detached(out: Any) -> Any:
    """``out``, what ``apply`` returned while a traced input requires grad, with each float
    tensor that autograd left without a gradient detached: those are the outputs the
    Function marked non-differentiable (and tensors nested in what forward returned, which
    autograd does not wrap). Eager's have no ``grad_fn``; the graph's copy of the forward's
    ops would be differentiated, so a ``detach`` in the graph stands for the mark."""
    def detached(t: torch.Tensor) -> torch.Tensor:
        differentiable = t.is_floating_point() or t.is_complex()
        return t.detach() if differentiable and not t.requires_grad else t

    return pytree.tree_map_only(torch.Tensor, detached, out)


def _message(model_name: str, cls: type, where: str, why: str, export: bool = False) -> str:
    fix = "capture with capture='fx' (export traces into every module), and " if export else ""
    return (f"{model_name}.forward calls the custom autograd.Function {cls.__qualname__} at "
            f"{where}: capturing records the ops of its forward and drops its backward, so "
            f"the compiled step would train with autograd's derivative of "
            f"{cls.__name__}.forward, not {cls.__name__}.backward ({why}). Fix: {fix}call it "
            f"inside a submodule and trust that module with mbcompile.trust_module(...) if "
            f"it treats samples independently (a trusted module stays one node and runs as "
            f"written, backward included)")


_BASE = torch.autograd.Function
_ORIGINAL = _BASE.__dict__["apply"]
_Finish = Callable[[Any], Any]  # what a watcher does to apply's result
_Watcher = Callable[[type, str, tuple[Any, ...], dict[str, Any]], _Finish | None]


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    watcher = _PATCH.current()
    if watcher is not None and cls is CheckpointFunction:
        # reentrant checkpointing: values and gradients are run_function's own; its forward's
        # torch.no_grad() (undone by the recompute in backward) is not a region of the model
        run_function, _, *inputs = args
        return run_function(*inputs)
    finish = None
    if watcher is not None and not cls.__module__.startswith("torch."):
        from .sources import user_frame

        finish = watcher(cls, user_frame(traceback.extract_stack()[:-1]), args, kwargs)
    out = _ORIGINAL.__func__(cls, *args, **kwargs)
    return out if finish is None else finish(out)


def _install() -> None:
    _BASE.apply = classmethod(_apply)  # type: ignore[method-assign,assignment]


def _remove() -> None:
    _BASE.apply = _ORIGINAL  # type: ignore[method-assign]


_PATCH = SharedPatch(_install, _remove)


@contextlib.contextmanager
def _watching(on_call: _Watcher) -> Iterator[None]:
    """``Function.apply`` reports each call of a Function defined outside torch, made on
    this thread, to ``on_call``, and hands its result to what ``on_call`` returns, if
    anything. The patch is installed by the first capture in progress and removed by the
    last, whatever the order in which threads finish; other threads' calls go straight to
    the original."""
    with _PATCH.entered(on_call):
        yield


def _like(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return v
    shape = tuple(s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in v.shape)
    return _Like(shape, v.dtype)


class _Context:
    """What an old-style ``forward(ctx, ...)`` may call on its context; nothing is kept."""

    def __init__(self, args: tuple[Any, ...]) -> None:
        # as torch's: one flag per positional input, True for a tensor that requires grad
        self.needs_input_grad = tuple(isinstance(a, torch.Tensor) and a.requires_grad
                                      for a in args)

    def save_for_backward(self, *tensors: Any) -> None: ...
    def mark_dirty(self, *tensors: Any) -> None: ...
    def mark_non_differentiable(self, *tensors: Any) -> None: ...
    def set_materialize_grads(self, value: bool) -> None: ...


def _derivative_mismatch(cls: type, like: Any) -> str | None:
    """None where ``cls.backward`` equals autograd's derivative of ``cls.forward`` on random
    inputs shaped as ``like`` (to the dtype's rounding), else what differs."""
    gen = torch.Generator().manual_seed(0)

    def real(v: Any) -> Any:
        if not isinstance(v, _Like):
            return v
        if v.dtype.is_floating_point or v.dtype.is_complex:
            # every float input differentiated, whatever the trace's flag (a compile under
            # torch.no_grad traces values that do not require grad, but the step's do)
            return torch.randn(v.shape, generator=gen, dtype=v.dtype).requires_grad_()
        if v.dtype == torch.bool:  # masks: both values, so a mask cannot hide a difference
            return torch.rand(v.shape, generator=gen) < 0.5
        return torch.zeros(v.shape, dtype=v.dtype)  # indices: 0 is always valid

    def run(fn: Callable[[], Any]) -> list[Any]:
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            torch.manual_seed(0)  # the same draws for both, the user's RNG untouched
            return pytree.tree_leaves(fn())

    try:
        args, kwargs = pytree.tree_map(real, like, is_leaf=lambda v: isinstance(v, _Like))
        inputs = [t for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:
            return None  # no float input: no gradient flows through it
        new_style = any("setup_context" in k.__dict__ for k in cls.__mro__
                        if not k.__module__.startswith("torch."))

        def fresh(fn: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
            # each run on its own copies, which are not leaves: forward may write into its
            # inputs (ctx.mark_dirty), which autograd refuses on a leaf
            a, k = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
            return fn(a, k)

        own = run(lambda: fresh(lambda a, k: cls.apply(*a, **k)))
        derived = run(lambda: fresh(lambda a, k: cls.forward(*a, **k) if new_style
                                    else cls.forward(_Context(a), *a, **k)))
        outs = [i for i, o in enumerate(own) if isinstance(o, torch.Tensor) and o.requires_grad]
        cotangents = {i: torch.randn(own[i].shape, generator=gen, dtype=own[i].dtype)
                      for i in outs}
        want = _vjp([own[i] for i in outs], [cotangents[i] for i in outs], inputs)
        kept = [i for i in outs if isinstance(derived[i], torch.Tensor)
                and derived[i].requires_grad]
        got = _vjp([derived[i] for i in kept], [cotangents[i] for i in kept], inputs)
    except Exception as exc:  # noqa: BLE001  (anything: it could not be shown equal)
        return f"its backward could not be checked on random inputs: {type(exc).__name__}: {exc}"
    for x, a, b in zip(inputs, want, got):
        why = _differ(a, b, _TOLERANCE.get(x.dtype, _LOW_PRECISION))
        if why is not None:
            return why
    return None


def _differ(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> str | None:
    """How two gradients differ beyond ``tolerance`` (normwise, relative), else None. Their
    non-finite entries must sit at the same places; the finite rest is compared, and a
    gradient with no finite entry cannot be compared at all."""
    if not a.numel():
        return None
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return ("on random inputs its backward and the derivative of its forward are not "
                "finite at the same places")
    if not finite.any():
        return "on random inputs its gradient has no finite entry to compare"
    a, b = a[finite], b[finite]
    scale = max(a.abs().max().item(), b.abs().max().item(), 1e-30)
    error = (a - b).abs().max().item() / scale
    if error > tolerance:
        return (f"on random inputs its backward and the derivative of its forward differ "
                f"by {error:.2g} relative")
    return None


def _vjp(outputs: list[torch.Tensor], cotangents: list[torch.Tensor],
         inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    if not outputs:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]
