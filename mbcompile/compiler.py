"""``mbcompile.compile``: capture -> shapes -> batch analysis -> plan -> rewrite.

>>> cm = mbcompile.compile(model, gbs=10, num_csx=3, mbs=2, example_inputs=(ids, labels))
>>> print(cm.plan)                  # systems get 4, 3, 3 samples; 2 microbatches each
>>> loss = cm(ids, labels)          # same call and output structure as model(ids, labels)
>>> loss.backward()                 # param.grad == the full-batch gradient, to rounding

The module compiles once per combination of its submodules' ``training`` flags
(``cm.train()`` and ``cm.eval()`` can change what is safe: BatchNorm mixes
samples only in training), and reuses the result on every call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.errors import (
    ArgumentTypeError,
    CaptureError,
    InputError,
    MbcompileError,
    MixingError,
    PerMicrobatchStatisticsWarning,
    RecompileWarning,
    RetainedActivationsWarning,
    UnsupportedOpError,
)
from mbcompile.execution import BACKENDS, StepChannels, bindings
from mbcompile.execution.joint import JOINT, joint_step
from mbcompile.execution.live_hooks import unwatch, watch_new_hooks
from mbcompile.execution.noise import NoiseScale
from mbcompile.passes import batch_rules, ops
from mbcompile.passes.batch_analysis import BatchAnalysis, analyse_batch, mixing_error
from mbcompile.passes.capture import CaptureResult, OutputSpec, capture, fsdp_modules
from mbcompile.passes.export_capture import export_capture
from mbcompile.passes.facts import SHAPES, input_fact
from mbcompile.passes.forward_modes import (
    check_layer_hooks,
    check_tensor_hooks,
    detach_grad_free_inputs,
)
from mbcompile.passes.guards import Guard, failed_guard
from mbcompile.passes.microbatch_rewrite import microbatch_rewrite
from mbcompile.passes.shape_prop import ShapePropagationError, propagate_shapes
from mbcompile.passes.sources import user_stacklevel
from mbcompile.passes.state_updates import (
    StateUpdates,
    has_mutations,
    lift_state_updates,
    mutates,
)
from mbcompile.passes.unwrap import unwrap
from mbcompile.planning.cost import ShardSpec
from mbcompile.planning.explore import (
    Selection,
    check_request,
    compile_only_error,
    plan_for,
    single_microbatch_request,
)
from mbcompile.planning.plan import MicrobatchPlan, parse_mbs
from mbcompile.planning.systems import get_system
from mbcompile.reports.report import Validation, render, validation_of

__all__ = ["CompiledModule", "compile"]


@dataclass(frozen=True)
class _Inputs:
    """How a call's arguments map onto the graph's placeholders."""

    names: tuple[str, ...]  # forward's parameters, in order
    in_dims: tuple[int | None, ...]  # batch dim per parameter (None: unbatched)
    concrete: Mapping[str, Any]  # non-tensor arguments fixed at compile time
    capture: str = "auto"  # "auto" (fx, then torch.export if fx fails), "fx" or "export"
    batch_norm: str = "full_batch"  # or "per_microbatch": BatchNorm statistics per microbatch
    coupling: str = "two_phase"  # or "reject": ops that mix samples raise MixingError
    outputs: Any = "all"  # "all", "loss", or output names: what a training step returns
    torch_compile: Any = None  # torch.compile kwargs for the body and coupled part (None: off)
    recompute: Any = "auto"  # activation checkpointing per block: "auto", True or False


@dataclass(frozen=True)
class _Analysed:
    """Capture, shapes and batch analysis: the graph with a batch fact on every node."""

    captured: CaptureResult
    analysis: BatchAnalysis  # the facts, the trained loss, the rejection (one run still works)
    state: StateUpdates  # buffers and inputs the call writes: extra outputs, written back

    @property
    def rejected(self) -> MixingError | None:
        return self.analysis.rejected

    def refused(self, coupling: str) -> MixingError | None:
        """The error that stops a split: the rejection, unless a two-phase step runs it."""
        if self.analysis.two_phase and coupling == "two_phase":
            return None
        return self.analysis.rejected


@dataclass(frozen=True)
class _Compiled:
    graph_module: fx.GraphModule  # rewritten, its loop ops bound to the backend
    original_graph_module: fx.GraphModule
    output_spec: OutputSpec
    retains_activations: bool  # training keeps several microbatches' activations alive
    channels: StepChannels  # what its loop reports: noise scale, last counts
    analysis: BatchAnalysis  # what the batch analysis decided for this graph
    state: StateUpdates  # which graph outputs are state to write back, and where
    guards: tuple[Guard, ...] = ()  # the plain attributes its capture read, and their values


def _check_module(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap functions in a "
            "Module whose forward calls them")
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta:
        raise InputError(
            f"model has parameters or buffers on the meta device ({meta[0]!r}, ...), which hold "
            "no values; materialise them first (model.to_empty(device='cpu') and load weights)")
    return model


def _bind(model: nn.Module, example_inputs: Any, example_kwargs: Any, in_dims: Any
          ) -> tuple[inspect.Signature, dict[str, Any], _Inputs]:
    """Bind the example call to forward's signature and resolve ``in_dims`` per parameter."""
    if example_inputs is None and example_kwargs is None:
        raise InputError(
            "example_inputs (or example_kwargs) are required: mbcompile traces shapes from one "
            "example call, e.g. compile(model, gbs, num_csx, example_inputs=(x, y))")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    args = tuple(example_inputs or ())
    kwargs = dict(example_kwargs or {})
    sig = inspect.signature(model.forward)
    if any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values()):
        raise CaptureError(
            f"{type(model).__name__}.forward takes *args; mbcompile needs named "
            "parameters to map inputs to the graph. Wrap the model in a Module whose forward "
            "names its inputs.")
    variadic = [p for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD]
    if variadic:  # forward(..., **kwargs), as in HuggingFace models: map the named ones only
        sig = sig.replace(parameters=[p for p in sig.parameters.values() if p not in variadic])
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        extra = (f"; mbcompile maps inputs to forward's named parameters only, not to "
                 f"**{variadic[0].name}") if variadic else ""
        raise InputError(f"example inputs do not match {type(model).__name__}.forward{sig}: "
                         f"{exc}{extra}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    names = tuple(values)
    positional = list(sig.parameters)[:len(args)]
    meta = [n for n in names if any(isinstance(t, torch.Tensor) and t.is_meta
                                    for t in pytree.tree_leaves(values[n]))]
    if meta:
        raise InputError(
            f"example_inputs hold tensors on the meta device (input {meta[0]!r}), which have no "
            "values to run the model on; pass real tensors (any batch size) on the model's "
            "device")
    if isinstance(in_dims, dict) and set(in_dims) - set(names):
        unknown = sorted(set(in_dims) - set(names))
        raise InputError(
            f"in_dims names {', '.join(map(repr, unknown))}, which "
            f"{'is' if len(unknown) == 1 else 'are'} not a parameter of "
            f"{type(model).__name__}.forward{sig}; use the forward's parameter names as keys")
    if isinstance(in_dims, bool) or not isinstance(in_dims, (int, tuple, list, dict, type(None))):
        raise ArgumentTypeError(
            f"in_dims must be an int, a tuple per positional input, or a dict per keyword, "
            f"got {in_dims!r}")
    if isinstance(in_dims, (tuple, list)) and len(in_dims) != len(args):
        raise InputError(
            f"in_dims has {len(in_dims)} entries but there are {len(args)} positional example "
            f"inputs; give one entry per positional input (None for unbatched ones)")
    dims: list[int | None] = []
    for name in names:
        value = values[name]
        if isinstance(in_dims, (tuple, list)) and name in positional:
            d = in_dims[positional.index(name)]
        elif isinstance(in_dims, dict):
            d = in_dims.get(name, 0)
        elif isinstance(in_dims, (tuple, list)):
            d = 0
        else:
            d = in_dims
        has_tensor = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise ArgumentTypeError(f"in_dims for input {name!r} must be an int or None, "
                                    f"got {d!r}")
        dims.append(d if has_tensor else None)
    concrete = {n: values[n] for n, d in zip(names, dims)
                if d is None and not any(isinstance(t, torch.Tensor)
                                         for t in pytree.tree_leaves(values[n]))}
    inputs = _Inputs(names, tuple(dims), concrete)
    _batch_size(inputs, [values[n] for n in names], check_ndim=True)
    return sig, values, inputs


def _batch_size(inputs: _Inputs, values: Sequence[Any], check_ndim: bool = False) -> int | None:
    """The common batch size of the batched inputs; raises if they disagree."""
    seen: dict[int, tuple[str, Any]] = {}
    for name, value, d in zip(inputs.names, values, inputs.in_dims):
        if d is None:
            continue
        for path, t in _leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            if d < 0:
                raise InputError(
                    f"in_dims gives input {_leaf_name(name, path)} batch dim {d}: negative "
                    f"dims are not supported; count from the front (in_dims={t.dim() + d} here)")
            if t.dim() <= d:
                raise InputError(
                    f"in_dims gives input {_leaf_name(name, path)} batch dim {d}, but it has "
                    f"{t.dim()} dims; pass in_dims=None for unbatched inputs or the right dim")
            seen.setdefault(t.shape[d], (name, path))
    if len(seen) > 1:
        detail = ", ".join(f"{_leaf_name(*n)} has {b}" for b, n in seen.items())
        raise InputError(f"batched inputs disagree on the batch size ({detail}); every batched "
                         "input must have the same number of samples along its in_dims dim")
    return next(iter(seen), None)


def _leaves(value: Any) -> list[tuple[Any, Any]]:
    """``(path, leaf)`` of every leaf of an input; a bare tensor (the usual input, checked on
    every call) without a pytree walk."""
    if isinstance(value, torch.Tensor):
        return [((), value)]
    return pytree.tree_flatten_with_path(value)[0]


def _leaf_name(name: str, path: Any) -> str:
    """How an error names one leaf of an input: ``'x'``, or ``batch['y']``."""
    return repr(name) if not path else f"{name}{pytree.keystr(path)}"


def _tokens_per_sample(inputs: _Inputs, values: Mapping[str, Any]) -> int | None:
    """The sequence length of token-id inputs ((B, T) integer tensors), if there are any."""
    for name, d in zip(inputs.names, inputs.in_dims):
        value = values[name]
        if (d is not None and isinstance(value, torch.Tensor) and not value.is_floating_point()
                and value.dim() == 2):
            return int(value.shape[1 - d])
    return None


class CompiledModule(nn.Module):
    """A model compiled for microbatching: call it like the model.

    Attributes: ``plan`` (a ``MicrobatchPlan``), ``graph_module`` (the rewritten
    ``fx.GraphModule``: split -> loop over ``graph_module.body`` -> accumulate),
    ``original_graph_module`` (the captured graph, annotated with batch facts),
    ``estimate`` (modelled memory and step time of the plan on ``system``) and
    ``exploration`` (the MBS values the choice evaluated); ``report()`` says it all.
    Parameters are the model's own (shared, not copied); ``state_dict()`` is the
    model's, so it loads into the original and back.
    """

    def __init__(self, model: nn.Module, plan: MicrobatchPlan, signature: inspect.Signature,
                 inputs: _Inputs, example: Mapping[str, Any], rank: int | None = None,
                 noise_scale: NoiseScale | None = None, selection: Selection | None = None,
                 compile_only: bool = False, analysed: _Analysed | None = None,
                 backend: str = "simulated", inner: nn.Module | None = None) -> None:
        super().__init__()
        self.module = model  # the user's model, wrapper and all: its state_dict() keys
        # what the graphs were captured from (model, or the module a wrapper forwards to);
        # not a registered submodule, so nothing is listed twice
        object.__setattr__(self, "_inner", model if inner is None else inner)
        object.__setattr__(self, "plan", plan)
        object.__setattr__(self, "selection", selection)
        object.__setattr__(self, "compile_only", compile_only)
        object.__setattr__(self, "_analysed", analysed)  # compile()'s analysis, used once
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "noise_scale", noise_scale)
        object.__setattr__(self, "_signature", signature)
        object.__setattr__(self, "_inputs", inputs)
        object.__setattr__(self, "_example", dict(example))
        object.__setattr__(self, "_layout", _layout(inputs, [example[n] for n in inputs.names]))
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "_modules_seen", ())  # _mode_key's module list and slots
        object.__setattr__(self, "_slots_seen", None)
        object.__setattr__(self, "_hooks_seen", None)  # _hooks_by_module at the last compile
        object.__setattr__(self, "_live_hooks", frozenset())  # layers whose hooks run live
        object.__setattr__(self, "_live_layers", ())  # (name, layer) of those layers
        object.__setattr__(self, "_hooks_known", frozenset())  # their hooks checked at compile
        object.__setattr__(self, "_warned", False)
        # state_dict() keys are the model's own ("net.0.weight", not "module.net.0.weight"),
        # also when this module sits inside a parent: hooks, not overrides, so nesting works
        self.register_state_dict_post_hook(_strip_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        self._compiled()  # compile now: errors belong to compile(), not the first call

    # -------------------------------------------------------------- compiling
    def _mode_key(self) -> tuple[Any, ...]:
        """(every module's training flag, the identity of every parameter, buffer and
        submodule slot, the keys of every hook): the graphs hold the model's Parameter and
        buffer objects (get_attr copies the reference), so replacing one
        (``load_state_dict(assign=True)``, a new head) recompiles, and so does a change of
        train/eval mode or of the hooks the graphs were traced through. A parameter's
        ``requires_grad`` is read live on every call: nothing compiled depends on it.

        Read on every call, so it walks a module list kept from the last call (a module
        walk costs more than the rest of the call's checks together); a replaced submodule
        shows in its parent's slots, and then the list is walked afresh.
        """
        modules = self._modules_seen
        slots = _slots(modules)
        if slots != self._slots_seen:
            modules = tuple(self.module.modules())
            slots = _slots(modules)
            object.__setattr__(self, "_modules_seen", modules)
            object.__setattr__(self, "_slots_seen", slots)
        return tuple(m.training for m in modules), slots, _hooks(modules, self._live_hooks)

    def _compiled(self) -> _Compiled:
        key = self._mode_key()
        compiled = self._cache.get(key)
        if compiled is not None:
            failed = failed_guard(compiled.guards)
            if failed is None:
                return compiled
            self._recompiling(f"{failed.describe(self._names())}, which forward reads")
            del self._cache[key]
        elif self._cache:
            changed = _hooks_changed(self.module, self._hooks_seen, self._live_hooks)
            if changed:
                self._recompiling(changed)
        for stale in [k for k in self._cache if k[1] != key[1]]:
            del self._cache[stale]  # they keep replaced parameters alive
        analysed, self._analysed = self._analysed, None
        compiled = _compile_graph(self._inner, self.plan, self._inputs, self._example,
                                  self.rank, analysed, self.backend,
                                  StepChannels(noise=self.noise_scale))
        # the key as the next call computes it: without the forward hooks of the layers it
        # calls live; those present now were checked (check_layer_hooks), later ones watched
        live = self._layers_called_live(compiled)
        object.__setattr__(self, "_live_layers", live)
        object.__setattr__(self, "_live_hooks", frozenset(id(m) for _, m in live))
        object.__setattr__(self, "_hooks_known", self._hooks_known | {
            k for _, m in live for hooks in (m._forward_pre_hooks, m._forward_hooks)
            for k in hooks})
        object.__setattr__(self, "_hooks_seen", _hooks_by_module(self.module, self._live_hooks))
        self._cache[self._mode_key()] = compiled
        return compiled

    def _layers_called_live(self, compiled: _Compiled) -> tuple[tuple[str, nn.Module], ...]:
        """The layers an fx graph calls as single nodes (``nn.Linear``, ...), by name: they
        run their own forward hooks at each call, so adding or removing one needs no
        recompile (``live_hooks`` watches the added ones). A body compiled with
        ``torch_compile`` has dynamo trace them in: every hook counts."""
        if self._inputs.torch_compile is not None:
            return ()
        names = dict.fromkeys(str(n.target) for n in compiled.original_graph_module.graph.nodes
                              if n.op == "call_module" and _is_submodule(self._inner,
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
        return self.selection.system if self.selection is not None else None

    @property
    def estimate(self) -> Any:
        """Modelled memory and step time of the plan (``mbcompile.planning.cost.Estimate``)."""
        return self.selection.estimate if self.selection is not None else None

    @property
    def exploration(self) -> Any:
        """The MBS values evaluated and the answer (``mbcompile.planning.explore.Exploration``)."""
        return self.selection.exploration if self.selection is not None else None

    def report(self, fmt: str = "text") -> str:
        """Plan, why, modelled memory and time, candidates: text, or ``fmt="json"``.

        The text is a ``mbcompile.reports.report.Report`` (a ``str``); ``to_dict()`` is the data.
        """
        return render(self, fmt)

    # ---------------------------------------------------------------- calling
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compile_only:
            raise compile_only_error(self.plan, self.exploration)
        compiled = self._compiled()
        watched = watch_new_hooks(self._live_layers, self._hooks_known)
        if not watched:
            return self._call(compiled, args, kwargs)
        try:
            return self._call(compiled, args, kwargs)
        finally:
            unwatch(watched)

    def _call(self, compiled: _Compiled, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputError(f"call does not match forward{self._signature}: {exc}") from None
        bound.apply_defaults()
        values = [bound.arguments[n] for n in self._inputs.names]
        for name, expected in self._inputs.concrete.items():
            got = bound.arguments[name]
            if got is not expected and not _same(got, expected):
                raise InputError(
                    f"argument {name!r} was {expected!r} at compile time and is {got!r} now; "
                    "non-tensor arguments are fixed when compiling: compile again with the "
                    "new value")
        batch = _batch_size(self._inputs, values)
        _check_layout(self._inputs, values, self._layout)
        if self.rank is not None:
            local = self.plan.per_system_batch_sizes[self.rank]
            if batch is not None and batch != local:
                raise InputError(
                    f"rank {self.rank} was called with {batch} samples but its share of "
                    f"gbs={self.plan.gbs} is {local} (plan.per_system_batch_sizes[{self.rank}]); "
                    "cut the global batch with mbcompile.distributed.shard(batch, cm.plan, rank)")
        elif batch is not None and batch != self.plan.gbs:
            raise InputError(
                f"the batch has {batch} samples but the module was compiled for "
                f"gbs={self.plan.gbs}; pass batches of {self.plan.gbs} samples, or compile "
                f"again with gbs={batch}")
        if (compiled.retains_activations and torch.is_grad_enabled() and not self._warned
                and any(p.requires_grad for p in self.module.parameters())):
            object.__setattr__(self, "_warned", True)
            warnings.warn(
                "training without a single scalar loss inside the model: the loop keeps every "
                "microbatch's activations alive until backward (same numbers, more memory). "
                "Return the loss from forward to get one microbatch's memory.",
                RetainedActivationsWarning, stacklevel=user_stacklevel())
        flat = compiled.graph_module(*values)
        state = compiled.state
        if state.targets:  # the step succeeded: write the state back once, as eager does
            self._write_state(state, flat[state.n_outputs:], bound.arguments)
            flat = flat[:state.n_outputs]
        return compiled.output_spec.rebuild(flat)

    def _write_state(self, state: StateUpdates, new: Sequence[Any],
                     arguments: Mapping[str, Any]) -> None:
        with torch.no_grad():
            for target, value in zip(state.targets, new):
                if target.kind == "buffer":
                    self._inner.get_buffer(target.name).copy_(value)
                elif target.kind == "parameter":  # under no_grad: it stays a leaf
                    self._inner.get_parameter(target.name).copy_(value)
                else:
                    arguments[target.name].copy_(value)

    def token_counts(self) -> dict[str, Any] | None:
        """What the loss's mean counted in the last call: non-padding tokens for a token
        loss (targets not equal to ``ignore_index``), elements for an MSE, ...

        ``{"global": n, "per_system": [...], "per_microbatch": [[...], ...]}``; None
        before the first call or when the loss is not a mean.
        """
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
        state["_cache"] = {}
        state["_modules_seen"], state["_slots_seen"] = (), None  # ids mean nothing after a copy
        return state

    def extra_repr(self) -> str:
        p = self.plan
        return (f"gbs={p.gbs}, num_csx={p.num_csx}, mbs={p.mbs}, "
                f"num_microbatches={p.num_microbatches}"
                + (", compile_only=True" if self.compile_only else ""))


def _slots(modules: Sequence[nn.Module]) -> tuple[int, ...]:
    """The identity of what fills each module's parameter, buffer and submodule slots."""
    return tuple(id(v) for m in modules
                 for slots in (m._parameters, m._buffers, m._modules) for v in slots.values())


def _hooks(modules: Sequence[nn.Module], live: frozenset[int]) -> tuple[Any, ...]:
    """The keys of the hooks the graphs were traced through: every module's but those of
    the ``live`` layers (their hooks run at their call), and the global module hooks. Read
    on every call (hooks are rare: a module without any costs four truth tests)."""
    out: list[Any] = [tuple(tuple(h) for h in _GLOBAL_HOOKS) if any(_GLOBAL_HOOKS) else ()]
    for i, m in enumerate(modules):
        if m._backward_pre_hooks or m._backward_hooks or (
                (m._forward_pre_hooks or m._forward_hooks) and id(m) not in live):
            out.append((i, tuple(tuple(h) for h in _hook_dicts(m, id(m) in live))))
    return tuple(out)


def _is_submodule(model: nn.Module, target: str) -> bool:
    try:
        model.get_submodule(target)
    except AttributeError:
        return False
    return True


def _hook_dicts(m: nn.Module, live: bool = False) -> tuple[dict[int, Any], ...]:
    """The hook dictionaries the graphs depend on: a live layer's forward hooks run at its
    call, but its backward hooks are checked at compile (``check_layer_hooks``)."""
    backward = (m._backward_pre_hooks, m._backward_hooks)
    return backward if live else (m._forward_pre_hooks, m._forward_hooks, *backward)


_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, f"_global_{kind}_hooks") for kind in (
    "forward_pre", "forward", "backward_pre", "backward"))


def _hooks_by_module(model: nn.Module, live: frozenset[int]) -> dict[str, Any]:
    """Per module name: the keys of the hooks ``_hooks`` watches (to name whose changed)."""
    state = {name or "<model>": tuple(tuple(h) for h in _hook_dicts(m, id(m) in live))
             for name, m in model.named_modules()}
    state["<global module hooks>"] = tuple(tuple(h) for h in _GLOBAL_HOOKS)
    return state


def _hooks_changed(model: nn.Module, before: Mapping[str, Any] | None,
                   live: frozenset[int]) -> str | None:
    """Which module's hooks changed since ``before`` (None: none did)."""
    if before is None:
        return None
    for name, hooks in _hooks_by_module(model, live).items():
        if name in before and hooks != before[name]:  # a new module shows in its parent's slots
            return f"the hooks of {name!r} changed"
    return None


def _strip_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       *args: Any) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)


def _layout(inputs: _Inputs, values: Sequence[Any]) -> tuple[Any, ...]:
    """Per input: its pytree structure and its tensors' shapes, the batch dim left out."""
    out = []
    for value, d in zip(values, inputs.in_dims):
        leaves, spec = pytree.tree_flatten(value)
        out.append((spec, tuple(_shape(t, d) for t in leaves)))
    return tuple(out)


def _shape(t: Any, d: int | None) -> tuple[int | None, ...] | None:
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(None if i == d else s for i, s in enumerate(t.shape))


def _check_layout(inputs: _Inputs, values: Sequence[Any], layout: tuple[Any, ...]) -> None:
    """Raise ``InputError`` unless every input is nested and shaped like the example.

    Shapes other than the batch dim are fixed at compile time: the rewritten graph
    holds sizes computed from them (``x.size(0) * x.size(1)`` after the loop).
    """
    for name, value, d, (spec, shapes) in zip(inputs.names, values, inputs.in_dims, layout):
        if name in inputs.concrete:
            continue  # compared by value already
        if isinstance(value, torch.Tensor) and spec.is_leaf():  # the usual input: no walk
            leaves = _leaves(value)
        else:
            leaves, got = pytree.tree_flatten_with_path(value)
            if got != spec:
                raise InputError(
                    f"input {name!r} is nested differently from the example ({got} instead "
                    f"of {spec}); pass the same structure (keys, lengths) or compile again "
                    "with an example of this one")
        for (path, t), want in zip(leaves, shapes):
            if _shape(t, d) != want:
                shown = tuple("B" if s is None else s for s in want or ())
                raise InputError(
                    f"input {_leaf_name(name, path)} has shape "
                    f"{tuple(getattr(t, 'shape', ()))} but the example had {shown} (B: the "
                    "batch dim); shapes other than the batch dim are fixed at compile time: "
                    "compile again with an example of this shape")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a truthy == are compared by identity only
        return False


CAPTURES = ("auto", "fx", "export")


def _capture(model: nn.Module, inputs: _Inputs, example: Mapping[str, Any]) -> CaptureResult:
    """torch.fx symbolic tracing first (its graphs read best), torch.export when it fails.

    A forward that takes ``**kwargs`` (HuggingFace style) goes to torch.export directly:
    fx would turn ``**kwargs`` into one more graph input that no call argument maps to.
    """
    var_keyword = any(p.kind == p.VAR_KEYWORD
                      for p in inspect.signature(model.forward).parameters.values())
    if inputs.capture == "fx" and var_keyword and not isinstance(model, fx.GraphModule):
        raise CaptureError(
            f"{type(model).__name__}.forward takes **kwargs, which torch.fx turns into an "
            "extra graph input; compile with capture='auto' or capture='export' (torch.export "
            "maps the named parameters), or wrap the model in a Module whose forward names "
            "its inputs.")
    fx_error = None
    if inputs.capture == "fx" or (inputs.capture == "auto" and not var_keyword):
        try:
            return capture(model, inputs.concrete)
        except CaptureError as exc:
            if inputs.capture == "fx" or isinstance(model, fx.GraphModule):
                raise
            fx_error = exc
    return export_capture(model, {n: example[n] for n in inputs.names},
                          dict(zip(inputs.names, inputs.in_dims)), fx_error=fx_error)


BATCH_NORM_MODES = ("full_batch", "per_microbatch")
COUPLING_MODES = ("two_phase", "reject")

PER_MICROBATCH_NOTE = (
    "batch_norm='per_microbatch': BatchNorm in training normalises with each microbatch's "
    "statistics and updates its running statistics once per microbatch, as a hand-written "
    "loop does; this is not the full-batch result")


@contextlib.contextmanager
def _batch_norm_rules(mode: str) -> Iterator[None]:
    """With ``"per_microbatch"``, BatchNorm counts as per-sample for as long as the block runs:
    each microbatch is normalised by its own statistics (the user asked for exactly that)."""
    if mode != "per_microbatch":
        yield
        return
    with batch_rules.scoped():
        for op in batch_rules.BATCH_NORMS:
            if isinstance(op, type) or op is torch.ops.aten.batch_norm:  # single-output forms
                batch_rules.register_batch_rule(op, "per_sample")
        yield


def _analyse(model: nn.Module, gbs: int, inputs: _Inputs, example: Mapping[str, Any]
             ) -> _Analysed:
    with _batch_norm_rules(inputs.batch_norm):
        return _analyse_in_scope(model, gbs, inputs, example)


def _analyse_in_scope(model: nn.Module, gbs: int, inputs: _Inputs, example: Mapping[str, Any]
                      ) -> _Analysed:
    """Capture, state updates, shapes and batch analysis; a rejection is kept, not raised.

    With ``capture="auto"``, a torch.fx graph that writes in place, or that the analysis
    refuses for an op it has no rule for (an ``fx.wrap``-ped function, an opaque layer),
    is captured again with torch.export, which functionalizes in-place writes and looks
    inside such calls; the export graph is kept when the analysis accepts it.
    """
    captured = _capture(model, inputs, example)
    may_export = (inputs.capture == "auto" and captured.method != "export"
                  and not isinstance(model, fx.GraphModule))
    if may_export and has_mutations(captured.graph_module):
        exported = _export_instead(model, inputs, example)
        if isinstance(exported, CaptureResult):
            return _analyse_captured(exported, gbs, inputs, example)
        if _writes_state(captured.graph_module):
            # only export's functionalization turns a write into the model's state into a
            # value written back once; its error says why it could not capture the model
            raise exported
        may_export = False  # export cannot capture this model: do not try it twice
    analysed = _analyse_captured(captured, gbs, inputs, example)
    if may_export and isinstance(analysed.rejected, UnsupportedOpError):
        exported = _export_instead(model, inputs, example)
        if isinstance(exported, CaptureResult):
            second = _analyse_captured(exported, gbs, inputs, example)
            if second.refused(inputs.coupling) is None:
                return second
    return analysed


def _export_instead(model: nn.Module, inputs: _Inputs, example: Mapping[str, Any]
                    ) -> CaptureResult | CaptureError:
    """The torch.export capture, or the error that says why export cannot capture it."""
    try:
        return export_capture(model, {n: example[n] for n in inputs.names},
                              dict(zip(inputs.names, inputs.in_dims)))
    except CaptureError as exc:
        return exc


def _writes_state(gm: fx.GraphModule) -> bool:
    """Whether an fx graph writes in place into a parameter, a buffer or an input."""
    return any(mutates(n) and n.args and isinstance(n.args[0], fx.Node)
               and n.args[0].op in ("get_attr", "placeholder") for n in gm.graph.nodes)


def _analyse_captured(captured: CaptureResult, gbs: int, inputs: _Inputs,
                      example: Mapping[str, Any]) -> _Analysed:
    state = lift_state_updates(captured.graph_module)
    gm = state.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [example[n] for n in inputs.names]
    try:
        propagate_shapes(gm, values, inputs.in_dims, gbs)
    except ShapePropagationError as exc:  # a baked-in batch size or a data-dependent shape
        rejected = mixing_error(exc.node, gm, exc.reason, exc.fix)
        return _Analysed(captured, BatchAnalysis(gm, rejected=rejected), state)
    check_tensor_hooks(gm.graph, type(captured.graph_module).__name__)
    check_layer_hooks(gm, type(captured.graph_module).__name__)
    # no-grad regions of an fx trace, now that the shapes say which values are tensors
    if detach_grad_free_inputs(gm.graph, lambda n: getattr(n.meta.get(SHAPES), "is_tensor",
                                                           False)):
        gm.recompile()
    facts = {p.target: input_fact(v, d) for p, v, d in zip(placeholders, values, inputs.in_dims)}
    return _Analysed(captured, analyse_batch(gm, facts, gbs), state)


def _compile_graph(model: nn.Module, plan: MicrobatchPlan, inputs: _Inputs,
                   example: Mapping[str, Any], rank: int | None = None,
                   analysed: _Analysed | None = None, backend: str = "simulated",
                   channels: StepChannels | None = None) -> _Compiled:
    analysed = analysed or _analyse(model, plan.gbs, inputs, example)
    channels = channels or StepChannels()
    captured = analysed.captured
    gm = captured.graph_module
    if analysed.rejected is not None and (plan.num_nonempty_microbatches == 1
                                          or analysed.refused(inputs.coupling) is not None):
        if plan.num_nonempty_microbatches > 1:
            raise analysed.rejected
        # one system, one microbatch (mbs="none"): nothing is split, so nothing can mix;
        # the captured graph runs as it is
        return _Compiled(gm, gm, captured.output_spec, False, channels, analysed.analysis,
                         analysed.state, captured.guards)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    systems = plan.microbatch_slices if rank is None else plan.microbatch_slices[rank:rank + 1]
    offset = 0 if rank is None else sum(plan.per_system_batch_sizes[:rank])  # rank-local rows
    slices = [(a - offset, b - offset) for system in systems for a, b in system if b > a]
    keep = kept_outputs(inputs.outputs, captured.output_spec, analysed.analysis,
                        analysed.state) if model.training else None
    rewritten = microbatch_rewrite(
        analysed.analysis, slices=slices, systems=[sum(1 for a, b in s if b > a) for s in systems],
        in_dims={p.target: d for p, d in zip(placeholders, inputs.in_dims)}, keep=keep,
        recompute=plan.recompute and model.training)
    if plan.reshard_after_forward is not None:  # FSDP2 units: the plan's choice, at run time
        from mbcompile.execution.fsdp import RESHARD

        setattr(rewritten.body, RESHARD, plan.reshard_after_forward)
    if analysed.analysis.two_phase and backend == "torch.distributed":
        from mbcompile.execution.two_phase import TEMPLATE, frontier_template

        # a rank whose phase 1 fails still joins the frontier's gather, with zeros this shape
        setattr(rewritten.body, TEMPLATE, frontier_template(
            rewritten.body, [example[n] for n in inputs.names], inputs.in_dims,
            [b - a for a, b in slices]))
    bound = ops.bind(rewritten, bindings(backend, channels, plan.per_system_batch_sizes))
    if inputs.torch_compile is not None:
        _torch_compile_parts(bound, inputs.torch_compile)
    return _Compiled(bound, gm, captured.output_spec,
                     not analysed.analysis.fused and plan.num_nonempty_microbatches > 1, channels,
                     analysed.analysis, analysed.state, captured.guards)


OUTPUT_MODES = ("all", "loss")


def _shard_spec(units: Sequence[tuple[str, nn.Module]], world: int) -> ShardSpec | None:
    """A sharded model's FSDP2 ``units`` (``fsdp_modules``, the root first) by the full
    bytes of the parameters each owns."""
    if not units:
        return None
    owner: dict[int, int] = {}
    for i, (_, unit) in enumerate(units):  # the root first: deeper units claim theirs after
        for p in unit.parameters():
            owner[id(p)] = i
    sizes = [0.0] * len(units)
    seen: set[int] = set()
    for _, unit in units:
        for p in unit.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                sizes[owner[id(p)]] += p.numel() * p.element_size()  # DTensor: global numel
    return ShardSpec(world, tuple(sizes))


def _recompute(option: bool | str, analysed: _Analysed) -> bool | str:
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


def _check_recompute(option: Any) -> bool | str:
    if option == "auto" or isinstance(option, bool):
        return option
    raise InputError(f"recompute must be 'auto', True or False, got {option!r}")


def _check_reshard(option: Any, sharded: bool) -> bool | str:
    if option != "auto" and not isinstance(option, bool):
        raise InputError(f"reshard_after_forward must be 'auto', True or False, got {option!r}")
    if option != "auto" and not sharded:
        raise InputError("reshard_after_forward is FSDP2's setting for a model sharded with "
                         "fully_shard; this model is not sharded: leave it at 'auto'")
    return option


def _check_torch_compile(option: Any) -> dict[str, Any] | None:
    """``torch_compile=`` as torch.compile keyword arguments (None: off)."""
    if option is False or option is None:
        return None
    if option is True:
        return {}
    if isinstance(option, Mapping) and all(isinstance(k, str) for k in option):
        unknown = set(option) - set(inspect.signature(torch.compile).parameters)
        if unknown:
            raise InputError(f"torch_compile has {sorted(unknown)}, which torch.compile does "
                             f"not take; its arguments are "
                             f"{list(inspect.signature(torch.compile).parameters)[1:]}")
        return dict(option)
    raise ArgumentTypeError(f"torch_compile must be a bool or a dict of torch.compile keyword "
                            f"arguments, got {option!r}")


def _torch_compile_parts(gm: fx.GraphModule, options: Mapping[str, Any]) -> None:
    """Compile the parts that run per microbatch (the body) and once (the coupled part).

    The plan holds at most two microbatch sizes per system, each known now, so every
    part is compiled for static shapes (``dynamic=False``): one graph per size (and per
    grad mode, for a two-phase body), compiled on the first step and never again. A hand
    loop over ``torch.compile(model)`` with a short last microbatch recompiles, or goes
    dynamic, instead.
    """
    kwargs = {"dynamic": False, **options}
    for name in ("body", "coupled"):
        part = getattr(gm, name, None)
        if isinstance(part, fx.GraphModule):
            if name == "body":  # what a training step runs per microbatch (execution/joint.py)
                setattr(part, JOINT, joint_step(part, kwargs))
            setattr(gm, name, torch.compile(part, **kwargs))


def _check_outputs(option: Any) -> Any:
    if isinstance(option, str):
        if option not in OUTPUT_MODES:
            raise InputError(f"outputs must be one of {OUTPUT_MODES} or a list of output names, "
                             f"got {option!r}")
        return option
    if isinstance(option, (list, tuple)) and all(isinstance(o, (str, int)) for o in option):
        return tuple(option)
    raise ArgumentTypeError(f"outputs must be 'all', 'loss' or a list of output names "
                            f"(str keys or int positions), got {option!r}")


def kept_outputs(option: Any, spec: OutputSpec, analysis: BatchAnalysis,
                 state: StateUpdates) -> frozenset[int] | None:
    """The flat output leaves a training step returns for ``outputs=option`` (None: all).

    The trained losses are always kept (training needs them), and so is the state the
    call writes back.
    """
    if option == "all":
        return None
    keep = set(analysis.loss_outputs) | set(range(state.n_outputs, state.n_outputs
                                                 + len(state.targets)))
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


def _noise_scale(option: bool | NoiseScale) -> NoiseScale | None:
    if isinstance(option, NoiseScale):
        return option
    if not isinstance(option, bool):
        raise ArgumentTypeError(f"measure_noise_scale must be a bool or a NoiseScale, got "
                                f"{option!r}")
    return NoiseScale() if option else None


def compile(model: nn.Module, gbs: int, num_csx: int, mbs: Any = "auto", *,
            example_inputs: Any = None, example_kwargs: Mapping[str, Any] | None = None,
            in_dims: Any = 0, system: Any = None, backend: str = "simulated",
            measure_noise_scale: bool | NoiseScale = False,
            capture: str = "auto", batch_norm: str = "full_batch",
            coupling: str = "two_phase", outputs: Any = "all",
            torch_compile: bool | Mapping[str, Any] = False, recompute: bool | str = "auto",
            reshard_after_forward: bool | str = "auto", compile_only: bool = False,
            validate_only: bool = False,
            measure: bool | int = False) -> CompiledModule | Validation:
    """Compile ``model`` to run a global batch of ``gbs`` over ``num_csx`` systems.

    ``mbs`` is ``"auto"`` (chosen from the memory and time model), ``"none"`` (no
    split), an int, or ``"explore"`` / ``{"explore": {"min": a, "max": b}}`` (every
    MBS in range; needs ``compile_only=True``; ``cm.report()`` says which to pin).
    ``system`` is a preset name (``"host"``, ``"wafer-sim"``, ``"a100-80gb"``,
    ``"a100-40gb"``, ``"h100-80gb"``) or a ``SystemSpec``; None means ``"host"``.
    A plan whose modelled peak memory exceeds the system's raises ``DoesNotFitError``.
    ``example_inputs``/``example_kwargs`` are one example call (any batch size);
    ``in_dims`` gives the batch dim of the tensor inputs, vmap style: an int for
    all, a tuple per positional input, or a dict per keyword (None: unbatched).
    ``backend`` is ``"simulated"`` (every system in this process, one after the
    other) or ``"torch.distributed"`` (this process is rank r = system r of an
    initialised process group of ``num_csx`` ranks, called with its own share).
    ``measure_noise_scale`` estimates the gradient noise scale every training step
    from the microbatch gradients (``cm.noise_scale``, see ``mbcompile.execution.noise``);
    pass a ``NoiseScale(decay=...)`` to choose the smoothing.
    ``capture`` is ``"auto"`` (torch.fx symbolic tracing, and ``torch.export`` with a
    dynamic batch dim when tracing fails, as for HuggingFace models), ``"fx"`` or
    ``"export"``.
    ``batch_norm="per_microbatch"`` lets BatchNorm in training use each microbatch's
    statistics, as a hand-written loop does (a ``PerMicrobatchStatisticsWarning``, and a
    note in ``plan.warnings``: not the full-batch result); the default ``"full_batch"``
    keeps the full batch's statistics (a two-phase step, or ``MixingError`` with
    ``coupling="reject"``), since a plain split would change the result.
    ``coupling="two_phase"`` (the default) runs a graph whose ops mix samples (a
    contrastive loss, ``x @ x.T``, ``loss.sqrt()``, BatchNorm in training) exactly, as a
    two-phase step: the per-sample part per microbatch, the coupled part once on the
    whole batch (see ``passes/coupling.py``), when its memory fits the system;
    ``coupling="reject"`` raises ``MixingError`` for such graphs instead.
    ``outputs`` says what a training step (the model in training mode) returns:
    ``"all"`` (default: what the model returns), ``"loss"`` (the trained loss; the
    other outputs come back as None and are never kept per microbatch, so the memory
    model counts only the loss and ``auto`` can choose a larger MBS), or a list of
    output names (keys of a dict or dataclass output such as HuggingFace's ``logits``,
    or tuple positions) kept beside the loss. In eval mode every output is returned.
    ``torch_compile=True`` (or a dict of ``torch.compile`` keyword arguments, such as
    ``{"backend": "aot_eager"}`` where no C++ compiler is installed for inductor)
    compiles the body, and a two-phase step's coupled part, for each microbatch shape
    the plan holds (static shapes: compiled on the first step, never again).
    ``recompute`` is activation checkpointing per repeated block (``passes/recompute.py``):
    ``"auto"`` (default: evaluated beside the plain plan where memory stops the MBS from
    growing, and kept when faster or when nothing fits without it), True or False.
    ``reshard_after_forward`` is FSDP2's setting for a model sharded with ``fully_shard``
    (every unit but the root): ``"auto"`` (default: both are planned and the faster plan
    that fits is kept, jointly with the MBS; kept gathered from forward to backward halves
    the all-gathers and holds every unit at the peak), True or False. It holds during
    compiled steps only; the model's own setting is back after each.
    ``compile_only=True`` traces, analyses, plans and estimates, and returns a
    module that raises ``CompileOnlyError`` when called; ``validate_only=True``
    stops after capture and batch analysis and returns a ``Validation``.
    ``measure=True`` (or a repetition count) also times real forward+backward on
    the model's device for each MBS evaluated, reported beside the model.
    Raises ``MixingError`` when splitting the batch would change the result.
    """
    model = _check_module(model)
    unwrapped = unwrap(model)  # DDP, torch.compile, peft: bind and capture what they call
    inner = unwrapped.module
    if capture not in CAPTURES:
        raise InputError(f"capture must be one of {CAPTURES}, got {capture!r}")
    units = fsdp_modules(inner)  # FSDP2 units of a sharded model, or none
    if units and backend != "torch.distributed":
        raise InputError(
            f"{type(model).__name__} is sharded with fully_shard, so its parameters live on "
            "several ranks: compile it with backend='torch.distributed' inside the process "
            "group that sharded it")
    if units and capture == "export":
        raise InputError("a model sharded with fully_shard is captured with torch.fx "
                         "(capture='auto' or 'fx'); torch.export cannot trace FSDP's DTensors")
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if unwrapped.world_size > 1 and backend != "torch.distributed":
        raise InputError(
            f"{type(model).__name__} all-reduces gradients over {unwrapped.world_size} "
            "processes, and mbcompile compiles the module it wraps, without that all-reduce; "
            "compile with backend='torch.distributed' (mbcompile all-reduces the gradients "
            "itself), or compile the wrapped module on one process")
    if batch_norm not in BATCH_NORM_MODES:
        raise InputError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}")
    if coupling not in COUPLING_MODES:
        raise InputError(f"coupling must be one of {COUPLING_MODES}, got {coupling!r}")
    spec = get_system(system)
    policy = parse_mbs(mbs)  # parsed once, here; the policy is handed on
    check_request(gbs, num_csx, policy, compile_only or validate_only)  # before any tracing
    sig, values, inputs = _bind(inner, example_inputs, example_kwargs, in_dims)
    inputs = dataclasses.replace(inputs, capture=capture, batch_norm=batch_norm,
                                 coupling=coupling, outputs=_check_outputs(outputs),
                                 torch_compile=_check_torch_compile(torch_compile),
                                 recompute=_check_recompute(recompute))
    reshard = _check_reshard(reshard_after_forward, bool(units))
    start = time.perf_counter()
    try:
        analysed = _analyse(inner, gbs, inputs, values)
        single = single_microbatch_request(gbs, num_csx, policy)
        refused = analysed.refused(coupling)
        if refused is not None and not single:
            raise refused
        if validate_only:
            return validation_of(type(model).__name__, gbs, num_csx,
                                 analysed.captured.graph_module,
                                 time.perf_counter() - start, analysed.rejected,
                                 two_phase=refused is None and not single)
        keep = kept_outputs(inputs.outputs, analysed.captured.output_spec, analysed.analysis,
                            analysed.state) if inner.training else None
        selection = plan_for(analysed.analysis,
                             [values[n] for n in inputs.names], inputs.in_dims, gbs, num_csx,
                             policy, spec, measure=measure, name=type(model).__name__,
                             two_phase=refused is None and analysed.rejected is not None,
                             kept=keep, recompute=_recompute(inputs.recompute, analysed)
                             if inner.training else False,
                             shard=_shard_spec(units, num_csx), reshard=reshard)
    except MbcompileError:
        raise
    except Exception as exc:  # a pass crashed: say so with the model's name
        raise _crashed(model, exc) from exc
    plan = selection.plan
    rank = None
    if backend == "torch.distributed":
        from mbcompile.execution.distributed import check_world

        rank = check_world(plan)
        if measure_noise_scale:
            raise InputError("measure_noise_scale works with the simulated backend only so far; "
                             "measure on one process, then train on ranks")
    plan = dataclasses.replace(plan, tokens_per_sample=_tokens_per_sample(inputs, values),
                               warnings=plan.warnings + unwrapped.notes)
    split = plan.num_nonempty_microbatches > 1
    if batch_norm == "per_microbatch" and split and _has_batch_norm(model):
        warnings.warn(PER_MICROBATCH_NOTE, PerMicrobatchStatisticsWarning,
                      stacklevel=user_stacklevel())
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, PER_MICROBATCH_NOTE))
    try:
        return CompiledModule(model, plan, sig, inputs, values, rank,
                              _noise_scale(measure_noise_scale), selection, compile_only,
                              analysed, backend, inner)
    except MbcompileError:
        raise
    except Exception as exc:  # a pass crashed: say so with the model's name
        raise _crashed(model, exc) from exc


def _has_batch_norm(model: nn.Module) -> bool:
    """Whether a BatchNorm module of ``model`` is in training mode (uses batch statistics)."""
    kinds = tuple(op for op in batch_rules.BATCH_NORMS if isinstance(op, type))
    return any(isinstance(m, kinds) and m.training for m in model.modules())


def _crashed(model: nn.Module, exc: Exception) -> CaptureError:
    return CaptureError(f"compiling {type(model).__name__} failed in mbcompile itself: "
                        f"{type(exc).__name__}: {exc}. Please report this with the model.")
