"""The example call and later calls: how a call's arguments map onto the graph's inputs.

>>> signature, values, inputs = bind_example(model, (ids, labels), None, in_dims=0)
>>> inputs.names, inputs.in_dims
(('input_ids', 'labels'), (0, 0))

``make_request`` binds the example call once (each forward parameter's batch dim,
the non-tensor values fixed at compile time); the compiled module checks every later
call against it (``batch_size``, ``check_layout``) before anything runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.errors import ArgumentTypeError, CaptureError, InputError
from mbcompile.input_kinds import (
    InputDtypeError,
    InputPresenceError,
    Structure,
    check_kind,
    check_kinds,
    dtype_error,
    odd_kind,
)
from mbcompile.passes.export_shapes import has_tensor
from mbcompile.passes.guard_values import fingerprint
from mbcompile.passes.guards import plain

__all__ = ["CallBinder", "InputDtypeError", "InputPresenceError", "Inputs", "batch_size",
           "bind_example", "ExampleValue", "PLAIN", "check_unchanged", "check_layout",
           "check_value", "input_layout", "keywords_through", "leaf_name", "leaves",
           "same_value", "tokens_per_sample", "with_keywords"]


@dataclass(frozen=True)
class Inputs:
    """How a call's arguments map onto the graph's placeholders."""

    names: tuple[str, ...]  # forward's parameters, in order
    in_dims: tuple[int | None, ...]  # batch dim per parameter (None: unbatched)
    concrete: Mapping[str, Any]  # non-tensor arguments fixed at compile time
    #: non-batch dims that may vary between calls (``dynamic_shapes.py``): input name ->
    #: dim -> inclusive (min, max) bounds, None where unbounded
    symbolic: Mapping[str, Mapping[int, tuple[int | None, int | None]]] = field(
        default_factory=dict)
    #: of those that hold state (a config object, a dict of flags): their ``fingerprint``,
    #: compared on each call, since a change in place keeps them ``is`` the example's
    images: Mapping[str, Any] = field(default_factory=dict)



def keywords_through(model: nn.Module, names: Iterable[str]) -> frozenset[str]:
    """Which of ``names`` are not parameters ``model.forward`` names: they reach its
    ``**kwargs`` (empty when forward takes none, since then a call with them fails)."""
    params = inspect.signature(model.forward).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return frozenset()
    return frozenset(n for n in names if n not in params)


def bind_example(model: nn.Module, example_inputs: Any, example_kwargs: Any, in_dims: Any,
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
    sig = with_keywords(sig, kwargs)
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
    for name in names:  # nested, sparse, a subclass with an override; an opaque holder
        check_kinds(name, values[name])
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
        if d is not None and (isinstance(d, bool) or not isinstance(d, int)):
            raise ArgumentTypeError(f"in_dims for input {name!r} must be an int or None, "
                                    f"got {d!r}")
        dims.append(d if has_tensor(value) else None)
    concrete = {n: values[n] for n, d in zip(names, dims)
                if d is None and not has_tensor(values[n])}
    images = {n: fingerprint(v)[0] for n, v in concrete.items() if not plain(v)}
    inputs = Inputs(names, tuple(dims), concrete, images=images)
    batch_size(inputs, [values[n] for n in names], check_ndim=True)
    return sig, values, inputs


def with_keywords(sig: inspect.Signature, kwargs: Mapping[str, Any]) -> inspect.Signature:
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


def batch_size(inputs: Inputs, values: Sequence[Any], check_ndim: bool = False,
               empty: bool = False) -> int | None:
    """The batched inputs' common batch size; raises if they disagree, or 0 unless ``empty``."""
    seen: dict[int, tuple[str, Any]] = {}
    for name, value, d in zip(inputs.names, values, inputs.in_dims):
        if d is None:
            continue
        for path, t in leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_nested:  # no sizes to read (sparse, a subclass: in check_layout)
                check_kind(leaf_name(name, path), t)
            if d < 0:
                raise InputError(
                    f"in_dims gives input {leaf_name(name, path)} batch dim {d}: negative "
                    f"dims are not supported; count from the front (in_dims={t.dim() + d} here)")
            if t.dim() == 0:
                raise InputError(  # (a list of per-sample labels: stack it in the collator)
                    f"input {leaf_name(name, path)} is a scalar (a 0-dim tensor), which has no "
                    f"batch dim, but in_dims gives it {d}; give it None, or pass per-sample "
                    "scalars as one (B,) tensor (torch.stack them in the collator)")
            if t.dim() <= d:
                raise InputError(
                    f"in_dims gives input {leaf_name(name, path)} batch dim {d}, but it has "
                    f"{t.dim()} dims; pass in_dims=None for unbatched inputs or the right dim")
            seen.setdefault(t.shape[d], (name, path))
    if len(seen) > 1:
        detail = ", ".join(f"{leaf_name(*n)} has {b}" for b, n in seen.items())
        raise InputError(f"batched inputs disagree on the batch size ({detail}); every batched "
                         "input has the same samples along its in_dims dim: give one that holds "
                         "none in_dims={name: None} (flash attention's cu_seq_lens_q); pad a "
                         "list of per-sample tensors of other sizes (a dict of boxes per image) "
                         "into one tensor a field, (B, max_boxes) with -1 labels, in the collator")
    if 0 in seen and not empty:  # (the plan's error named gbs, which the call did not pass)
        raise InputError(f"input {leaf_name(*seen[0])} has no samples (its batch dim is 0); "
                         "a step needs at least one: skip empty batches in the loop")
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


def input_layout(inputs: Inputs, values: Sequence[Any], fixed: bool = False
                 ) -> tuple[Any, ...]:
    """Per input: its ``Structure`` (pytree spec and leaf dtypes; ``fixed``: the graph holds
    the dtypes) and its tensors' shapes, the batch dim left out (None) and symbolic dims
    marked ``ANY``."""
    out = []
    for name, value, d in zip(inputs.names, values, inputs.in_dims):
        leaves, spec = pytree.tree_flatten(value)
        free = inputs.symbolic.get(name, {})
        out.append((Structure(spec, Structure.dtypes_of(leaves, d), fixed), tuple(
            ExampleValue(t) if type(t) in PLAIN else _shape(t, d, free) for t in leaves)))
    return tuple(out)


#: Values inside an input the graph holds as the example's (``{"x": x, "flip": True}``).
PLAIN = (bool, int, float, str)


@dataclass(frozen=True)
class ExampleValue:
    """A number, flag or string inside an input, as the example passed it."""

    value: Any


#: How a layout marks a symbolic dim: any size fits.
ANY = "any"


def _shape(t: Any, d: int | None, free: Mapping[int, Any] = {}  # noqa: B006 - read only
           ) -> tuple[int | str | None, ...] | None:
    if not isinstance(t, torch.Tensor):
        return None
    return tuple(None if i == d else ANY if i in free else s for i, s in enumerate(t.shape))


def check_layout(inputs: Inputs, values: Sequence[Any], layout: tuple[Any, ...],
                 dynamic: Any = False, dtypes: bool = True) -> dict[str, frozenset[int]]:
    """Raise ``InputError`` unless every input is nested and shaped like the example, its
    symbolic dims within their bounds, its tensors of a kind the step runs (``check_kind``)
    and, where the graph holds them, of the example's dtypes (``InputDtypeError``; not with
    ``dtypes=False``: for a call that becomes a variant's example).

    With ``dynamic="auto"``, a call that differs from the example only in the sizes of
    non-batch dims returns those dims by input (the module compiles once with them
    symbolic: ``Request.for_shapes``) instead; empty when the call fits as it is. Other
    shapes are fixed at compile time: the graph may hold sizes computed from them.
    """
    varying: dict[str, set[int]] = {}
    changed: list[tuple[str, Any, Any]] = []  # (leaf, the example's dtype, the call's)
    for name, value, d, (held, shapes) in zip(inputs.names, values, inputs.in_dims, layout):
        if name in inputs.concrete:
            continue  # compared by value already
        spec, fixed = held.spec, held.fixed and dtypes
        if isinstance(value, torch.Tensor) and spec.is_leaf():  # the usual input: no walk
            found = leaves(value)
        elif value is None and spec.is_leaf() and shapes[0] is not None:
            raise InputPresenceError(_layout_error(name, None, d, shapes[0], dynamic))
        else:
            found, got = pytree.tree_flatten_with_path(value)
            if got != spec:
                raise InputError(
                    f"input {name!r} is nested differently from the example ({got} instead "
                    f"of {spec}); pass the same structure (keys, lengths) or compile again "
                    "with an example of this one")
        free = inputs.symbolic.get(name, {})
        for (path, t), want, dtype in zip(found, shapes, held.dtypes):
            if isinstance(want, ExampleValue):  # compared where the graph holds it (check_values)
                if type(t) not in PLAIN:
                    check_value(leaf_name(name, path), t, want)
                continue
            if isinstance(t, torch.Tensor):
                if odd_kind(t):
                    check_kind(leaf_name(name, path), t)
                if fixed and dtype is not None and t.dtype is not dtype:
                    changed.append((leaf_name(name, path), dtype, t.dtype))
            have = _shape(t, d, free)
            if have == want:
                _check_bounds(leaf_name(name, path), t, free)
                continue
            dims = _sizes_differ(have, want)
            if dynamic != "auto" or not dims:
                raise InputError(_layout_error(leaf_name(name, path), t, d, want, dynamic))
            varying.setdefault(name, set()).update(dims)
    if changed:
        raise InputDtypeError(dtype_error(changed))
    return {n: frozenset(ds) for n, ds in varying.items()}


def check_value(name: str, value: Any, want: Any) -> None:
    """A value inside an input is the example's: the graph holds it (export bakes it in;
    a call with another silently ran the example's)."""
    if isinstance(want, ExampleValue) and type(value) is type(want.value) and value == want.value:
        return
    was = repr(want.value) if isinstance(want, ExampleValue) else "a tensor" if want else "None"
    raise InputError(
        f"input {name} is {value!r} where the example passed {was}; a number, flag or "
        "string inside an input is fixed at compile time (the graph holds the example's). "
        "Fix: pass it as a tensor (a 0-dim one is passed whole to every microbatch), keep "
        "it on the model (a change there compiles again), or compile again with this value")


def _sizes_differ(have: Any, want: Any) -> tuple[int, ...]:
    """The non-batch dims whose sizes differ, when nothing else does (same rank)."""
    if have is None or want is None or len(have) != len(want) or not have:
        return ()
    return tuple(i for i, (a, b) in enumerate(zip(have, want)) if a != b)


def _check_bounds(name: str, t: torch.Tensor, free: Mapping[int, Any]) -> None:
    for dim, (low, high) in free.items():
        if dim < t.dim() and ((low is not None and t.shape[dim] < low)
                              or (high is not None and t.shape[dim] > high)):
            raise InputError(
                f"input {name} has size {t.shape[dim]} in dim {dim}, outside the bounds "
                f"{(low, high)} it was compiled for (dynamic=, or the sizes the model's code "
                "holds for, such as its position table's); pad or cut it into them")


def _layout_error(name: str, t: Any, d: int | None, want: tuple[Any, ...] | None,
                  dynamic: Any = False) -> str:
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
    if len(want) != t.dim():
        return (f"input {name} has shape {_shown(_shape(t, d))} but the example had "
                f"{_shown(want)} (B: the batch dim): another number of dims: {fix}")
    how = ("compiled with dynamic=False, which fixes shapes other than the batch dim"
           if dynamic is False else "that dim is not symbolic in dynamic=" + repr(dynamic)
           if dynamic != "auto" else "shapes other than the batch dim are fixed")
    return (f"input {name} has shape {_shown(_shape(t, d))} but the example had "
            f"{_shown(want)} (B: the batch dim); {how}. Fix: compile with dynamic='auto' "
            "(the default: a dim that changes becomes symbolic, once) or name the dim in "
            "dynamic={input: {dim: (min, max)}}; pad every batch to the example's length; "
            f"or {fix}")


def _shown(shape: tuple[Any, ...] | None) -> tuple[int | str, ...]:
    return tuple("B" if s is None else s for s in shape or ())


def check_unchanged(inputs: Inputs, arguments: Mapping[str, Any]) -> None:
    """Raise ``InputError`` where a non-tensor argument of the call is not the example's
    value, or, holding state, not what the example's held at compile time (``cfg.temp =
    0.5`` on the example's ``cfg``: the same object, so ``is`` it still). forward's reads
    of it (``loss * cfg.temp``) are fixed in the graph, so the call is refused before it
    runs."""
    for name, expected in inputs.concrete.items():
        got = arguments[name]
        if got is expected:  # the usual call: the same None, flag or object
            continue
        if has_tensor(got):  # no graph input for it (named by its shape: a repr is big)
            bare = isinstance(got, torch.Tensor)
            what = (f"is a tensor of shape {tuple(got.shape)}" if bare
                    else f"holds tensors ({type(got).__name__})")
            raise (InputPresenceError if bare and expected is None else InputError)(
                f"input {name!r} {what} where the example passed {expected!r}; the graph was "
                "traced without it: pass the same kind of value, or compile again with an "
                "example call like this one")
        if not same_value(got, expected):
            raise InputError(
                f"argument {name!r} was {expected!r} at compile time and is {got!r} now; "
                "non-tensor arguments are fixed when compiling: compile again with the "
                "new value")
    for name, image in inputs.images.items():
        if fingerprint(arguments[name])[0] != image:
            raise InputError(
                f"argument {name!r} changed in place since compile time (what it holds, or "
                "its attributes); forward's reads of a non-tensor argument are fixed when "
                "compiling, so this call would run the old values. Fix: pass the value as a "
                "tensor, keep it on the model (an attribute: a change compiles again), or "
                "compile again; nothing was run")


def same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a truthy == are compared by identity only
        return False


class CallBinder:
    """``signature.bind(*args, **kwargs)`` with the defaults applied, as a dict: a call of
    the compiled module's forward by name. The usual call (positional arguments, a
    signature of plain parameters) is bound in order, without ``inspect``'s walk over the
    parameters (about 10 µs a call)."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        params = list(signature.parameters.values())
        #: (how many parameters have no default, (name, default) of each, their names);
        #: None for ``*args``, ``**kwargs`` or keyword-only parameters
        self.plain: tuple[int, tuple[tuple[str, Any], ...], tuple[str, ...]] | None = None
        if all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            required = sum(1 for p in params if p.default is p.empty)
            self.plain = (required, tuple((p.name, p.default) for p in params),
                          tuple(p.name for p in params))

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Raises ``InputError`` for a call that does not fit the signature."""
        plain = self.plain
        if plain is not None and not kwargs and plain[0] <= len(args) <= len(plain[1]):
            arguments = dict(zip(plain[2], args))
            arguments.update(plain[1][len(args):])  # (no default before a required one)
            return arguments
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise InputError(f"call does not match forward{self.signature}: {exc}") from None
        bound.apply_defaults()
        return dict(bound.arguments)
