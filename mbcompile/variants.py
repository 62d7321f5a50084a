"""What a compiled module does with a call compile() did not see: a variant, made once.

>>> cm = mbcompile.compile(model, gbs=7, num_csx=2, mbs=2, example_inputs=(ids, labels))
>>> cm.eval()(ids[:3], labels[:3])       # BatchSizeWarning: compiled once for 3 samples
>>> sorted(cm._variants)                  # (batch, forward only), or a keyword set
[(3, True)]

A batch of another size (``for_batch``), other keywords through forward's ``**kwargs``
(``for_call``) or another length under ``dynamic="auto"`` (``for_shapes``: the dims that
changed become symbolic, once) is a request derived from the first, sent through compile()'s chain
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

import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from mbcompile.dynamic_shapes import symbolic_reason
from mbcompile.errors import BatchSizeWarning, RecompileWarning
from mbcompile.inputs import Inputs, check_layout, with_keywords
from mbcompile.passes.sources import user_stacklevel
from mbcompile.request import Request

#: the ``CompiledModule`` these functions serve (``compiled_module.py`` imports this module)
CompiledModule = Any

__all__ = ["for_batch", "for_keywords", "for_shapes", "samples"]


def for_keywords(cm: CompiledModule, through: frozenset[str], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> CompiledModule:
    """The module compiled for calls that pass the keywords ``through`` to forward's
    ``**kwargs`` (each is a graph input: ``request.for_call``), compiled once. The call's
    other inputs are checked against the example first, so that an error names the
    user's example, never the shapes of a variant made from an earlier call."""
    variant = cm._variants.get(through)
    if variant is None:
        _check_like_example(cm, args, kwargs)

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


def for_shapes(cm: CompiledModule, varying: Mapping[str, frozenset[int]]) -> CompiledModule:
    """The module compiled with the ``varying`` dims symbolic (``for_shapes``), once: every
    later length runs it."""
    key = ("shapes", frozenset((n, d) for n, dims in varying.items() for d in dims))
    return cm._variants.get(key) or _variant(
        cm, key, cm._request.for_shapes(varying),
        *symbolic_reason(cm._inputs.names, cm._layout, varying))


def _variant(cm: CompiledModule, key: Any, request: Request, why: str,
             category: type[Warning] | None, hint: str) -> CompiledModule:
    """Compile ``request`` (derived from the first: ``for_batch``, ``for_call``) through
    compile()'s chain, once, and keep it under ``key``; one warning of ``category`` says
    ``why`` and what it cost, and ``hint`` how to avoid it (None: a variant the compiler
    expected, ``Recompile.expected_keywords``: none)."""
    start = time.perf_counter()
    compiled = cm._recompile.variant(request)
    object.__setattr__(compiled, "_guesses", cm._guesses)  # the loop's scale, not the graph's
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


def _check_like_example(cm: CompiledModule, args: tuple[Any, ...], kwargs: dict[str, Any]
                        ) -> None:
    """Raise ``InputError`` when the inputs the example had are shaped otherwise in this
    call (the keywords it adds are the variant's own; a length that differs under
    ``dynamic="auto"`` is made symbolic by ``for_call``)."""
    try:
        bound = with_keywords(cm._face_signature, kwargs).bind(*args, **kwargs)
    except TypeError:
        return  # the variant's binding says why, with its signature
    bound.apply_defaults()
    inputs: Inputs = cm._inputs
    shared = [i for i, name in enumerate(inputs.names) if name in bound.arguments]
    names = tuple(inputs.names[i] for i in shared)
    # the symbolic dims too: the example's layout marks them ANY, so without them a call
    # at the example's own length would read as another length
    check_layout(Inputs(names, tuple(inputs.in_dims[i] for i in shared),
                        {n: v for n, v in inputs.concrete.items() if n in names},
                        {n: v for n, v in inputs.symbolic.items() if n in names}),
                 [bound.arguments[n] for n in names], tuple(cm._layout[i] for i in shared),
                 cm._request.options.dynamic)


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def samples(n: int) -> str:
    return f"{n} sample{'s' if n != 1 else ''}"

