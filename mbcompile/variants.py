"""What a compiled module does with a call compile() did not see: a variant, made once.

>>> cm = mbcompile.compile(model, gbs=7, num_csx=2, mbs=2, example_inputs=(ids, labels))
>>> cm.eval()(ids[:3], labels[:3])       # BatchSizeWarning: compiled once for 3 samples
>>> sorted(cm._variants)                  # (batch, forward only), or a keyword set
[(3, True)]

A batch of another size (``for_batch``), other keywords through forward's ``**kwargs``
(``for_call``), another length under ``dynamic="auto"`` (``for_shapes``: the dims that
changed become symbolic, once) or a size of 1 in a symbolic dim (``for_size_one``) is a
request derived from the first, sent through compile()'s chain
(``Recompile.variant``, handed in by the compiler) and kept under its key: the batch size
and whether the call runs a backward (a forward-only call, in eval mode or under
``no_grad``, is planned without probes), or the keyword set. The chain reuses the first
capture and its analysis (``mbcompile/captures.py``), so a new batch size costs a plan
and a lowering: milliseconds. Each is announced once, by a warning that says what it
cost and how to avoid it; the keywords transformers' Trainer adds to a model's call
(``num_items_in_batch``: ``Recompile.expected_keywords``) are compiled without one, on
the same plan.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mbcompile.dynamic_shapes import at_size_one, size_one_dims, symbolic_reason
from mbcompile.errors import BatchSizeWarning, RecompileWarning
from mbcompile.execution.seeding import Guesses
from mbcompile.inputs import (
    InputDtypeError,
    InputPresenceError,
    Inputs,
    batch_size,
    check_layout,
    check_unchanged,
    leaf_name,
    leaves,
    with_keywords,
)
from mbcompile.passes.errors import InputError
from mbcompile.passes.sources import user_stacklevel
from mbcompile.request import Request

#: the ``CompiledModule`` these functions serve (``compiled_module.py`` imports this module)
CompiledModule = Any

__all__ = ["Family", "for_batch", "for_changed", "for_dtypes", "for_global_batch",
           "for_keywords", "for_presence", "for_shapes", "for_size_one", "samples"]


class Family:
    """What a compiled module shares with every variant made from it, handed to each at
    construction (``Recompile.family``): the first module, where calls that leave out an
    input compile (``for_presence``: its request has the example's symbolic dims), and
    the seed guesses of the training loop (``execution/seeding.Guesses``: the gradient
    the caller sends into the loss belongs to the loop, not to one graph)."""

    def __init__(self) -> None:
        self._root: weakref.ref[Any] | None = None  # weak: a module would hold itself
        self.guesses = Guesses()

    @property
    def root(self) -> CompiledModule | None:
        """The first module constructed with it (compile()'s), while it is alive."""
        return None if self._root is None else self._root()

    @root.setter
    def root(self, module: CompiledModule) -> None:
        self._root = weakref.ref(module)

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "guesses": self.guesses}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._root = None if state["root"] is None else weakref.ref(state["root"])
        self.guesses = state["guesses"]


def for_keywords(cm: CompiledModule, through: frozenset[str], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> CompiledModule:
    """The module compiled for calls that pass the keywords ``through`` to forward's
    ``**kwargs`` (each is a graph input: ``request.for_call``), compiled once. The call's
    other inputs are checked against the example first, so that an error names the
    user's example, never the shapes of a variant made from an earlier call."""
    variant = cm._variants.get(through)
    if variant is None:
        if (presence := for_presence(cm, args, kwargs)) is not None:
            return presence  # labels left out too: said, and kept under that key
        _check_like_example(cm, _bound(cm, args, kwargs))

        def listed(names: frozenset[str]) -> str:
            return ", ".join(map(repr, sorted(names))) or "none"

        # only those the Trainer adds, added or (compiled with them) left out
        expected = through ^ cm._keywords <= cm._recompile.expected_keywords
        variant = _variant(
            cm, through, cm._request.for_call(args, kwargs),
            f"a call passes {listed(through)} to {type(cm._inner).__name__}.forward's "
            f"**kwargs, where the example call passed {listed(cm._keywords)}",
            None if expected else RecompileWarning,
            "pass them in example_kwargs to compile them with the model")
    return variant


def for_presence(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> CompiledModule | None:
    """The module compiled for calls that leave out the inputs this one leaves out (None
    where the example passed a tensor: ``labels``, for logits) and pass those it passes
    (a tensor where it passed None), compiled once from this call on the first module's
    request (``request.for_call``; its example's symbolic dims, which a variant made
    without ``labels`` would not have for them). None where the call changes nothing of
    that kind, and where no variant is made: on ranks (each would compile alone) and
    where forward has no default of None for such an input (leaving it out is not a call
    of the model's)."""
    root = cm._recompile.family.root or cm
    arguments = _bound(root, args, kwargs)
    flips = _flips(root, arguments) if arguments is not None and cm.rank is None else None
    if not flips:
        return None
    absent = frozenset(n for n in root._inputs.names if n in arguments and arguments[n] is None)
    key = ("absent", absent, frozenset(kwargs) - set(root._named or kwargs))
    variant = root._variants.get(key)
    if variant is None:
        _check_like_example(root, arguments)
        said = [f"None for {n!r} where the example passed a tensor" if arguments[n] is None
                else f"a tensor for {n!r} where the example passed None" for n in sorted(flips)]
        variant = _variant(root, key, root._request.for_call(args, kwargs),
                           f"a call passes {' and '.join(said)}", RecompileWarning,
                           "an example call like it compiles it with the model")
    return variant


def for_changed(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any],
                error: InputPresenceError) -> CompiledModule | None:
    """The module compiled for a call the module's checks refused with ``error``: an input
    of another dtype (``for_dtypes``), or left out or given (``for_presence``); None where
    none is made (then ``error`` stands)."""
    if isinstance(error, InputDtypeError):
        return for_dtypes(cm, args, kwargs)
    return for_presence(cm, args, kwargs)


def for_dtypes(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> CompiledModule | None:
    """The module compiled for calls whose tensor inputs have the dtypes this call's have,
    where ``cm``'s graph holds the example's (torch.export: ``input_kinds.Structure``),
    compiled once from this call (``request.for_call``: captured again, since the capture's
    key holds the dtypes); None on ranks, where each rank would compile alone."""
    if cm.rank is not None:
        return None
    arguments = cm._binder.bind(args, kwargs)
    found = [(n, path, t.dtype, was)  # (input, leaf, the call's dtype, the example's)
             for n, (held, _) in zip(cm._inputs.names, cm._layout)
             for (path, t), was in zip(leaves(arguments[n]), held.dtypes)
             if isinstance(t, torch.Tensor)]
    key = ("dtypes", tuple(now for _, _, now, _ in found))
    variant = cm._variants.get(key)
    if variant is None:
        said = ", ".join(f"{now} for input {leaf_name(n, path)} where the example passed "
                         f"{was}" for n, path, now, was in found
                         if was is not None and now is not was)
        variant = _variant(
            cm, key, cm._request.for_call(args, kwargs),
            f"a call passes {said}, and the graph torch.export captured holds the example's "
            "dtypes", RecompileWarning, "an input cast to the example's dtype runs the first "
            "graph; an example call of these dtypes compiles them with the model")
    return variant


def for_batch(cm: CompiledModule, batch: int, arguments: Mapping[str, Any]) -> CompiledModule:
    """The module compiled for batches of ``batch`` samples, one for calls that train and
    one for forward-only calls (eval mode or ``no_grad``: planned without probes)."""
    forward_only = not (torch.is_grad_enabled() and cm._inner.training)
    key = (batch, forward_only)
    return cm._variants.get(key) or _variant(
        cm, key, cm._request.for_batch(batch, arguments, forward_only),
        f"a batch of {samples(batch)}, where {type(cm.module).__name__} was compiled "
        f"for gbs={cm.plan.gbs}", BatchSizeWarning,
        "compile(..., batch_sizes='fixed') makes another batch size an error")


def for_global_batch(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> CompiledModule:
    """On ranks, the module that runs a global batch (``args``, ``kwargs``) that every rank
    holds, as the Trainer does; it then cuts the rank's share by that module's ``plan``
    (``cm.plan`` shows it too). ``cm`` for ``gbs`` samples. For another size (the epoch's
    short last batch, a smaller validation batch), the variant one process runs
    (``for_batch``, after ``for_shapes`` where the length changed, as ``forward`` derives
    it): planned for that many samples over the same ranks (5 on 2 ranks: shares of 3 and
    2), its counts the global batch's, reduced over the ranks as for ``gbs``. Every rank
    holds the same batch, so every rank compiles the same variant, or raises the same
    ``InputError`` before anything runs: fewer samples than ranks (a rank without a
    sample), or ``batch_sizes="fixed"``."""
    object.__setattr__(cm, "_ran", None)
    arguments = cm._binder.bind(args, kwargs)
    values = [arguments[n] for n in cm._inputs.names]
    batch, plan = batch_size(cm._inputs, values, empty=cm.rank is not None), cm._selection.plan
    if batch is None or batch == plan.gbs:
        return cm
    if cm._request.options.batch_sizes == "fixed" or batch < plan.num_csx:
        fixed = cm._request.options.batch_sizes == "fixed"
        raise InputError(
            f"a global batch of {samples(batch)} on {plan.num_csx} ranks, where the module was "
            f"compiled for gbs={plan.gbs}" + (
                " with batch_sizes='fixed': pass batches of gbs samples, or compile with "
                "batch_sizes='any'" if fixed else
                f": rank {batch} would have no sample; every rank trains a share of at least "
                f"one: drop the short last batch (DataLoader(..., drop_last=True)) or batch at "
                f"least {plan.num_csx} samples") + "; nothing ran, on any rank")
    varying = check_layout(cm._inputs, values, cm._layout, cm._request.options.dynamic)
    module = for_shapes(cm, varying) if varying else cm
    return cm._runs(for_batch(module, batch, arguments))


def for_shapes(cm: CompiledModule, varying: Mapping[str, frozenset[int]]) -> CompiledModule:
    """The module compiled with the ``varying`` dims symbolic (``for_shapes``), once: every
    later length runs it."""
    key = ("shapes", frozenset((n, d) for n, dims in varying.items() for d in dims))
    return cm._variants.get(key) or _variant(
        cm, key, cm._request.for_shapes(varying),
        *symbolic_reason(cm._inputs.names, cm._layout, varying))


def for_size_one(cm: CompiledModule, values: Sequence[Any]) -> CompiledModule | None:
    """For a call (its inputs ``values``) with size 1 in a dim ``cm`` compiled symbolic
    (``size_one_dims``: a symbolic size is 2 or more), the module compiled with that dim
    fixed at 1, once; None for any other call."""
    ones = size_one_dims(cm._inputs.symbolic, cm._inputs.names, values)
    if not ones:
        return None
    key = ("size one", frozenset((n, d) for n, dims in ones.items() for d in dims))
    dims = ", ".join(f"{n!r} dim {d}" for n, ds in ones.items() for d in sorted(ds))
    return cm._variants.get(key) or _variant(
        cm, key, at_size_one(cm._request, ones),
        f"a call has size 1 in {dims}, which {type(cm.module).__name__} was compiled with "
        "symbolic (a symbolic size is 2 or more, as torch.export's: code may set 1 apart)",
        RecompileWarning, "pad such calls to 2 tokens (pad_to_multiple_of=2) to run them on "
        "the symbolic step")


def _variant(cm: CompiledModule, key: Any, request: Request, why: str,
             category: type[Warning] | None, hint: str) -> CompiledModule:
    """Compile ``request`` (derived from the first: ``for_batch``, ``for_call``) through
    compile()'s chain, once, and keep it under ``key``; one warning of ``category`` says
    ``why`` and what it cost, and ``hint`` how to avoid it (None: a variant the compiler
    expected, ``Recompile.expected_keywords``: none)."""
    start = time.perf_counter()
    compiled = cm._recompile.variant(request)
    cm._variants[key] = compiled
    if category is None:
        return compiled
    plan = compiled.plan
    systems = plan.num_csx
    warnings.warn(
        f"{why}: planned and compiled once for it ({samples(plan.gbs)} on {systems} "
        f"system{'s' if systems > 1 else ''}, mbs={plan.mbs}, {plan.num_microbatches} "
        f"microbatch{'es' if plan.num_microbatches > 1 else ''} per system"
        f"{', forward only' if request.forward_only else ''}) in "
        f"{_duration(time.perf_counter() - start)}, and kept for later calls like it "
        f"({hint})", category, stacklevel=user_stacklevel())
    return compiled


def _check_like_example(cm: CompiledModule, arguments: dict[str, Any] | None) -> None:
    """Raise ``InputError`` when the inputs the example had are shaped otherwise in the
    call bound as ``arguments`` (``_bound``), or its non-tensor arguments differ (the
    keywords it adds are the variant's own, so are the inputs it leaves out or adds where
    ``for_presence`` compiles for them; a length that differs under ``dynamic="auto"`` is
    made symbolic by ``for_call``)."""
    if arguments is None:
        return  # the variant's binding says why, with its signature
    inputs: Inputs = cm._inputs
    own = _flips(cm, arguments) if cm.rank is None else frozenset()
    shared = [i for i, name in enumerate(inputs.names)
              if name in arguments and name not in own]
    names = tuple(inputs.names[i] for i in shared)
    concrete = {n: v for n, v in inputs.concrete.items() if n in names}
    check_unchanged(dataclasses.replace(inputs, concrete=concrete, images={
        n: image for n, image in inputs.images.items() if n in concrete}), arguments)
    # the symbolic dims too: the example's layout marks them ANY, so without them a call
    # at the example's own length would read as another length
    check_layout(Inputs(names, tuple(inputs.in_dims[i] for i in shared), concrete,
                        {n: v for n, v in inputs.symbolic.items() if n in names}),
                 [arguments[n] for n in names], tuple(cm._layout[i] for i in shared),
                 cm._request.options.dynamic, dtypes=False)  # the variant's example: its own


def _flips(cm: CompiledModule, arguments: Mapping[str, Any]) -> frozenset[str]:
    """The inputs the call leaves None where the example passed a tensor or passes a
    tensor where it passed None, where forward's default for each is None (it may be
    called without them); empty where one has another default (no call of the model's)."""
    example = cm._request.example

    def flipped(name: str) -> bool:
        now, was = arguments[name], example.get(name)
        return (now is None and isinstance(was, torch.Tensor)) or (
            was is None and isinstance(now, torch.Tensor))

    flips = frozenset(n for n in cm._inputs.names if n in arguments and flipped(n))
    params = cm._face_signature.parameters
    return flips if all(n in params and params[n].default is None for n in flips) \
        else frozenset()


def _bound(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> dict[str, Any] | None:
    """The call bound to forward's signature with its keywords, defaults applied; None
    where it does not fit."""
    try:
        bound = with_keywords(cm._face_signature, kwargs).bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def samples(n: int) -> str:
    return f"{n} sample{'s' if n != 1 else ''}"

