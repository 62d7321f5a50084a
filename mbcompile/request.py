"""The request: ``compile()``'s arguments, every option checked once, before any tracing.

>>> request = make_request(model, gbs=10, num_csx=3, mbs=2, example_inputs=(ids, labels))
>>> request.policy.mode, request.pbs, request.choices.single
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

from mbcompile.dynamic_shapes import length_step, off_one, resized, symbolic_dims
from mbcompile.errors import ArgumentTypeError, InputError, PlanError
from mbcompile.execution.noise import NoiseScale
from mbcompile.execution.world import resolve_backend
from mbcompile.inputs import (
    Inputs,
    bind_example,
    check_layout,
    input_layout,
    keywords_through,
    tokens_per_sample,
    with_keywords,
)
from mbcompile.options import CompileOptions
from mbcompile.passes.capture import fsdp_modules, gathered_dtypes
from mbcompile.passes.unwrap import held_modules_refused, unwrap
from mbcompile.planning.cost import ShardSpec
from mbcompile.planning.mbs_policy import MbsPolicy, parse_mbs
from mbcompile.planning.optimizer_state import with_optimizer
from mbcompile.planning.plan import MbsChoices, check_policy, per_system_batch_sizes
from mbcompile.planning.precision import Precision, parse_precision
from mbcompile.planning.shard_plan import fsdp_units
from mbcompile.planning.systems import SystemSpec, get_system

__all__ = ["BATCH_NORM_MODES", "BATCH_SIZES", "CAPTURES", "COUPLING_MODES", "OUTPUT_MODES",
           "Request", "device_type", "make_request"]

CAPTURES = ("auto", "fx", "export")
BATCH_SIZES = ("any", "fixed")
BATCH_NORM_MODES = ("full_batch", "per_microbatch")
COUPLING_MODES = ("two_phase", "reject")
OUTPUT_MODES = ("all", "loss")


@dataclass(frozen=True)
class Request:
    """One ``compile()`` call, checked: what every later stage reads, never re-parses."""

    model: nn.Module  # what the user passed (wrapper and all)
    inner: nn.Module  # what is captured: the module a DDP / torch.compile / peft wrapper calls
    notes: tuple[str, ...]  # what unwrapping the model did, for plan.warnings
    gbs: int
    num_csx: int
    per_system_batch_sizes: tuple[int, ...]  # split once: balanced, larger first
    policy: MbsPolicy  # mbs, parsed once
    #: what the policy leaves to choose at these sizes (``plan.check_policy``): the MBS
    #: values, each one's microbatch count, the pinned one, whether nothing is split
    choices: MbsChoices
    system: SystemSpec
    signature: inspect.Signature  # forward's named parameters, then the example's keywords
    #                                 that reach its **kwargs (keyword-only), **kwargs left out
    example: Mapping[str, Any] = field(repr=False)  # the example call, by parameter name
    inputs: Inputs = field(repr=False)
    #: the options as checked (``outputs`` as a tuple when names were given); the example
    #: call is ``example``/``inputs``, ``in_dims`` kept for the keywords of a later call
    options: CompileOptions = field(repr=False, default=CompileOptions())
    # what the options mean, worked out once: ...
    torch_compile: Mapping[str, Any] | None = None  # torch.compile kwargs (None: off)
    shard: ShardSpec | None = None  # an FSDP2-sharded model's units (None: not sharded)
    noise_scale: NoiseScale | None = None  # measure_noise_scale's monitor (None: off)
    measure: int = 0  # repetitions of real timing per candidate (0: none)
    #: the autocast the plan sizes activations for (``planning/precision.py``): the
    #: ``precision`` option, ``"auto"`` read from the autocast compile() runs under
    precision: Precision = Precision()
    #: the calls it serves run no backward (eval mode or ``no_grad``): a variant planned
    #: without probes (``selection.forward_only_choice``)
    forward_only: bool = False

    @property
    def values(self) -> list[Any]:
        """The example inputs in placeholder order."""
        return [self.example[n] for n in self.inputs.names]

    @property
    def pbs(self) -> int:
        """The per-system batch size: the largest system's share."""
        return self.per_system_batch_sizes[0]

    @property
    def name(self) -> str:
        return type(self.model).__name__

    @property
    def keywords(self) -> frozenset[str]:
        """The example's keywords that reach forward's ``**kwargs`` (``num_items_in_batch``)."""
        return keywords_through(self.inner, self.signature.parameters)

    def for_batch(self, batch: int, example: Mapping[str, Any], forward_only: bool = False
                  ) -> Request:
        """This request for calls of ``batch`` samples, ``example`` (a call of that size, by
        parameter name) its example: the same options and MBS policy, planned afresh
        for the new size (``forward_only``: for calls that run no backward). Fewer samples
        than systems leave systems idle; an int MBS above the new per-system batch is
        capped at it (``MbsPolicy.at_most``)."""
        systems = min(self.num_csx, batch)
        sizes = per_system_batch_sizes(batch, systems)
        policy = self.policy.at_most(sizes[0])
        return dataclasses.replace(self, gbs=batch, num_csx=systems, per_system_batch_sizes=sizes,
                                   policy=policy, choices=check_policy(sizes, policy, True),
                                   example=dict(example), forward_only=forward_only)

    def for_precision(self, precision: Precision) -> Request:
        """This request planned for ``precision``: a first training call ran under an
        autocast the plan did not assume (``CompiledModule``)."""
        return dataclasses.replace(self, precision=precision, options=dataclasses.replace(
            self.options, precision=precision.name))

    def for_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Request:
        """This request with another call as its example, for a call that passes other
        keywords through forward's ``**kwargs`` than the example did. Inputs the example
        had keep their batch dim; a new keyword gets the default one (a 0-dim tensor
        none, a non-tensor is fixed at compile time)."""
        sig = with_keywords(inspect.signature(self.inner.forward), kwargs)
        known = {n: d for n, d in zip(self.inputs.names, self.inputs.in_dims)
                 if n not in self.inputs.concrete and n in sig.parameters}
        in_dims = self.options.in_dims
        if isinstance(in_dims, dict):  # an input the example left out: the user's dim
            known.update({n: d for n, d in in_dims.items()
                          if n not in known and n in sig.parameters})
        default = in_dims if isinstance(in_dims, int) else 0
        signature, values, inputs = bind_example(self.inner, args, kwargs, known,
                                                 self.options.planning_only, default)
        inputs = dataclasses.replace(inputs, symbolic=self._symbolic_for(values, inputs))
        return dataclasses.replace(self, signature=signature, inputs=inputs,
                                   example=off_one(values, inputs.symbolic))

    def _symbolic_for(self, values: Mapping[str, Any], new: Inputs
                      ) -> dict[str, dict[int, Any]]:
        """The symbolic dims of a call ``values`` (bound as ``new``) that becomes an example
        (``for_call``): this request's, and with ``dynamic="auto"`` those where it differs
        from this example; a dim that differs and may not is this example's ``InputError``.
        A tensor input this example left out (a mask) gets its dims that are as long as a
        symbolic dim of this call (its length), as ``padded_dims`` would have made it."""
        names = [n for n in self.inputs.names if values.get(n) is not None
                 and n not in self.inputs.concrete]  # an input left out: nothing to size
        dims = [self.inputs.in_dims[self.inputs.names.index(n)] for n in names]
        ours = Inputs(tuple(names), tuple(dims), {},
                      {n: d for n, d in self.inputs.symbolic.items() if n in names})
        varying = check_layout(ours, [values[n] for n in names],
                               input_layout(ours, [self.example[n] for n in names]),
                               self.options.dynamic)
        symbolic = _with_dims(ours.symbolic, varying)
        lengths = {values[n].shape[d] for n, ds in symbolic.items() for d in ds
                   if isinstance(values[n], torch.Tensor) and d < values[n].dim()}
        for name, batch_dim in zip(new.names, new.in_dims):
            value = values[name]
            if name not in self.inputs.concrete or not isinstance(value, torch.Tensor):
                continue
            same = [d for d in range(value.dim()) if d != batch_dim and value.shape[d] in lengths]
            symbolic.update({name: dict.fromkeys(same, (None, None))} if same else {})
        return symbolic

    def for_shapes(self, varying: Mapping[str, Iterable[int]]) -> Request:
        """This request with the ``varying`` dims (by input) symbolic too: a call changed
        their sizes (``dynamic="auto"``), so one compiled step must run every size."""
        symbolic = _with_dims(self.inputs.symbolic, varying)
        inputs = dataclasses.replace(self.inputs, symbolic=symbolic)
        return dataclasses.replace(self, inputs=inputs, example=off_one(self.example, symbolic))

    def at_other_lengths(self) -> Request:
        """This request with its example resized along each symbolic dim (``resized``):
        what ``checked_symbolic`` compiles to prove the step holds for every length."""
        symbolic = self.inputs.symbolic
        step = length_step([(t.shape[d], bounds) for n, dims in symbolic.items()
                            for t in pytree.tree_leaves(self.example[n])
                            if isinstance(t, torch.Tensor)
                            for d, bounds in dims.items() if d < t.dim()])
        example = {n: resized(v, symbolic[n], step) if n in symbolic else v
                   for n, v in self.example.items()}
        return dataclasses.replace(self, example=example)


def _with_dims(symbolic: Mapping[str, Mapping[int, Any]], more: Mapping[str, Iterable[int]]
               ) -> dict[str, dict[int, Any]]:
    """``symbolic`` with the dims ``more`` names added, unbounded."""
    out = {n: dict(dims) for n, dims in symbolic.items()}
    for name, dims in more.items():
        for dim in dims:
            out.setdefault(name, {}).setdefault(dim, (None, None))
    return out


def make_request(model: Any, gbs: int, num_csx: int, mbs: Any = "auto", **options: Any
                 ) -> Request:
    """Check every option of ``compile()`` (the same arguments; ``CompileOptions`` names
    them) and bind the example call; raises before anything is traced (docs/mbs.md, "When
    it does not fit": fail fast)."""
    o = CompileOptions.of(options)
    # "auto" -> what the launcher's world runs (execution/world.py); checked once, here
    o = dataclasses.replace(o, backend=resolve_backend(o.backend, num_csx))
    planning_only = o.planning_only
    model = _check_module(model, planning_only)
    unwrapped = unwrap(model)  # DDP, torch.compile, peft: bind and capture what they call
    inner = unwrapped.module
    held_modules_refused(inner)  # a compiled or TorchScript submodule: named, before tracing
    if o.capture not in CAPTURES:
        raise InputError(f"capture must be one of {CAPTURES}, got {o.capture!r}")
    units = fsdp_modules(inner)  # FSDP2 units of a sharded model, or none
    if not units and o.shard is not None:  # FSDP2 planned in one process, before sharding
        units = _planned_units(inner, o.shard, planning_only)
    if units and o.backend != "torch.distributed" and o.shard is None:
        raise InputError(
            f"{type(model).__name__} is sharded with fully_shard, so its parameters live on "
            "several ranks: compile it with backend='torch.distributed' inside the process "
            "group that sharded it")
    if unwrapped.world_size > 1 and o.backend != "torch.distributed":
        raise InputError(
            f"{type(model).__name__} all-reduces gradients over {unwrapped.world_size} "
            "processes, and mbcompile compiles the module it wraps, without that all-reduce; "
            "compile with backend='torch.distributed' (mbcompile all-reduces the gradients "
            "itself), or compile the wrapped module on one process")
    if o.batch_norm not in BATCH_NORM_MODES:
        raise InputError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {o.batch_norm!r}")
    if o.coupling not in COUPLING_MODES:
        raise InputError(f"coupling must be one of {COUPLING_MODES}, got {o.coupling!r}")
    if o.batch_sizes not in BATCH_SIZES:
        raise InputError(f"batch_sizes must be one of {BATCH_SIZES}, got {o.batch_sizes!r}")
    if o.nonfinite not in ("return", "raise"):
        raise InputError(f"nonfinite must be 'return' or 'raise', got {o.nonfinite!r}")
    spec = with_optimizer(get_system(o.system), o.optimizer, model)
    policy = parse_mbs(mbs)  # parsed once, here; the policy is handed on
    sizes = per_system_batch_sizes(gbs, num_csx)  # split once, here
    choices = check_policy(sizes, policy, planning_only)  # before any tracing
    _check_cost_model(o.cost_model, policy, o.system, o.measure)
    signature, values, inputs = bind_example(inner, o.example_inputs, o.example_kwargs,
                                             o.in_dims, planning_only)
    inputs = dataclasses.replace(inputs, symbolic=symbolic_dims(
        o.dynamic, inputs.names, inputs.in_dims, values))
    values = off_one(values, inputs.symbolic)  # a symbolic dim is 2 or more
    if policy.mode == "tokens":  # an int MBS at the example's length now: its choices
        policy = _at_example_tokens(policy, inputs, values, sizes[0], type(model).__name__)
        choices = check_policy(sizes, policy, planning_only)
    outputs, torch_compile = _check_outputs(o.outputs), _check_torch_compile(o.torch_compile)
    checked = dataclasses.replace(o, outputs=outputs, recompute=_check_recompute(o.recompute),
                                  example_inputs=None, example_kwargs=None)  # bound: example
    _check_reshard(o.reshard_after_forward, bool(units))
    _check_gradient_sync(o.gradient_sync, bool(units))
    return Request(
        model=model, inner=inner, notes=tuple(unwrapped.notes), gbs=int(gbs),
        num_csx=int(num_csx), per_system_batch_sizes=sizes, policy=policy, choices=choices,
        system=spec,
        signature=signature, example=values, inputs=inputs, options=checked,
        torch_compile=torch_compile, shard=_shard_spec(units, num_csx),
        noise_scale=_noise_scale(o.measure_noise_scale), measure=_repetitions(o.measure),
        precision=parse_precision(o.precision, device_type(inner)))


def device_type(model: nn.Module) -> str:
    """Where ``model``'s parameters live: the device an autocast for it names."""
    return next((p.device.type for p in model.parameters()), "cpu")


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
    if policy.mode not in ("int", "none", "tokens"):
        raise InputError(f"cost_model=False plans without the cost model, but "
                         f"mbs={policy.request!r} chooses the MBS with it; pass an int mbs "
                         "or 'none', or leave cost_model=True")
    if system is not None or measure:
        what = "system=" if system is not None else "measure="
        raise InputError(f"cost_model=False plans without the cost model, so nothing is checked "
                         f"against a system or timed; drop {what}, or leave cost_model=True")


def _at_example_tokens(policy: MbsPolicy, inputs: Inputs, values: Mapping[str, Any],
                       pbs: int, name: str) -> MbsPolicy:
    """A token budget (``mbs={"tokens": n}``) as the int MBS of the example's length, the
    budget kept beside it for calls of other lengths (``planning/length_split.py``)."""
    tokens = tokens_per_sample(inputs, values)
    if tokens is None:
        raise InputError(
            f"mbs={policy.request!r} counts the tokens of a (batch, length) integer input (token "
            f"ids), and {name}'s example call has none; pass an int mbs (samples per "
            "microbatch) or 'auto'")
    return policy.for_tokens(tokens, pbs)


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
