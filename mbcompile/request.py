"""The request: ``compile()``'s arguments, every option checked once, before any tracing.

>>> request = make_request(model, gbs=10, num_csx=3, mbs=2, example_inputs=(ids, labels))
>>> request.policy.mode, request.pbs, request.single
('int', 4, False)

Everything later stages need from the call is here, parsed once (``mbs`` into an
``MbsPolicy``, ``system`` into a ``SystemSpec``, ``in_dims`` into one batch dim per
forward parameter), so that no stage re-reads or re-checks a raw option.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.errors import ArgumentTypeError, CaptureError, InputError, PlanError
from mbcompile.execution.noise import NoiseScale
from mbcompile.execution.world import resolve_backend
from mbcompile.passes.capture import fsdp_modules, gathered_dtypes
from mbcompile.passes.unwrap import unwrap
from mbcompile.planning.cost import ShardSpec
from mbcompile.planning.explore import check_request, single_microbatch_request
from mbcompile.planning.optimizer_state import with_optimizer
from mbcompile.planning.plan import MbsPolicy, parse_mbs, per_system_batch_sizes
from mbcompile.planning.shard_plan import fsdp_units
from mbcompile.planning.systems import SystemSpec, get_system

__all__ = ["BATCH_NORM_MODES", "CAPTURES", "COUPLING_MODES", "OUTPUT_MODES", "Inputs",
           "BATCH_SIZES", "Request", "batch_size", "check_layout", "for_call", "input_layout",
           "keywords_through", "leaf_name", "leaves", "make_request", "same_value"]

CAPTURES = ("auto", "fx", "export")
BATCH_SIZES = ("any", "fixed")
BATCH_NORM_MODES = ("full_batch", "per_microbatch")
COUPLING_MODES = ("two_phase", "reject")
OUTPUT_MODES = ("all", "loss")
@dataclass(frozen=True)
class Inputs:
    """How a call's arguments map onto the graph's placeholders."""

    names: tuple[str, ...]  # forward's parameters, in order
    in_dims: tuple[int | None, ...]  # batch dim per parameter (None: unbatched)
    concrete: Mapping[str, Any]  # non-tensor arguments fixed at compile time


@dataclass(frozen=True)
class Request:
    """One ``compile()`` call, checked: what every later stage reads, never re-parses."""

    model: nn.Module  # what the user passed (wrapper and all)
    inner: nn.Module  # what is captured: the module a DDP / torch.compile / peft wrapper calls
    notes: tuple[str, ...]  # what unwrapping the model did, for plan.warnings
    gbs: int
    num_csx: int
    policy: MbsPolicy  # mbs, parsed once
    system: SystemSpec
    signature: inspect.Signature  # forward's named parameters, then the example's keywords
    #                                 that reach its **kwargs (keyword-only), **kwargs left out
    example: Mapping[str, Any] = field(repr=False)  # the example call, by parameter name
    inputs: Inputs = field(repr=False)
    backend: str = "simulated"
    capture: str = "auto"  # "auto" (fx, then torch.export if fx fails), "fx" or "export"
    batch_norm: str = "full_batch"  # or "per_microbatch": BatchNorm statistics per microbatch
    coupling: str = "two_phase"  # or "reject": ops that mix samples raise MixingError
    outputs: Any = "all"  # "all", "loss", or output names: what a training step returns
    torch_compile: Mapping[str, Any] | None = None  # torch.compile kwargs (None: off)
    recompute: bool | str = "auto"  # activation checkpointing per block
    reshard: bool | str = "auto"  # FSDP2's reshard_after_forward
    gradient_sync: str = "auto"  # FSDP2's gradient reduce-scatter: "step" or "microbatch"
    shard: ShardSpec | None = None  # an FSDP2-sharded model's units (None: not sharded)
    noise_scale: NoiseScale | None = None
    compile_only: bool = False
    validate_only: bool = False
    measure: int = 0  # repetitions of real timing per candidate (0: none)
    cost_model: bool = True  # False: planned without the cost model's fake-tensor probes
    batch_sizes: str = "any"  # "any": other batch sizes are planned on first sight; "fixed"
    optimizer: Any = None  # what the plan's optimizer state was sized for (system has the bytes)
    in_dims: Any = 0  # the option as given: a later call's new keywords get its default dim

    @property
    def values(self) -> list[Any]:
        """The example inputs in placeholder order."""
        return [self.example[n] for n in self.inputs.names]

    @property
    def pbs(self) -> int:
        return per_system_batch_sizes(self.gbs, self.num_csx)[0]

    @property
    def single(self) -> bool:
        """Whatever is chosen, one system runs one microbatch: nothing is split."""
        return single_microbatch_request(self.gbs, self.num_csx, self.policy)

    @property
    def name(self) -> str:
        return type(self.model).__name__

    @property
    def keywords(self) -> frozenset[str]:
        """The example's keywords that reach forward's ``**kwargs`` (``num_items_in_batch``)."""
        return keywords_through(self.inner, self.signature.parameters)


def make_request(model: Any, gbs: int, num_csx: int, mbs: Any = "auto", *,
                 example_inputs: Any = None, example_kwargs: Mapping[str, Any] | None = None,
                 in_dims: Any = 0, system: Any = None, backend: str = "auto",
                 measure_noise_scale: bool | NoiseScale = False, capture: str = "auto",
                 batch_norm: str = "full_batch", coupling: str = "two_phase",
                 outputs: Any = "all", torch_compile: bool | Mapping[str, Any] = False,
                 recompute: bool | str = "auto", reshard_after_forward: bool | str = "auto",
                 gradient_sync: str = "auto",
                 compile_only: bool = False, validate_only: bool = False,
                 measure: bool | int = False, cost_model: bool = True,
                 batch_sizes: str = "any", optimizer: Any = None, shard: str | None = None
                 ) -> Request:
    """Check every option of ``compile()`` (the same arguments) and bind the example call;
    raises before anything is traced (DESIGN.md invariant 9: fail fast)."""
    planning_only = compile_only or validate_only
    backend = resolve_backend(backend, num_csx)  # "auto" -> what the launcher's world runs
    model = _check_module(model, planning_only)
    unwrapped = unwrap(model)  # DDP, torch.compile, peft: bind and capture what they call
    inner = unwrapped.module
    if capture not in CAPTURES:
        raise InputError(f"capture must be one of {CAPTURES}, got {capture!r}")
    units = fsdp_modules(inner)  # FSDP2 units of a sharded model, or none
    if not units and shard is not None:  # FSDP2 planned in one process, before sharding
        units = _planned_units(inner, shard, planning_only)
    if units and backend != "torch.distributed" and shard is None:
        raise InputError(
            f"{type(model).__name__} is sharded with fully_shard, so its parameters live on "
            "several ranks: compile it with backend='torch.distributed' inside the process "
            "group that sharded it")
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
    if batch_sizes not in BATCH_SIZES:
        raise InputError(f"batch_sizes must be one of {BATCH_SIZES}, got {batch_sizes!r}")
    spec = with_optimizer(get_system(system), optimizer, model)
    policy = parse_mbs(mbs)  # parsed once, here; the policy is handed on
    check_request(gbs, num_csx, policy, compile_only or validate_only)  # before any tracing
    _check_cost_model(cost_model, policy, system, measure)
    signature, values, inputs = _bind(inner, example_inputs, example_kwargs, in_dims,
                                      planning_only)
    return Request(
        model=model, inner=inner, notes=tuple(unwrapped.notes), gbs=gbs, num_csx=num_csx,
        policy=policy, system=spec, signature=signature, example=values, inputs=inputs,
        backend=backend, capture=capture, batch_norm=batch_norm, coupling=coupling,
        outputs=_check_outputs(outputs), torch_compile=_check_torch_compile(torch_compile),
        recompute=_check_recompute(recompute),
        reshard=_check_reshard(reshard_after_forward, bool(units)),
        gradient_sync=_check_gradient_sync(gradient_sync, bool(units)),
        shard=_shard_spec(units, num_csx), noise_scale=_noise_scale(measure_noise_scale),
        compile_only=compile_only, validate_only=validate_only, measure=_repetitions(measure),
        cost_model=cost_model, batch_sizes=batch_sizes, optimizer=optimizer, in_dims=in_dims)


def for_call(request: Request, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Request:
    """``request`` with another call as its example, for a call that passes other keywords
    through forward's ``**kwargs`` than the example did (the compiled module compiles a
    variant for it). Inputs the example had keep their batch dim; a new keyword gets the
    default one (a 0-dim tensor none, a non-tensor is fixed at compile time)."""
    sig = _with_keywords(inspect.signature(request.inner.forward), kwargs)
    known = {n: d for n, d in zip(request.inputs.names, request.inputs.in_dims)
             if n not in request.inputs.concrete and n in sig.parameters}
    default = request.in_dims if isinstance(request.in_dims, int) else 0
    signature, values, inputs = _bind(request.inner, args, kwargs, known,
                                      request.compile_only or request.validate_only, default)
    return dataclasses.replace(request, signature=signature, example=values, inputs=inputs)


def keywords_through(model: nn.Module, names: Iterable[str]) -> frozenset[str]:
    """Which of ``names`` are not parameters ``model.forward`` names: they reach its
    ``**kwargs`` (empty when forward takes none, since then a call with them fails)."""
    params = inspect.signature(model.forward).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return frozenset()
    return frozenset(n for n in names if n not in params)


# --------------------------------------------------------------------------- #
# The model and the example call
# --------------------------------------------------------------------------- #


def _check_module(model: Any, planning_only: bool) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ArgumentTypeError(
            f"model must be a torch.nn.Module, got {type(model).__name__}; wrap functions in a "
            "Module whose forward calls them")
    meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if meta and not planning_only:  # shapes are enough to plan: compile_only / validate_only
        raise InputError(
            f"model has parameters or buffers on the meta device ({meta[0]!r}, ...), which hold "
            "no values to train: compile it with compile_only=True (or validate_only=True) to "
            "plan it, or materialise it first (model.to_empty(device='cpu'), then "
            "model.tie_weights() for a transformers model, and load weights)")
    return model


def _bind(model: nn.Module, example_inputs: Any, example_kwargs: Any, in_dims: Any,
          planning_only: bool = False, fallback: int = 0
          ) -> tuple[inspect.Signature, dict[str, Any], Inputs]:
    """Bind the example call to forward's signature and resolve ``in_dims`` per parameter
    (``fallback``: the dim of an input a tuple or dict ``in_dims`` leaves out)."""
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
    sig = _with_keywords(sig, kwargs)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(f"example inputs do not match {type(model).__name__}.forward{sig}: "
                         f"{exc}") from None
    bound.apply_defaults()
    values = dict(bound.arguments)
    names = tuple(values)
    positional = list(sig.parameters)[:len(args)]
    meta = [n for n in names if any(isinstance(t, torch.Tensor) and t.is_meta
                                    for t in pytree.tree_leaves(values[n]))]
    if meta and not planning_only:
        raise InputError(
            f"example_inputs hold tensors on the meta device (input {meta[0]!r}), which have no "
            "values to run the model on; pass real tensors (any batch size) on the model's "
            "device, or compile with compile_only=True (or validate_only=True) to plan only")
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
        explicit = True
        if isinstance(in_dims, (tuple, list)) and name in positional:
            d = in_dims[positional.index(name)]
        elif isinstance(in_dims, dict) and name in in_dims:
            d = in_dims[name]
        else:
            d = in_dims if not isinstance(in_dims, (tuple, list, dict)) else fallback
            explicit = False
        if not explicit and isinstance(value, torch.Tensor) and value.dim() == 0:
            d = None  # a scalar (a token count, a temperature) has no batch dim to split
        has_tensor = any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(value))
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise ArgumentTypeError(f"in_dims for input {name!r} must be an int or None, "
                                    f"got {d!r}")
        dims.append(d if has_tensor else None)
    concrete = {n: values[n] for n, d in zip(names, dims)
                if d is None and not any(isinstance(t, torch.Tensor)
                                         for t in pytree.tree_leaves(values[n]))}
    inputs = Inputs(names, tuple(dims), concrete)
    batch_size(inputs, [values[n] for n in names], check_ndim=True)
    return sig, values, inputs


def _with_keywords(sig: inspect.Signature, kwargs: Mapping[str, Any]) -> inspect.Signature:
    """forward's signature with ``**kwargs`` replaced by the keywords the call passes there.

    ``forward(input_ids, labels=None, **kwargs)`` called with ``num_items_in_batch=n`` binds
    as ``forward(input_ids, labels=None, *, num_items_in_batch)``: each such keyword is one
    more graph input, batched or not like any other (transformers.Trainer passes the
    token count of the whole batch, a 0-dim tensor, to scale the loss).
    """
    params = list(sig.parameters.values())
    variadic = [p for p in params if p.kind == p.VAR_KEYWORD]
    if not variadic:
        return sig
    named = [p for p in params if p not in variadic]
    taken = {p.name for p in named}
    through = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs
               if k not in taken]
    return sig.replace(parameters=[*named, *through])


def batch_size(inputs: Inputs, values: Sequence[Any], check_ndim: bool = False) -> int | None:
    """The common batch size of the batched inputs; raises if they disagree."""
    seen: dict[int, tuple[str, Any]] = {}
    for name, value, d in zip(inputs.names, values, inputs.in_dims):
        if d is None:
            continue
        for path, t in leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            if d < 0:
                raise InputError(
                    f"in_dims gives input {leaf_name(name, path)} batch dim {d}: negative "
                    f"dims are not supported; count from the front (in_dims={t.dim() + d} here)")
            if t.dim() == 0:
                raise InputError(
                    f"input {leaf_name(name, path)} is a scalar (a 0-dim tensor), which has no "
                    f"batch dim, but in_dims gives it {d}; give it None")
            if t.dim() <= d:
                raise InputError(
                    f"in_dims gives input {leaf_name(name, path)} batch dim {d}, but it has "
                    f"{t.dim()} dims; pass in_dims=None for unbatched inputs or the right dim")
            seen.setdefault(t.shape[d], (name, path))
    if len(seen) > 1:
        detail = ", ".join(f"{leaf_name(*n)} has {b}" for b, n in seen.items())
        raise InputError(f"batched inputs disagree on the batch size ({detail}); every batched "
                         "input must have the same number of samples along its in_dims dim")
    return next(iter(seen), None)


def leaves(value: Any) -> list[tuple[Any, Any]]:
    """``(path, leaf)`` of every leaf of an input; a bare tensor (the usual input, checked on
    every call) without a pytree walk."""
    if isinstance(value, torch.Tensor):
        return [((), value)]
    return pytree.tree_flatten_with_path(value)[0]


def leaf_name(name: str, path: Any) -> str:
    """How an error names one leaf of an input: ``'x'``, or ``batch['y']``."""
    return repr(name) if not path else f"{name}{pytree.keystr(path)}"


def tokens_per_sample(inputs: Inputs, values: Mapping[str, Any]) -> int | None:
    """The sequence length of token-id inputs ((B, T) integer tensors), if there are any."""
    for name, d in zip(inputs.names, inputs.in_dims):
        value = values[name]
        if (d is not None and isinstance(value, torch.Tensor) and not value.is_floating_point()
                and value.dim() == 2):
            return int(value.shape[1 - d])
    return None


def input_layout(inputs: Inputs, values: Sequence[Any]) -> tuple[Any, ...]:
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


def check_layout(inputs: Inputs, values: Sequence[Any], layout: tuple[Any, ...]) -> None:
    """Raise ``InputError`` unless every input is nested and shaped like the example.

    Shapes other than the batch dim are fixed at compile time: the rewritten graph
    holds sizes computed from them (``x.size(0) * x.size(1)`` after the loop).
    """
    for name, value, d, (spec, shapes) in zip(inputs.names, values, inputs.in_dims, layout):
        if name in inputs.concrete:
            continue  # compared by value already
        if isinstance(value, torch.Tensor) and spec.is_leaf():  # the usual input: no walk
            found = leaves(value)
        else:
            found, got = pytree.tree_flatten_with_path(value)
            if got != spec:
                raise InputError(
                    f"input {name!r} is nested differently from the example ({got} instead "
                    f"of {spec}); pass the same structure (keys, lengths) or compile again "
                    "with an example of this one")
        for (path, t), want in zip(found, shapes):
            if _shape(t, d) != want:
                raise InputError(_layout_error(leaf_name(name, path), t, d, want))


def _layout_error(name: str, t: Any, d: int | None, want: tuple[int | None, ...] | None) -> str:
    """Why one input leaf does not fit the compiled graph, never two equal shapes side by
    side: a tensor where the example had none (or the reverse), a scalar, another shape."""
    fix = "compile again with an example call like this one"
    if want is None or not isinstance(t, torch.Tensor):
        was = f"a tensor of shape {_shown(want)}" if want is not None else "no tensor"
        now = (f"a tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
               else repr(t) if t is None else f"a Python {type(t).__name__}")
        return (f"input {name} is {now} where the example passed {was}; the graph was "
                f"traced for what the example passed: pass the same kind of value, or {fix}")
    if t.dim() == 0 or not want:
        scalar = "a scalar (a 0-dim tensor)"
        now = scalar if t.dim() == 0 else f"a tensor of shape {tuple(t.shape)}"
        was = scalar if not want else f"a tensor of shape {_shown(want)} (B: the batch dim)"
        return (f"input {name} is {now} where the example passed {was}; a scalar is "
                f"passed whole to every microbatch, a batched input split: {fix}")
    return (f"input {name} has shape {_shown(_shape(t, d))} but the example had "
            f"{_shown(want)} (B: the batch dim); shapes other than the batch dim are fixed "
            f"at compile time: {fix}")


def _shown(shape: tuple[int | None, ...] | None) -> tuple[int | str, ...]:
    return tuple("B" if s is None else s for s in shape or ())


def same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a truthy == are compared by identity only
        return False


# --------------------------------------------------------------------------- #
# The options
# --------------------------------------------------------------------------- #


def _shard_spec(units: Sequence[tuple[str, nn.Module]], world: int) -> ShardSpec | None:
    """A sharded model's FSDP2 ``units`` (``fsdp_modules``, the root first) by the full
    bytes of the parameters each owns, gathered (in a ``MixedPrecisionPolicy``'s
    ``param_dtype`` where it sets one)."""
    if not units:
        return None
    sharded = hasattr(units[0][1], "_get_fsdp_state")  # not only planned (shard="fsdp")
    dtypes = gathered_dtypes(units) if sharded else {}
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
                size = dtypes[id(p)].itemsize if id(p) in dtypes else p.element_size()
                sizes[owner[id(p)]] += p.numel() * size  # DTensor: global numel
    return ShardSpec(world, tuple(sizes))


def _check_recompute(option: Any) -> bool | str:
    if option == "auto" or isinstance(option, bool):
        return option
    raise InputError(f"recompute must be 'auto', True or False, got {option!r}")


def _planned_units(model: nn.Module, shard: Any, planning_only: bool
                   ) -> list[tuple[str, nn.Module]]:
    """``shard="fsdp"`` on a model not sharded yet: the FSDP2 units ``shard_model`` would
    make (each repeated block, then the root), costed over ``num_csx`` ranks. Only a plan
    can be made so: training sharded needs the ranks that hold the shards."""
    if shard != "fsdp":
        raise InputError(f"shard must be 'fsdp' or None, got {shard!r}")
    if not planning_only:
        raise InputError(
            "shard='fsdp' plans FSDP2 over num_csx ranks without sharding anything, so it "
            "needs compile_only=True (or validate_only=True); to train sharded, run on ranks "
            "with the model sharded (mbcompile.Trainer(..., shard='fsdp'), or mbcompile fit "
            "with shard: fsdp and --nproc N)")
    return fsdp_units(model)


def _check_reshard(option: Any, sharded: bool) -> bool | str:
    if option != "auto" and not isinstance(option, bool):
        raise InputError(f"reshard_after_forward must be 'auto', True or False, got {option!r}")
    if option != "auto" and not sharded:
        raise InputError("reshard_after_forward is FSDP2's setting for a model sharded with "
                         "fully_shard; this model is not sharded: leave it at 'auto'")
    return option


def _check_gradient_sync(option: Any, sharded: bool) -> str:
    if option not in ("auto", "step", "microbatch"):
        raise InputError(f"gradient_sync must be 'auto', 'step' or 'microbatch', got {option!r}")
    if option != "auto" and not sharded:
        raise InputError("gradient_sync is when FSDP2 reduce-scatters the gradients of a model "
                         "sharded with fully_shard; this model is not sharded: leave it at "
                         "'auto'")
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


def _noise_scale(option: bool | NoiseScale) -> NoiseScale | None:
    if isinstance(option, NoiseScale):
        return option
    if not isinstance(option, bool):
        raise ArgumentTypeError(f"measure_noise_scale must be a bool or a NoiseScale, got "
                                f"{option!r}")
    return NoiseScale() if option else None


def _check_cost_model(option: Any, policy: MbsPolicy, system: Any, measure: Any) -> None:
    """``cost_model=False`` plans without the memory model: only what needs none."""
    if not isinstance(option, bool):
        raise ArgumentTypeError(f"cost_model must be a bool, got {option!r}")
    if option:
        return
    if policy.mode not in ("int", "none"):
        raise InputError(f"cost_model=False plans without the cost model, but "
                         f"mbs={policy.request!r} chooses the MBS with it; pass an int mbs "
                         "or 'none', or leave cost_model=True")
    if system is not None or measure:
        what = "system=" if system is not None else "measure="
        raise InputError(f"cost_model=False plans without the cost model, so nothing is checked "
                         f"against a system or timed; drop {what}, or leave cost_model=True")


def _repetitions(measure: Any) -> int:
    """``measure=`` as repetitions of real timing per candidate (0: none)."""
    if isinstance(measure, bool):
        return 3 if measure else 0
    if not isinstance(measure, int):
        raise ArgumentTypeError(f"measure must be a bool or a repetition count, got "
                                f"{measure!r}")
    if measure < 0:
        raise PlanError(f"measure must be a bool or a repetition count >= 1, got {measure}")
    return measure
