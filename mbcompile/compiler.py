"""``mbcompile.compile``: the chain of stages, each a frozen result computed once.

>>> cm = mbcompile.compile(model, gbs=10, num_csx=3, mbs=2, example_inputs=(ids, labels))
>>> print(cm.plan)                  # systems get 4, 3, 3 samples; 2 microbatches each
>>> loss = cm(ids, labels)          # same call and output structure as model(ids, labels)

request (``request.py``) -> static memory -> analysis (``analysis.py``: capture, shapes,
batch facts) -> selection (``selection.py``: cost model, MBS search, the one plan) ->
lowering (``lowering.py``: rewrite and bind) -> the compiled module
(``compiled_module.py``), which runs what it is given and sends what compile() did not
see (a train/eval change, another batch size or keyword set) back through this chain.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from mbcompile.analysis import analyse
from mbcompile.compiled_module import CompiledModule, Recompile
from mbcompile.dynamic_shapes import checked_symbolic
from mbcompile.errors import CaptureError, MbcompileError
from mbcompile.lowering import Lowered, lower
from mbcompile.options import signature_with_options
from mbcompile.planning.static_memory import check_static_memory
from mbcompile.reports.report import Validation, validation_of
from mbcompile.request import Request, make_request
from mbcompile.selection import Selection, select

__all__ = ["compile"]


def compile(model: nn.Module, gbs: int, num_csx: int, mbs: Any = "auto",
            **options: Any) -> CompiledModule | Validation:
    """Compile ``model`` to run a global batch of ``gbs`` over ``num_csx`` systems.

    ``mbs`` is ``"auto"``, ``"none"``, an int, or ``"explore"``; ``options`` are
    ``CompileOptions``'s (``mbcompile/options.py``: ``example_inputs`` /
    ``example_kwargs``, one example call of any batch size, and the rest), which
    ``inspect.signature(compile)`` lists with their defaults. Returns a
    ``CompiledModule`` (a ``Validation`` with ``validate_only=True``). Raises
    ``MixingError`` when splitting the batch would change the result and no two-phase
    step fits, and ``DoesNotFitError`` when the plan exceeds the system's memory. Every
    parameter is described once, in docs/api.md.
    """
    request = make_request(model, gbs, num_csx, mbs, **options)
    if request.options.validate_only:
        return _validate(request)
    return _compile_request(request)


compile.__signature__ = signature_with_options(compile)  # type: ignore[attr-defined]


def _compile_request(request: Request) -> CompiledModule:
    """The chain after the request: analysis, selection, lowering, the compiled module;
    also what the module calls for a variant (a request derived from this one)."""
    # before any tracing: a model whose parameters alone cannot fit fails in milliseconds
    check_static_memory(request.inner, request.system, request.shard)
    with _crash_named(request.model):
        analysed = analyse(request)
        selection = select(request, analysed)
        lowered = lower(request, analysed, selection)
        # symbolic dims: the step proved the same at another length, bounded where it holds
        request = checked_symbolic(request, lowered, functools.partial(
            _relower, selection=selection, checked=False))
    return CompiledModule(request, selection, lowered, Recompile(
        functools.partial(_relower, request, selection), _compile_request))


def _relower(request: Request, selection: Selection, checked: bool = True) -> Lowered:
    """The request's graph in the model's current train/eval mode and Python state,
    analysed and lowered again for the same selection; with symbolic dims ``checked``
    the same at other lengths (``checked_symbolic``)."""
    lowered = lower(request, analyse(request, plan=selection.plan), selection)
    if checked:
        checked_symbolic(request, lowered, functools.partial(
            _relower, selection=selection, checked=False), adopt=False)
    return lowered


def _validate(request: Request) -> Validation:
    start = time.perf_counter()
    with _crash_named(request.model):
        analysed = analyse(request, validating=True)
    return validation_of(request.name, request.gbs, request.num_csx,
                         analysed.captured.graph_module, time.perf_counter() - start,
                         analysed.rejected, two_phase=analysed.mode == "two_phase")


@contextlib.contextmanager
def _crash_named(model: nn.Module) -> Iterator[None]:
    """A pass that crashed (not an error of ours): say so with the model's name."""
    try:
        yield
    except MbcompileError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"compiling {type(model).__name__} failed in mbcompile itself: "
            f"{type(exc).__name__}: {exc}. Please report this with the model.") from exc
