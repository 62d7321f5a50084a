"""The compiled module: what ``compile()`` returns, called like the model.

>>> cm = mbcompile.compile(model, gbs=10, num_csx=3, mbs=2, example_inputs=(ids, labels))
>>> loss = cm(ids, labels)          # same call and output structure as model(ids, labels)
>>> loss.backward()                 # param.grad == the full-batch gradient, to rounding

It runs the ``Selection`` (the one plan) and the ``Lowered`` graph of compile()'s chain.
What compile() did not see goes back through the chain, handed in as ``Recompile`` (it
never imports the compiler): a train/eval change (BatchNorm mixes samples only in
training), a replaced parameter or a changed guard lowers again with the same plan, once
per state; another batch size, keyword set or length is a request derived from the
first, compiled once on the first capture and kept (``variants.py``).
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from mbcompile.errors import (
    CompileOnlyError,
    InputError,
    RecompileWarning,
    RetainedActivationsWarning,
)
from mbcompile.execution.handover import output_grads_refused
from mbcompile.execution.live_hooks import called_as, hook_keys, unwatch, watch_hooks
from mbcompile.execution.outer_calls import outside_dynamo
from mbcompile.execution.rank_shares import check_not_in_ddp, share_refused
from mbcompile.face import ModelFace
from mbcompile.guard_cache import GuardCache
from mbcompile.held_inputs import check_held
from mbcompile.inputs import (
    CallBinder,
    InputPresenceError,
    batch_size,
    check_layout,
    check_unchanged,
    input_layout,
)
from mbcompile.length_plans import CallSplit, for_length, last_run
from mbcompile.lowering import Lowered
from mbcompile.mode_key import changed_since, hooks_by_module, is_submodule, key_of, slots
from mbcompile.passes.autocast_regions import refuse_outer_autocast
from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.fake_probe import holds_no_data
from mbcompile.passes.guards import numbers_as_inputs
from mbcompile.passes.side_effects import replay
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.planning.precision import ambient_precision
from mbcompile.reports.report import render
from mbcompile.request import Request, device_type
from mbcompile.selection import Selection
from mbcompile.variants import (
    Family,
    for_batch,
    for_changed,
    for_keywords,
    for_shapes,
    for_size_one,
)

__all__ = ["CompiledModule", "Recompile"]


@dataclass(frozen=True)
class Recompile:
    """compile()'s chain, for what the module meets after compile(); picklable (module-level
    functions and ``functools.partial``s of them), like the module."""

    #: the first request's graph again, in the model's current train/eval mode and Python
    #: state: analysis and lowering, for the same selection (the plan does not change)
    relower: Callable[[], Lowered]
    #: a request derived from the first (``for_batch``, ``for_call``) through the whole chain
    variant: Callable[[Request], CompiledModule]
    #: keywords a caller adds to forward's ``**kwargs`` that the compiler expects (those of
    #: transformers' Trainer, ``integrations/transformers.py``): compiled without a warning
    expected_keywords: frozenset[str] = frozenset()
    #: the request lowered for another selection of the same batch (another split for a
    #: call's length: ``length_plans.for_length``), on the same capture
    split: Callable[[Request, Selection], CompiledModule] | None = None
    #: what the module shares with its variants (the first module, the seed guesses)
    family: Family = field(default_factory=Family)


class CompiledModule(ModelFace, nn.Module):
    """A model compiled for microbatching: call it like the model.

    Attributes: ``plan`` (a ``MicrobatchPlan``, of the last call's shape), ``graph_module``
    (the rewritten ``fx.GraphModule``: split -> loop over ``graph_module.body`` -> accumulate),
    ``original_graph_module`` (the captured graph, annotated with batch facts),
    ``estimate`` (modelled memory and step time of the plan on ``system``) and
    ``exploration`` (the MBS values the choice evaluated); ``report()`` says it all.
    Parameters are the model's own (shared, not copied); ``state_dict()`` is the
    model's, so it loads into the original and back. It looks like the model
    (``mbcompile.face``): attributes it does not have are the model's (``cm.config``,
    ``cm.generate(...)``), and ``inspect.signature(cm.forward)`` is the model's forward's.
    A batch of another size than ``gbs`` is planned and compiled on first sight, once per
    size (and per kind of call: training, or forward only), in milliseconds, with a
    ``BatchSizeWarning`` (unless ``batch_sizes="fixed"``); so are other keywords through
    ``**kwargs`` and other lengths, with a ``RecompileWarning`` (``variants.py``).
    """

    def __init__(self, request: Request, selection: Selection, lowered: Lowered,
                 recompile: Recompile, split: CallSplit | None = None) -> None:
        super().__init__()
        self.module = request.model  # the user's model, wrapper and all: its state_dict() keys
        # what the graphs were captured from (model, or what a wrapper calls): not registered
        object.__setattr__(self, "_inner", request.inner)
        object.__setattr__(self, "_request", request)
        object.__setattr__(self, "_selection", selection)  # its own: ``selection`` follows calls
        # how a call's length chooses its split (None: it does not), and what the last call
        # ran where not this module's own plan: (module, its selection as shown or None)
        object.__setattr__(self, "_split", split)
        object.__setattr__(self, "_ran", None)
        object.__setattr__(self, "_recompile", recompile)
        object.__setattr__(self, "compile_only", request.options.compile_only)
        object.__setattr__(self, "rank", selection.rank)
        object.__setattr__(self, "backend", request.options.backend)
        object.__setattr__(self, "noise_scale", request.noise_scale)
        object.__setattr__(self, "_binder", CallBinder(request.signature))
        face = inspect.signature(request.inner.forward)
        object.__setattr__(self, "_face_signature", face)
        # isinstance(cm, type(model)) (face.py); not for a GraphModule, which torch.compile
        # and fx would take for a graph to run in place of this module's forward
        object.__setattr__(self, "_face_class", None if isinstance(request.inner, fx.GraphModule)
                           else type(request.inner))
        # forward takes **kwargs: the names it has besides, and the keywords the example
        # passed there (a call with others runs a variant compiled for them: _for_keywords)
        object.__setattr__(self, "_named", frozenset(face.parameters) if any(
            p.kind == p.VAR_KEYWORD for p in face.parameters.values()) else None)
        object.__setattr__(self, "_keywords", request.keywords)
        object.__setattr__(self, "_variants", {})  # a batch size, keyword set... -> variants.py
        self.__dict__.update(_inputs=request.inputs, _layout=input_layout(
            request.inputs, request.values, lowered.values_fixed))  # export holds dtypes
        object.__setattr__(self, "_cache", GuardCache())
        self.__dict__.update(_modules_seen=(), _slots_seen=None,  # _mode_key's, and
                             _hooks_seen=None)  # _hooks_by_module at the last compile
        object.__setattr__(self, "_live_hooks", frozenset())  # layers whose hooks run live
        object.__setattr__(self, "_live_layers", ())  # (name, layer) of those layers
        object.__setattr__(self, "_hooks_known", frozenset())  # their hooks checked at compile
        object.__setattr__(self, "_watchers", {})  # the wrappers put on them, kept across calls
        # _precision_pending: the first training call checks its autocast against the plan
        self.__dict__.update(_warned=False, _precision_pending=True)
        if recompile.family.root is None:  # compile()'s own module: its variants' first
            recompile.family.root = self
        self._face_state_dict()  # state_dict() keys are the model's own
        self._keep(lowered)

    @property
    def selection(self) -> Selection:
        """The plan, its estimate and what chose it, for the last call's shape (the sequence
        length chooses the split: ``length_plans.py``); compile()'s before any call."""
        ran = self._ran
        if ran is None:
            return self._selection
        return ran[1] if ran[1] is not None else ran[0].selection

    @property
    def plan(self) -> MicrobatchPlan:
        """The ``MicrobatchPlan`` (of the last call's shape where the split follows it)."""
        return self.selection.plan

    # -------------------------------------------------------------- compiling
    def _mode_key(self) -> tuple[Any, ...]:
        """``mode_key.key_of``: the graphs hold the model's Parameter and buffer objects
        (get_attr copies the reference), so replacing one (``load_state_dict(assign=True)``,
        a new head) recompiles, as does a change of train/eval mode, of the hooks the graphs
        were traced through or of a dtype (``model.half()``). ``requires_grad`` is read live.
        Read on every call, it walks the module list of the last call (a walk costs more
        than the call's other checks); a replaced submodule shows in its parent's slots."""
        modules = self._modules_seen
        filled = slots(modules)
        if filled != self._slots_seen:
            modules = tuple(self.module.modules())
            filled = slots(modules)
            object.__setattr__(self, "_modules_seen", modules)
            object.__setattr__(self, "_slots_seen", filled)
        return key_of(modules, filled, self._live_hooks)

    def _compiled(self) -> Lowered:
        key = self._mode_key()
        compiled, failed = self._cache.find(key)  # several guarded states (guard_cache.py)
        if compiled is not None:
            return compiled
        if failed is not None:
            self._recompiling(f"{failed.describe(self._names())}, which forward reads")
        elif self._cache:
            changed = changed_since(self.module, self._hooks_seen, self._live_hooks,
                                    self._cache.last, key)
            if changed:
                self._recompiling(changed)
        for stale in [k for k in self._cache if k[1] != key[1]]:
            del self._cache[stale]  # they keep replaced parameters alive
        with numbers_as_inputs(self._cache.changing()):  # numbers that change every call
            return self._keep(self._recompile.relower())

    def _keep(self, compiled: Lowered) -> Lowered:
        """Cache ``compiled`` under the key the next call computes: without the forward
        hooks of the layers it calls live; those present now were checked
        (``check_layer_hooks``), later ones are watched."""
        live = self._layers_called_live(compiled)
        object.__setattr__(self, "_live_layers", live)
        # under torch_compile dynamo traces the layers' calls: a hook added recompiles
        object.__setattr__(self, "_live_hooks", frozenset(
            id(m) for _, m in live) if self._request.torch_compile is None else frozenset())
        object.__setattr__(self, "_hooks_known", self._hooks_known | hook_keys(live))
        object.__setattr__(self, "_hooks_seen", hooks_by_module(self.module, self._live_hooks))
        self._cache.put(self._mode_key(), compiled)
        return compiled

    def _layers_called_live(self, compiled: Lowered) -> tuple[tuple[str, nn.Module], ...]:
        """The layers an fx graph calls as single nodes (``nn.Linear``, ...), by name: they
        run their own forward hooks at each call, which ``live_hooks`` watches, so adding
        or removing one needs no recompile. (A body compiled with ``torch_compile`` has
        dynamo trace the calls in: there a hook added or removed compiles again.)"""
        names = dict.fromkeys(str(n.target) for n in compiled.original_graph_module.graph.nodes
                              if n.op == "call_module" and is_submodule(self._inner,
                                                                         str(n.target)))
        return tuple((name, self._inner.get_submodule(name)) for name in names)

    def _names(self) -> dict[int, str]:
        return {id(m): name for name, m in self.module.named_modules()}

    def _recompiling(self, what: str) -> None:
        warnings.warn(f"{what}: compiling {type(self.module).__name__} again for the new "
                      "state (once per state; values that change every step are better kept "
                      "in a buffer or passed as an argument)", RecompileWarning,
                      stacklevel=user_stacklevel())

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph for the module's current train/eval mode."""
        return self._compiled().graph_module

    @property
    def original_graph_module(self) -> fx.GraphModule:
        """The captured graph, with ``node.meta['mbcompile.fact']`` on every node."""
        return self._compiled().original_graph_module

    @property
    def analysis(self) -> BatchAnalysis:
        """The batch analysis of the captured graph: facts, trained loss, rejection."""
        return self._compiled().analysis

    @property
    def system(self) -> Any:
        """The ``SystemSpec`` the plan was made for."""
        return self.selection.system

    @property
    def estimate(self) -> Any:
        """Modelled memory and step time of the plan (``mbcompile.planning.cost.Estimate``)."""
        return self.selection.estimate

    @property
    def exploration(self) -> Any:
        """The MBS values evaluated and the answer (``planning.exploration.Exploration``)."""
        return self.selection.exploration

    def report(self, fmt: str = "text") -> str:
        """Plan, why, modelled memory and time, candidates: text, or ``fmt="json"``.

        The text is a ``mbcompile.reports.report.Report`` (a ``str``); ``to_dict()`` is the data.
        Of the last call's shape, with how the split follows the length where it does.
        """
        return render(*last_run(self), fmt=fmt)

    # ---------------------------------------------------------------- calling
    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """torch's call, where a global hook sees the model (``called_as``); out of dynamo's
        graph under ``torch.compile(cm)`` (``Trainer(torch_compile=True)``)."""
        if torch.compiler.is_compiling():
            return outside_dynamo(self, super()._call_impl, args, kwargs)
        return called_as(self, self.module, super()._call_impl, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compile_only:
            raise CompileOnlyError.of(self.plan.mbs, self.exploration, shapes_only=any(
                map(holds_no_data, self._inner.parameters())))
        if self.rank is not None:  # on ranks: never inside DDP, which would reduce again
            check_not_in_ddp()
        if self._precision_pending and torch.is_grad_enabled():
            self._plan_for_ambient_precision()
        # a call another variant runs (other keywords through **kwargs, another batch size)
        # goes there before this module compiles anything for the current mode
        if self._named is not None:  # forward takes **kwargs: which keywords reach them
            through = frozenset(k for k in kwargs if k not in self._named)
            if through != self._keywords:
                return self._runs(for_keywords(self, through, args, kwargs))(*args, **kwargs)
        try:
            arguments, values, batch, varying, refused = self._checked(args, kwargs)
        except InputPresenceError as error:  # an input left out or given, or another dtype
            if (variant := for_changed(self, args, kwargs, error)) is None:
                raise  # on ranks, or an input forward has no default for
            return self._runs(variant)(*args, **kwargs)
        if varying:  # dynamic="auto": a length changed, so compile once with it symbolic
            return self._runs(for_shapes(self, varying))(*args, **kwargs)
        if self._inputs.symbolic and (one := for_size_one(self, values)) is not None:
            return self._runs(one)(*args, **kwargs)  # a size of 1 where the step has a symbol
        gbs = self._selection.plan.gbs
        object.__setattr__(self, "_ran", None)
        if self.rank is None and batch is not None and batch != gbs:
            return self._runs(for_batch(self, batch, arguments))(*args, **kwargs)
        # the call's length chooses its split (on ranks: the rank's share, checked above)
        if self._split is not None and batch is not None and (
                batch == gbs or self.rank is not None):
            other = for_length(self, values)
            if other is not self:
                return other(*args, **kwargs)
        compiled = self._compiled()
        refuse_outer_autocast(type(self._inner).__name__, compiled.autocast_regions)
        if refused is not None:  # raised in the step: StepChannels.refused
            compiled.channels.refused = refused
        watched = watch_hooks(self._live_layers, self._hooks_known, self._watchers,
                              opaque=self._request.torch_compile is not None)  # global too
        try:  # a first float16 step reads the call's hooks (``live_hooks.CallHooks``)
            return self._call(compiled, values, arguments)
        finally:
            unwatch(watched)

    def _runs(self, module: CompiledModule) -> CompiledModule:
        """``module`` (a variant of the same batch size) runs this call: ``plan`` shows its."""
        object.__setattr__(self, "_ran", (module, None))
        return module

    def _checked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The call bound to the signature (by name, defaults applied), its inputs in
        placeholder order, batch size, dims that changed size (``check_layout``) and on
        ranks the error of a call not the rank's share (then the example's inputs:
        ``share_refused``); ``InputError`` for a call the graphs cannot run."""
        arguments = self._binder.bind(args, kwargs)
        values = [arguments[n] for n in self._inputs.names]
        check_unchanged(self._inputs, arguments)  # its non-tensor arguments
        batch = batch_size(self._inputs, values, empty=self.rank is not None)
        refused = None if self.rank is None else share_refused(self._selection.plan, self.rank,
                                                               batch)
        if refused is not None:  # run on the example, to raise in the step on every rank
            values = [self._request.example[n] for n in self._inputs.names]
            batch = batch_size(self._inputs, values)
        varying = check_layout(self._inputs, values, self._layout, self._request.options.dynamic)
        if (self.rank is None and batch is not None and batch != self._selection.plan.gbs
                and self._request.options.batch_sizes == "fixed"):
            raise InputError(
                f"the batch has {batch} samples but the module was compiled for "
                f"gbs={self.plan.gbs} with batch_sizes='fixed'; pass batches of "
                f"{self.plan.gbs} samples, or compile with batch_sizes='any'")
        return arguments, values, batch, varying, refused

    def _call(self, compiled: Lowered, values: list[Any], arguments: dict[str, Any]) -> Any:
        check_held(self._inputs, values, self._layout, compiled.values_fixed,
                   compiled.state.written_inputs)  # what this graph assumes of the call
        if (compiled.retains_activations and torch.is_grad_enabled() and not self._warned
                and any(p.requires_grad for p in self.module.parameters())):
            object.__setattr__(self, "_warned", True)
            warnings.warn(
                "training without a single scalar loss inside the model: the loop keeps every "
                "microbatch's activations alive until backward (same numbers, more memory). "
                "Return the loss from forward to get one microbatch's memory.",
                RetainedActivationsWarning, stacklevel=user_stacklevel())
        if (seed := compiled.channels.config.seed) is not None:  # guesses from any graph's
            seed.shared = self._recompile.family.guesses  # at its first step: another's
        flat = compiled.graph_module(*values)
        if seed is not None:  # the gradient the loss gets: next guess
            seed.watch(flat)
        if compiled.graph_module is not compiled.original_graph_module:  # split: backward ran
            output_grads_refused(flat, *compiled.analysis.loss_outputs[:1])  # in the call
        state = compiled.state
        if state.targets:  # the step succeeded: write the state back once, as eager does
            state.write_back(self._inner, flat[state.n_outputs:], arguments)
            flat = flat[:state.n_outputs]
        replay(compiled.effects, flat)  # forward's side effects, once per step
        return compiled.output_spec.rebuild(flat)

    def _plan_for_ambient_precision(self) -> None:
        """The first training call: when it runs under an autocast the plan did not assume
        (compiled outside the region it trains in), plan and compile again, once, for that
        precision (``Request.for_precision``), and become that module, with a warning."""
        object.__setattr__(self, "_precision_pending", False)
        assumed = self._request.precision
        ambient = ambient_precision(device_type(self._inner))
        if ambient == assumed:
            return
        start, before = time.perf_counter(), self.plan
        fresh = self._recompile.variant(self._request.for_precision(ambient))
        internals = set(vars(nn.Module()))  # the module's own slots and hooks stay
        for key, value in vars(fresh).items():
            if key not in internals:
                object.__setattr__(self, key, value)
        object.__setattr__(self, "_precision_pending", False)
        warnings.warn(
            f"the first training call of {type(self._inner).__name__} runs under "
            f"{ambient.describe()}, where it was planned for {assumed.describe()}: planned and "
            f"compiled again once for it in {time.perf_counter() - start:.1f} s (mbs "
            f"{before.mbs} -> {self.plan.mbs}); compile(..., precision={ambient.name!r}) plans "
            "for it from the start", RecompileWarning, stacklevel=user_stacklevel())

    def loss_of(self, output: Any) -> torch.Tensor:
        """The trained loss in ``output`` (what this module returned), as the batch analysis,
        cost model and rewrite find it; ``InputError`` when the model computes none."""
        compiled = self._compiled()
        for index in compiled.analysis.loss_outputs:
            found = compiled.output_spec.leaf_of(output, index)
            if isinstance(found, torch.Tensor):
                return found
        raise InputError(
            f"{type(self.module).__name__} returns no trained loss (a scalar computed inside "
            "forward that depends on the parameters); compute the loss inside forward, so "
            "backward can run per microbatch, and return it")

    def token_counts(self) -> dict[str, Any] | None:
        """What the loss's mean counted in the last call (non-padding tokens, an MSE's
        elements): ``{"global": n, "per_system": [...], "per_microbatch": [[...], ...]}``;
        None before the first call or when the loss is not a mean."""
        if self._ran is not None and self._ran[0] is not self:  # the last call ran there
            return self._ran[0].token_counts()
        counts = self._compiled().channels.last_counts
        if counts is None:
            return None
        values = iter([float(c) for c in counts])
        per_mb = [[next(values) if n else 0.0 for n in sizes]
                  for sizes in (self.plan.microbatch_sizes if self.rank is None
                                else self.plan.microbatch_sizes[self.rank:self.rank + 1])]
        return {"global": sum(map(sum, per_mb)), "per_system": [sum(m) for m in per_mb],
                "per_microbatch": per_mb}

    # --------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        # fx pickles a GraphModule by re-tracing its code, which would trace into the
        # runtime's loop; drop the graphs and recompile from the model on first use.
        state = self.__dict__.copy()
        state["_cache"] = GuardCache()
        state["_modules_seen"], state["_slots_seen"] = (), None  # ids mean nothing after a copy
        return state

    def extra_repr(self) -> str:
        p = self.plan
        return (f"gbs={p.gbs}, num_csx={p.num_csx}, mbs={p.mbs}, "
                f"num_microbatches={p.num_microbatches}"
                + (", compile_only=True" if self.compile_only else ""))

