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

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.analysis import Analysed, analyse, at_other_sizes
from mbcompile.captures import Captures
from mbcompile.compiled_module import CompiledModule, Recompile
from mbcompile.dynamic_shapes import checked_symbolic
from mbcompile.errors import CaptureError, InputError, MbcompileError
from mbcompile.execution.live_hooks import global_backward_refused
from mbcompile.execution.replicas import replicas_agreed
from mbcompile.execution.sparse_grads import sharded_sparse_refused
from mbcompile.held_inputs import check_held
from mbcompile.integrations.transformers import (
    TRAINER_KEYWORDS,
    as_the_trainer_sets,
    padded_dims,
    plain_calls,
    trainer_keywords,
)
from mbcompile.length_plans import call_split
from mbcompile.lowering import Lowered, lower
from mbcompile.options import signature_with_options
from mbcompile.passes import global_hooks
from mbcompile.passes.side_effects import Effects, Held
from mbcompile.planning.static_memory import check_static_memory
from mbcompile.reports.report import Validation, validation_of
from mbcompile.request import Request, make_request
from mbcompile.selection import Selection, select
from mbcompile.variants import Family

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
    global_backward_refused("Nothing was compiled or changed")
    inference_tensors_refused(model)
    with _out_of_inference_mode(), replicas_agreed(model, gbs, options):
        request = make_request(model, gbs, num_csx, mbs, **options)
        if request.options.validate_only:
            return _validate(request)
        return _compile_as_called(request)


compile.__signature__ = signature_with_options(compile)  # type: ignore[attr-defined]


def _compile_as_called(request: Request) -> CompiledModule:
    """The chain for the call the model will get. A transformers model that
    ``transformers.Trainer`` calls with keywords of its own (``num_items_in_batch``) is
    compiled for that call (``integrations/transformers.py``), with the lengths a padding
    collator pads symbolic under ``dynamic="auto"``: the Trainer's steps then run this one
    compile. Where the model cannot take the length symbolic it is compiled at the
    example's length, as ``"auto"`` does until a length changes (that change then says
    why it is refused). The config is the one the Trainer sets (``use_cache=False``)."""
    keywords = trainer_keywords(request.inner, request.example)
    if not keywords or plain_calls():  # (mbcompile's own Trainer passes none)
        return _compile_request(request)
    called = request.for_call((), {**request.example, **keywords})
    dims = padded_dims(request.inner, called.example) if request.options.dynamic == "auto" \
        else {}
    with as_the_trainer_sets(request.inner):
        if dims:
            try:
                return _compile_request(called.for_shapes(dims))
            except MbcompileError:
                pass  # the length baked in: fixed until a call changes it (which says why)
        return _compile_request(called)


def _compile_request(request: Request) -> CompiledModule:
    """The chain after the request: analysis, selection, lowering, the compiled module."""
    # before any tracing: a model whose parameters alone cannot fit fails in milliseconds
    sharded_sparse_refused(request.inner)  # FSDP2 has no sparse gradients
    check_static_memory(request.inner, request.system, request.shard)
    captures = Captures(request.gbs)
    with _crash_named(request.model):
        analysed = captures.analysed(request)
        selection = select(request, analysed)
        lowered = _lowered(request, analysed, selection)
        # symbolic dims: the step proved the same at another length, bounded where it holds
        request = _proved(request, selection, lowered, captures, analysed)
    return _module(request, selection, lowered, captures, Family())


def _module(request: Request, selection: Selection, lowered: Lowered, captures: Captures,
            family: Family) -> CompiledModule:
    """The compiled module, handed the chain for what it meets later (``Recompile``), the
    keywords a transformers model's Trainer will add (compiled without a warning) and
    what it shares with the variants of the same compile() (``family``)."""
    example = {k: v for k, v in request.example.items() if k not in TRAINER_KEYWORDS}
    expected = frozenset(trainer_keywords(request.inner, example))
    return CompiledModule(request, selection, lowered, Recompile(
        functools.partial(_relower, request, selection, captures),
        functools.partial(_variant, request, selection, captures, family), expected,
        functools.partial(_split, captures, family), family),
        call_split(request, selection, lowered))


def _split(captures: Captures, family: Family, request: Request, selection: Selection
           ) -> CompiledModule:
    """``request`` lowered for ``selection``, a plan of the same batch with another MBS (a
    call's length chose it: ``length_plans.py``), on the capture and analysis it has."""
    with _crash_named(request.model):
        analysed = captures.analysed(request)
        lowered = _lowered(request, analysed, selection)
    return _module(request, selection, lowered, captures, family)


def _variant(origin: Request, first: Selection, captures: Captures, family: Family,
             request: Request) -> CompiledModule:
    """The chain for ``request``, derived from ``origin`` (``for_batch``, ``for_call``,
    ``for_precision``), whose selection is ``first``: on ``origin``'s capture where one
    serves (``Captures``), with ``first`` itself for the same batch (another keyword set:
    the same plan), else planned with ``first``'s cost model (nothing probed twice; a
    forward-only call probes nothing). Another precision is probed afresh in it."""
    with _crash_named(request.model):
        analysed = captures.analysed(request)
        if request.precision != origin.precision:
            selection = select(request, analysed)
        elif request.per_system_batch_sizes == first.plan.per_system_batch_sizes:
            selection = first
        else:
            selection = select(request, analysed, prior=first)
        lowered = _lowered(request, analysed, selection)
        request = _proved(request, selection, lowered, captures, analysed)
    return _module(request, selection, lowered, captures, family)


def _lowered(request: Request, analysed: Analysed, selection: Selection) -> Lowered:
    """``lower``, with an input forward writes in place refused where the example passes it
    as another input too (``labels=input_ids``: ``check_held``, as at each call)."""
    lowered = lower(request, analysed, selection)
    check_held(request.inputs, [request.example[n] for n in request.inputs.names], (), False,
               lowered.state.written_inputs)
    return lowered


def _relower(request: Request, selection: Selection, captures: Captures) -> Lowered:
    """The request's graph in the model's current train/eval mode and Python state
    (captured once per state, for the module and its variants), lowered again for the
    same selection; with symbolic dims checked the same at other lengths."""
    # no probe calls a global hook (the trace shows them: code_reach); an eval call under
    # torch.inference_mode (Lightning's validation) captures as compile() does, outside it
    with _out_of_inference_mode(), global_hooks.hidden():
        analysed = captures.analysed(request, plan=selection.plan)
        lowered = _lowered(request, analysed, selection)
        # symbolic dims: the graph of the new mode holds at another length too
        _proved(request, selection, lowered, captures, analysed, adopt=False)
    return lowered


def _proved(request: Request, selection: Selection, lowered: Lowered, captures: Captures,
            analysed: Analysed, adopt: bool = True) -> Request:
    """``checked_symbolic`` of ``request``'s step, once per captured graph (``Captures``:
    a variant on the same capture takes the first verdict)."""
    relower = functools.partial(_at_other_lengths, selection=selection, analysed=analysed)
    return captures.proved(request, lowered.original_graph_module, lambda r: checked_symbolic(
        r, lowered, relower, adopt=adopt), adopt)


def _at_other_lengths(request: Request, selection: Selection, analysed: Analysed) -> Lowered:
    """``request`` (the example at other lengths) lowered for ``selection`` on ``analysed``'s
    capture, its shapes and facts found again there (``at_other_sizes``): what
    ``checked_symbolic`` compares with the first step. A capture whose side effects write a
    symbolic size into Python state is captured anew instead, which compares them too."""
    if _sizes_written(analysed.captured.effects):
        found = None  # never from the cache, whose symbolic capture would prove nothing
    else:
        found = at_other_sizes(analysed, request)
    return lower(request, analyse(request, plan=selection.plan, found=found), selection)


def _sizes_written(effects: Effects) -> bool:
    """Whether a side effect writes a value built from sizes without a traced tensor (a
    ``SymInt``): traced values are graph outputs, which the other length's step has too."""
    held = [h for r in effects.records for h in (getattr(r, "value", None),
                                                  getattr(r, "values", None),
                                                  getattr(r, "args", None),
                                                  getattr(r, "kwargs", None))
            if isinstance(h, Held) and not h.traced]
    return any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool))
               for h in held for leaf in pytree.tree_leaves(h.value))


def _validate(request: Request) -> Validation:
    start = time.perf_counter()
    with _crash_named(request.model):
        analysed = analyse(request, validating=True)
    return validation_of(request.name, request.gbs, request.num_csx,
                         analysed.captured.graph_module, time.perf_counter() - start,
                         analysed.rejected, two_phase=analysed.mode == "two_phase")


def inference_tensors_refused(model: Any) -> None:
    """Refuse a model whose parameters or buffers were made under ``torch.inference_mode``
    (inference tensors: no autograd, no version counter), before anything is traced.
    Compile itself runs outside inference mode, whatever the caller's mode."""
    if not isinstance(model, nn.Module):
        return
    for kind, named in (("parameter", model.named_parameters()),
                        ("buffer", model.named_buffers())):
        for name, t in named:
            if isinstance(t, nn.parameter.UninitializedTensorMixin):
                raise InputError(
                    f"{type(model).__name__}'s {kind} '{name}' is not made yet: a lazy layer "
                    "(nn.LazyLinear, LazyConv2d, ...) makes its weights at its first call, "
                    "which compile does not make. Fix: call the model once on a batch "
                    "before compile (model(*example)), or give the layer its sizes; nothing "
                    "was compiled or changed")
            if t.is_inference():
                raise InputError(
                    f"{type(model).__name__}'s {kind} '{name}' is an inference tensor: the "
                    "model was built inside torch.inference_mode(), so its tensors cannot "
                    "take part in autograd, which compile's capture and every training step "
                    "use. Build it outside inference_mode (torch.no_grad() is fine); the "
                    "compiled module may then be called under inference_mode. Nothing was "
                    "compiled or changed")


def _out_of_inference_mode() -> contextlib.AbstractContextManager[Any]:
    """Compile (and a call's recompile) as in grad mode: inside ``torch.inference_mode``
    torch.export cannot capture, and every tensor compile makes would be an inference one."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else \
        contextlib.nullcontext()


@contextlib.contextmanager
def _crash_named(model: nn.Module) -> Iterator[None]:
    """A pass that crashed (not an error of ours): say so with the model's name. The global
    module hooks are hidden from compile's probes (``passes/global_hooks.py``)."""
    try:
        with _out_of_inference_mode(), global_hooks.hidden():  # (also a recompile in a call)
            yield
    except MbcompileError:
        raise
    except Exception as exc:
        raise CaptureError(
            f"compiling {type(model).__name__} failed in mbcompile itself: "
            f"{type(exc).__name__}: {exc}. Please report this with the model.") from exc
