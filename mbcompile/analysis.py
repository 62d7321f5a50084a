"""The analysis: capture, state updates, shapes and batch facts, and what they decide.

>>> analysed = analyse(request)
>>> analysed.mode, analysed.fused, analysed.kept
('split', True, None)

This is the one home of what the graph decides for the rest of ``compile()``: the
mode (``"split"``, ``"two_phase"`` or ``"unsplit"``), whether backward runs per
microbatch (``fused``), the outputs a training step keeps, the trained loss (the
batch analysis's), and the graph cut at the loop (``Cut``). The cost model and
the rewrite both read them from here; neither re-derives them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from mbcompile.errors import CaptureError, InputError, MixingError, UnsupportedOpError
from mbcompile.passes import rules
from mbcompile.passes.batch_analysis import BatchAnalysis, analyse_batch, mixing_error
from mbcompile.passes.capture import CaptureResult, OutputSpec, capture, fsdp_modules
from mbcompile.passes.export_blocks import capture_once_per_block
from mbcompile.passes.export_capture import export_capture
from mbcompile.passes.facts import SHAPES, at_analysed_batch_only, input_fact
from mbcompile.passes.forward_modes import (
    check_layer_hooks,
    check_tensor_hooks,
    detach_grad_free_inputs,
)
from mbcompile.passes.generators import seeding_refused
from mbcompile.passes.layer_settings import rule_reads
from mbcompile.passes.legacy_weights import weights_set_after
from mbcompile.passes.microbatch_rewrite import Cut, constants_at, cut_graph
from mbcompile.passes.shape_prop import (
    FAILED_ON_FAKES,
    BlockRun,
    ShapePropagationError,
    shapes_and_cut,
)
from mbcompile.passes.sharded_export import sharded_export
from mbcompile.passes.state_updates import (
    StateUpdates,
    has_mutations,
    lift_state_updates,
)
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.request import Request

__all__ = ["MODES", "Analysed", "analyse", "at_other_sizes", "find", "in_current_mode",
           "kept_outputs", "reusable"]

#: What runs: the batch split into microbatches; a two-phase step (ops that couple
#: samples run once on the whole batch); or the captured graph as it is (one system,
#: one microbatch: nothing is split, so a graph the analysis rejects still runs).
MODES = ("split", "two_phase", "unsplit")


@dataclass(frozen=True)
class Analysed:
    """The captured graph with a batch fact on every node, and what it decides."""

    captured: CaptureResult
    analysis: BatchAnalysis  # the facts, the trained loss, the rejection
    state: StateUpdates  # buffers and inputs the call writes: extra outputs, written back
    mode: str = "split"  # one of MODES
    training: bool = False  # the model was in training mode
    kept: frozenset[int] | None = None  # output leaves a training step returns (None: all)
    cut: Cut | None = None  # the graph cut at the loop (split and two-phase modes)
    gbs: int = 0  # the full batch the shapes and facts were found at
    specialised: bool = False  # a node was rewritten into its full-batch call (squeeze())
    #: a plan that runs one microbatch in all runs the captured graph as it is
    #: (``"unsplit"``): the batch analysis rejected a split that a two-phase step would
    #: have run (``mbs="auto"`` on one system may choose the whole batch)
    unsplit_at_one: bool = False
    #: the shape pass's run of the graph cut to two repeated blocks: the cost model probes
    #: that cut in its fake mode while it holds (``BlockRun.holds``); None: run whole
    block_run: BlockRun | None = None

    @property
    def guards(self) -> tuple[Any, ...]:
        """The Python values the capture read (``passes/guards.py``): it holds while they do."""
        return self.captured.guards

    @property
    def rejected(self) -> MixingError | None:
        return self.analysis.rejected

    @property
    def fused(self) -> bool:
        """Backward runs per microbatch, so one microbatch's activations are alive: a
        single trained loss, or nothing split at all."""
        return self.mode == "unsplit" or self.analysis.fused

    def refused(self, coupling: str) -> MixingError | None:
        """The error that stops a split: the rejection, unless a two-phase step runs it."""
        if self.analysis.two_phase and coupling == "two_phase":
            return None
        return self.analysis.rejected


def analyse(request: Request, *, plan: MicrobatchPlan | None = None,
            validating: bool = False, found: Analysed | None = None) -> Analysed:
    """Analyse ``request.inner`` in its current train/eval mode, and decide once.

    ``plan``: the plan a graph is analysed again for (after a train/eval change; default:
    none yet, so a split is needed unless the request can mean nothing but one system
    running one microbatch). Raises the analysis's ``MixingError`` when a split is needed
    and neither a plain split nor a two-phase step is exact. ``validating``
    (``compile(validate_only=True)``): the facts and the mode only, nothing for a plan.
    This module is the one place that decides ``"unsplit"`` (and, as ``unsplit_at_one``,
    for a plan that turns out to run one microbatch). ``found``: a capture and its facts
    made for another request of the same compile (``reusable`` says when one serves), so
    that only the decisions are made again, for this request's batch.
    """
    model = request.inner
    found = _analyse(model, request) if found is None else found
    single = request.choices.single if plan is None else plan.num_nonempty_microbatches <= 1
    if found.rejected is None:
        mode = "split"
    elif single:
        mode = "unsplit"
    elif found.refused(request.options.coupling) is None:
        if request.shard is not None:
            raise _sharded_two_phase(found.rejected)
        mode = "two_phase"
    else:
        raise found.rejected
    if validating:
        return replace(found, mode=mode, training=model.training)
    kept = kept_outputs(request.options.outputs, found.captured.output_spec, found.analysis,
                        found.state) if model.training else None
    return replace(found, mode=mode, training=model.training, kept=kept,
                   cut=_cut(found, kept, request.gbs) if mode != "unsplit" else None,
                   unsplit_at_one=mode == "two_phase")


def _cut(found: Analysed, kept: frozenset[int] | None, gbs: int) -> Cut:
    """The graph cut at the loop for ``kept`` at a full batch of ``gbs``: the cut ``found``
    holds already, when it was made for the same outputs, with the batch sizes after the
    loop taken at ``gbs`` (the body does not depend on the batch size; a two-phase step's
    coupled part holds those numbers, so it is cut again)."""
    old = found.cut
    # at the analysed batch the numbers are as captured (a non-multiple of the batch size,
    # ``x.size(0) - 1``, can only be taken there: ``reusable`` keeps it to that batch)
    batch = None if gbs == found.gbs else gbs
    if old is None or old.coupled is not None or found.kept != kept:
        return cut_graph(found.analysis, kept, batch=batch)
    if batch is None:
        return old
    return replace(old, part=replace(old.part, constants=constants_at(old.part, batch)))


def find(request: Request) -> Analysed:
    """``request.inner`` captured and its batch facts found at ``request.gbs``, in its current
    train/eval mode: what ``analyse`` decides from (a rejection is kept, not raised)."""
    return _analyse(request.inner, request)


def reusable(found: Analysed, gbs: int) -> bool:
    """Whether ``found`` (captured and analysed at ``found.gbs``) holds at a full batch of
    ``gbs`` too, so that a variant for that batch needs only a plan and a lowering.

    The capture's batch dim is symbolic and the facts are proved from two batch sizes, so
    they hold at any batch of two or more samples, except where a full-batch size was read:
    a graph refused for a baked-in size or a shape the fake run could not follow, a number
    computed non-linearly from the batch size (``1 / x.size(0)``: its value after the loop
    is the analysed batch's), and, at a batch of one, a node rewritten into the call it
    makes at the analysed batch (``squeeze()`` keeps the batch dim there, eager drops it).
    """
    if found.gbs == gbs:
        return True
    if found.gbs < 2 or (found.rejected is not None and not found.analysis.two_phase):
        return False
    if gbs == 1 and found.specialised:
        return False
    return not any(at_analysed_batch_only(n.meta) for n in found.analysis.graph_module.graph.nodes)


def _sharded_two_phase(rejected: MixingError) -> MixingError:
    """A loss that couples samples, on a model sharded with FSDP2: refused, not run. Its
    two-phase step runs the forward twice and differentiates the coupled part by hand,
    which FSDP's hooks (an all-gather per forward, a reduce-scatter per backward) do not
    follow yet, so the step would silently differ."""
    return MixingError(
        f"{rejected}\n  mbcompile runs such a loss exactly as a two-phase step on one "
        "process or on replicated ranks, but not yet on a model sharded with FSDP2 "
        "(fully_shard, or shard='fsdp'). Fix: train it replicated on ranks (backend="
        "'torch.distributed', without fully_shard), or change the loss as above")


def recompute_option(request: Request, analysed: Analysed) -> bool | str:
    """``recompute`` as the model allows (False in eval mode: nothing is trained)."""
    return _recompute(request.options.recompute, analysed) if analysed.training else False


def _capture(model: nn.Module, request: Request) -> CaptureResult:
    """torch.fx symbolic tracing first (its graphs read best), torch.export when it fails.

    A forward that takes ``**kwargs`` (HuggingFace style) goes to torch.export directly:
    fx would turn ``**kwargs`` into one more graph input that no call argument maps to.
    Export traces a model with repeated layers cut to two of them, and the graph is grown
    to all, where the copies compute what each layer does (``passes/export_blocks.py``).
    A model sharded with ``fully_shard`` is exported with stand-ins for its shards and its
    units' calls marked (``passes/sharded_export.py``), as torch.fx captures one.
    """
    var_keyword = any(p.kind == p.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    if request.options.capture == "fx" and var_keyword and not isinstance(model, fx.GraphModule):
        raise CaptureError(
            f"{type(model).__name__}.forward takes **kwargs, which torch.fx turns into an "
            "extra graph input; compile with capture='auto' or capture='export' (torch.export "
            "maps the named parameters), or wrap the model in a Module whose forward names "
            "its inputs.")
    fx_error = None
    if request.options.capture == "fx" or (request.options.capture == "auto" and not var_keyword):
        try:
            return capture(model, request.inputs.concrete)
        except CaptureError as exc:
            if request.options.capture == "fx" or isinstance(model, fx.GraphModule):
                raise
            fx_error = exc
    dims = dict(zip(request.inputs.names, request.inputs.in_dims))

    def exported(module: nn.Module) -> CaptureResult:
        return export_capture(module, dict(request.example), dims, fx_error=fx_error,
                              symbolic=request.inputs.symbolic)

    units = fsdp_modules(model)
    if units:  # FSDP2's shards: exported as stand-ins, each unit's call between markers
        return sharded_export(model, units, exported)
    try:
        by_blocks = capture_once_per_block(model, exported)
    except CaptureError:
        by_blocks = None  # the model cut to two layers does not export: export it whole
    return by_blocks if by_blocks is not None else exported(model)


@contextlib.contextmanager
def _batch_norm_rules(mode: str) -> Iterator[None]:
    """With ``"per_microbatch"``, BatchNorm counts as per-sample for as long as the block runs:
    each microbatch is normalised by its own statistics (the user asked for exactly that)."""
    if mode != "per_microbatch":
        yield
        return
    with rules.scoped():
        for op in rules.BATCH_NORMS:
            if isinstance(op, type) or op is torch.ops.aten.batch_norm:  # single-output forms
                rules.register_batch_rule(op, "per_sample")
        yield


def _analyse(model: nn.Module, request: Request) -> Analysed:
    with _batch_norm_rules(request.options.batch_norm):
        return _analyse_in_scope(model, request)


def _analyse_in_scope(model: nn.Module, request: Request) -> Analysed:
    """Capture, state updates, shapes and batch analysis; a rejection is kept, not raised.

    With ``capture="auto"``, a torch.fx graph that writes in place (not of an FSDP2 model:
    that export left FSDP's root half initialised), or that the analysis refuses for an
    op it has no rule for (an ``fx.wrap``-ped function, an opaque layer), is captured
    again with torch.export, which functionalizes in-place writes and looks inside such
    calls; the export graph is kept when the analysis accepts it. Where export cannot
    capture the model, the fx graph's writes are values already (``fx_writes.py``).
    """
    with seeding_refused(model):  # a seed set in forward would be set once, at compile
        captured = _weights_set_after(_capture(model, request), model)
    may_export = (request.options.capture == "auto" and captured.method != "export"
                  and not isinstance(model, fx.GraphModule))
    if may_export and has_mutations(captured.graph_module) and not fsdp_modules(model):
        exported = _export_instead(model, request)
        if isinstance(exported, CaptureResult):
            return _analyse_captured(exported, request)
        may_export = False  # export cannot capture this model: do not try it twice
    analysed = _analyse_captured(captured, request)
    if may_export and (isinstance(analysed.rejected, UnsupportedOpError) or FAILED_ON_FAKES
                       in str(getattr(analysed.rejected, "reason", ""))):
        exported = _export_instead(model, request)
        if isinstance(exported, CaptureResult):
            second = _analyse_captured(exported, request)
            if second.refused(request.options.coupling) is None:
                return second
    return analysed


def _export_instead(model: nn.Module, request: Request) -> CaptureResult | CaptureError:
    """The torch.export capture, or the error that says why export cannot capture it."""
    try:
        return _weights_set_after(export_capture(
            model, dict(request.example), dict(zip(request.inputs.names, request.inputs.in_dims)),
            symbolic=request.inputs.symbolic), model)
    except CaptureError as exc:
        return exc


def _weights_set_after(captured: CaptureResult, model: nn.Module) -> CaptureResult:
    """``captured`` that also sets legacy ``spectral_norm``'s plain ``weight`` after each
    step (``passes/legacy_weights.py``)."""
    effects = weights_set_after(captured.effects, model, captured.graph_module)
    return captured if effects is captured.effects else replace(captured, effects=effects)


def _analyse_captured(captured: CaptureResult, request: Request) -> Analysed:
    state = lift_state_updates(captured.graph_module)
    state.refuse_plain_tensors(request.model)
    return _shaped(captured, state, request)


def _shaped(captured: CaptureResult, state: StateUpdates, request: Request) -> Analysed:
    """Shapes, hook checks and batch facts of ``state``'s graph at ``request``'s example."""
    gm = state.graph_module
    gbs = request.gbs
    try:
        block_run = shapes_and_cut(gm, request.values, request.inputs.in_dims, gbs)
    except ShapePropagationError as exc:  # a baked-in batch size or a data-dependent shape
        rejected = mixing_error(exc.node, gm, exc.reason, exc.fix)
        return Analysed(captured, BatchAnalysis(gm, rejected=rejected), state, gbs=gbs)
    check_tensor_hooks(gm.graph, type(captured.graph_module).__name__)
    check_layer_hooks(gm, type(captured.graph_module).__name__)
    # no-grad regions of an fx trace, now that the shapes say which values are tensors
    if detach_grad_free_inputs(gm.graph, lambda n: getattr(n.meta.get(SHAPES), "is_tensor",
                                                           False)):
        gm.recompile()
    with rule_reads(gm) as settings:  # a loss's reduction, a softmax's dim: guarded
        found = _with_facts(captured, state, request, gbs)
    if settings:
        captured = replace(captured, guards=(*captured.guards, *settings))
    return replace(found, captured=captured, block_run=block_run)


def _with_facts(captured: CaptureResult, state: StateUpdates, request: Request, gbs: int,
                specialised: bool = False) -> Analysed:
    """The batch facts of ``state``'s graph (its shapes propagated at ``gbs``), in the
    model's current train/eval mode, written on its nodes."""
    gm = state.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    facts = {p.target: input_fact(v, d)
             for p, v, d in zip(placeholders, request.values, request.inputs.in_dims)}
    calls = {n: (n.target, n.args, n.kwargs) for n in gm.graph.nodes}
    analysis = analyse_batch(gm, facts, gbs)
    specialised = specialised or any(  # a rule's ctx.specialise() made a new call
        tuple(map(id, calls.get(n, ()))) != (id(n.target), id(n.args), id(n.kwargs))
        for n in gm.graph.nodes)
    return Analysed(captured, analysis, state, gbs=gbs, specialised=specialised)


def in_current_mode(found: Analysed, request: Request) -> Analysed:
    """``found``'s capture, made in the other train/eval mode, with its batch facts found
    again in the model's current mode (``Captures`` says when the graph is the same: its
    trace read no mode flag that changed, and the layers it calls as nodes are torch's,
    which switch at run time with the same shapes). Only the facts differ (BatchNorm mixes
    samples in training only), so the graph is copied with its nodes' shapes
    (``node.meta`` is copied per node) and each mode keeps its own facts.

    >>> train = find(request)                 # captured, shapes propagated: ~0.3 s
    >>> model.eval()
    >>> in_current_mode(train, request)       # the same graph, eval's facts: milliseconds
    """
    gm = found.state.graph_module
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
    copied.training = request.inner.training  # the flag alone: .train() would reach the layers
    captured = found.captured
    if captured.graph_module is gm:
        captured = replace(captured, graph_module=copied)
    with _batch_norm_rules(request.options.batch_norm):
        return _with_facts(captured, replace(found.state, graph_module=copied), request,
                           found.gbs, found.specialised)


def at_other_sizes(found: Analysed, request: Request) -> Analysed:
    """``found``'s capture (its symbolic dims symbolic) with shapes and batch facts found
    again at ``request``'s example, another length: ``checked_symbolic``'s second program
    without a second capture. The capture does not depend on the length: torch.fx never
    sees the example's tensors, and torch.export's symbolic trace holds for every size its
    guards admit (checked apart); what the length can change is what the shape pass, the
    analysis and the rewrite derive from sizes, and those run again here, on a copy.

    >>> other = at_other_sizes(captures.analysed(request), request.at_other_lengths())
    """
    gm = found.state.graph_module  # the captured graph, its state writes lifted already
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph), type(gm).__name__)
    captured = found.captured
    if captured.graph_module is gm:
        captured = replace(captured, graph_module=copied)
    with _batch_norm_rules(request.options.batch_norm):
        return _shaped(captured, replace(found.state, graph_module=copied), request)


def kept_outputs(option: Any, spec: OutputSpec, analysis: BatchAnalysis,
                 state: StateUpdates) -> frozenset[int] | None:
    """The flat output leaves a training step returns for ``outputs=option`` (None: all).

    The trained losses are always kept (training needs them), and so is the state the
    call writes back.
    """
    if option == "all":
        return None
    # after the model's own leaves: side effects' values (issue 35), then the state
    keep = set(analysis.loss_outputs) | set(range(spec.leaf_count(),
                                                 state.n_outputs + len(state.targets)))
    if option == "loss":
        if not analysis.loss_outputs:
            raise InputError("outputs='loss' needs a loss computed inside the model (a scalar "
                             "that depends on the parameters); this model returns none. Use "
                             "outputs='all', or return the loss from forward")
        return frozenset(keep)
    names = _output_names(spec)
    for name in option:
        if name not in names:
            raise InputError(f"outputs names {name!r}, which the model does not return; its "
                             f"outputs are {sorted(names, key=str)}")
        keep |= names[name]
    return frozenset(keep)


def _output_names(spec: OutputSpec) -> dict[Any, set[int]]:
    """Top-level output names (dict keys, dataclass fields, tuple positions) -> their leaves."""
    def leaves(s: OutputSpec) -> set[int]:
        return {s.index} if s.kind == "leaf" else set().union(*(leaves(c) for c in s.children))

    if spec.kind in ("dict", "dataclass"):
        return {k: leaves(c) for k, c in zip(spec.keys, spec.children)}
    if spec.kind in ("tuple", "list"):
        return {i: leaves(c) for i, c in enumerate(spec.children)}
    return {0: leaves(spec)}


def _recompute(option: bool | str, analysed: Analysed) -> bool | str:
    """``recompute`` as the model allows: a frozen parameter that forward writes (an EMA copy)
    is written back after the step, in place, while a checkpointed block still holds it to
    recompute from (autograd would refuse its new version in backward)."""
    written = [t.name for t in analysed.state.targets if t.kind == "parameter"]
    if not written:
        return option
    if option is True:
        raise InputError(
            f"recompute=True cannot run with a forward that writes the frozen parameter "
            f"{written[0]!r} in place (an EMA copy): the recomputation in backward would "
            "read it after the step wrote it back. Use recompute=False or 'auto'")
    return False
