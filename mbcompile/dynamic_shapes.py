"""Dims that vary between calls: which are symbolic, and the proof that the step is one.

>>> symbolic_dims({"input_ids": {1: (1, 512)}}, names, in_dims, example)
{'input_ids': {1: (1, 512)}}
>>> symbolic_dims(True, names, in_dims, example)  # every non-batch dim of a batched tensor
{'input_ids': {1: (None, None)}, 'labels': {1: (None, None)}}

``compile(..., dynamic=...)`` says which non-batch dims may change between calls
(``"auto"``: none until a call changes one, then that one, once; ``True``: all;
``False``: none; a dict: those, with bounds). A symbolic dim is captured symbolic
(torch.export's ``Dim.DYNAMIC``; a torch.fx trace reads sizes off the tensors already),
and ``checked_symbolic`` proves the compiled step does not depend on its value: the
request goes through the chain again at other lengths (``Request.at_other_lengths``) on
the same capture (its shapes, batch facts and rewrite found again: ``at_other_sizes``;
the capture itself holds for every size its guards admit, checked here), and the two
rewritten programs must be the same program, code, side effects and all.
A model that bakes a length in (a size read off the input used as a number after the
loop, a random draw shaped by it, a Python loop over it) lowers differently at the two
lengths, or fails at one of them: refused with an ``InputError`` that names the padding
fix, before anything ran. Code that holds for some sizes only (a position table of 16
rows, a branch on the length), which torch.export's guards record, bounds the dim to
those sizes, checked on every call; a guard no bound expresses (``n != 16``, ``n % 8 ==
0``) is refused.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from mbcompile.errors import ArgumentTypeError, InputError, MbcompileError, RecompileWarning

__all__ = ["Bounds", "PAD_FIX", "Symbolic", "at_size_one", "checked_symbolic", "length_step",
           "off_one", "resized", "size_one_dims", "symbolic_dims", "symbolic_reason"]

Bounds = tuple[int | None, int | None]  # inclusive (min, max); None: unbounded
Symbolic = Mapping[str, Mapping[int, Bounds]]  # input name -> its symbolic dims

#: What a refusal of a varying dim says to do.
PAD_FIX = ("pad every batch to the same length (the tokenizer's padding='max_length'; or "
           "pad_to_multiple_of= in the collator where the model needs a multiple of some size) "
           "and compile with dynamic=False, which fixes every shape but the batch dim "
           "(compile again for another shape)")


def symbolic_dims(option: Any, names: Sequence[str], in_dims: Sequence[int | None],
                  values: Mapping[str, Any]) -> dict[str, dict[int, Bounds]]:
    """The dims ``dynamic=option`` makes symbolic from the start, by input name: none for
    ``"auto"`` and ``False``, every non-batch dim of a batched tensor input for ``True``,
    the dims a dict names (``{"input_ids": {1: (1, 512)}}``, ``{"input_ids": [1]}``,
    ``{"input_ids": 1}``), with their bounds."""
    if option == "auto" or option is False:
        return {}
    batched = {n: d for n, d in zip(names, in_dims) if d is not None}
    if option is True:
        return {n: {i: (None, None) for i in range(_ndim(values[n])) if i != d}
                for n, d in batched.items() if _ndim(values[n]) > 1}
    if not isinstance(option, Mapping):
        raise ArgumentTypeError(f"dynamic must be 'auto', True, False or a dict "
                                f"{{input: {{dim: (min, max)}}}}, got {option!r}")
    out: dict[str, dict[int, Bounds]] = {}
    for name, dims in option.items():
        if name not in batched:
            known = ", ".join(map(repr, batched)) or "none"
            raise InputError(f"dynamic names {name!r}, which is not a batched tensor input of "
                             f"forward (those are {known}); use forward's parameter names")
        out[name] = {}
        spec = dims if isinstance(dims, Mapping) else dict.fromkeys(
            [dims] if isinstance(dims, int) else dims)
        for dim, bounds in spec.items():
            out[name][_checked_dim(name, dim, batched[name], _ndim(values[name]))] = \
                _checked_bounds(name, dim, bounds, values[name])
    return out


def _ndim(value: Any) -> int:
    return max((t.dim() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)),
               default=0)


def _checked_dim(name: str, dim: Any, batch: int, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < ndim:
        raise InputError(f"dynamic gives input {name!r} dim {dim!r}, but its dims are "
                         f"0..{ndim - 1}; give a non-negative int below {ndim}")
    if dim == batch:
        raise InputError(f"dynamic gives input {name!r} dim {dim}, its batch dim, which is "
                         "symbolic already; give the other dims that vary (the length)")
    return dim


def _checked_bounds(name: str, dim: int, bounds: Any, value: Any) -> Bounds:
    if bounds is None:
        return (None, None)
    ok = (isinstance(bounds, (tuple, list)) and len(bounds) == 2
          and all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 1)
                  for b in bounds))
    if not ok:
        raise ArgumentTypeError(f"dynamic's bounds for input {name!r} dim {dim} must be None "
                                f"or (min, max) of positive ints or None, got {bounds!r}")
    low, high = bounds
    sizes = {t.shape[dim] for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)
             and t.dim() > dim}
    if any((low is not None and s < low) or (high is not None and s > high) for s in sizes):
        raise InputError(f"dynamic bounds input {name!r} dim {dim} to {tuple(bounds)}, but the "
                         f"example has {sorted(sizes)[0]} there; give bounds that hold it")
    return (low, high)


def length_step(sizes: Sequence[tuple[int, Bounds]]) -> int:
    """How far the symbolic dims (``(example size, bounds)`` each) move for the second
    length they are judged at: one step for all, so that dims the model needs equal (the
    ids' and the labels' length) stay equal; a few more (``T // 2`` and ``T % 2`` change
    with it), or fewer where the bounds end."""
    for step in (3, -3, 1, -1):
        if all(size + step >= max(low or 2, 2) and (high is None or size + step <= high)
               for size, (low, high) in sizes):
            return step
    return 0


def resized(value: Any, dims: Mapping[int, Bounds], step: int) -> Any:
    """``value`` with each symbolic dim ``step`` longer: its last slice repeated (token ids,
    labels and masks stay valid values), or the tensor cut shorter."""
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        for dim in dims:
            if dim >= t.dim():
                continue
            size = t.shape[dim]
            if step > 0:
                t = torch.cat([t, t.narrow(dim, size - 1, 1).expand(
                    *t.shape[:dim], step, *t.shape[dim + 1:])], dim)
            else:
                t = t.narrow(dim, 0, size + step).contiguous()
        return t

    return pytree.tree_map(one, value)


def size_one_dims(symbolic: Symbolic, names: Sequence[str], values: Sequence[Any]
                  ) -> dict[str, frozenset[int]]:
    """The symbolic dims that have size 1 in a call (``values``, by ``names``), by input.

    A symbolic size is 2 or more, as torch.export's and torch.compile's are: code that sets
    1 apart (a branch on ``T > 1``, ``squeeze()``, broadcasting) is traced for sizes of 2
    and more, so a call of size 1 runs a step compiled with that dim fixed at 1
    (``at_size_one``), once."""
    ones: dict[str, frozenset[int]] = {}
    for name, value in zip(names, values):
        dims = symbolic.get(name)
        if dims:  # (every call of a module with a symbolic dim: a tensor is not walked)
            leaves = (value,) if isinstance(value, torch.Tensor) else pytree.tree_leaves(value)
            found = {d for t in leaves if isinstance(t, torch.Tensor)
                     for d in dims if d < t.dim() and t.shape[d] == 1}
            if found:
                ones[name] = frozenset(found)
    return ones


def at_size_one(request: Any, ones: Mapping[str, frozenset[int]]) -> Any:
    """``request`` (a ``Request``) with the dims ``ones`` names fixed at size 1: not
    symbolic, its example cut to their first slice."""
    def first(dims: frozenset[int]) -> Callable[[Any], Any]:
        def one(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                for d in dims:
                    t = t.narrow(d, 0, 1).contiguous() if d < t.dim() else t
            return t
        return one

    example = {n: pytree.tree_map(first(ones[n]), v) if n in ones else v
               for n, v in request.example.items()}
    symbolic = {n: {d: b for d, b in ds.items() if d not in ones.get(n, ())}
                for n, ds in request.inputs.symbolic.items()}
    inputs = dataclasses.replace(request.inputs, symbolic={n: ds for n, ds in symbolic.items()
                                                           if ds})
    return dataclasses.replace(request, example=example, inputs=inputs)


def off_one(example: Mapping[str, Any], symbolic: Symbolic) -> dict[str, Any]:
    """``example`` with each symbolic dim of size 1 made longer (its last slice repeated):
    torch.export cannot capture a dim of size 1 symbolic (it fixes sizes 0 and 1)."""
    ones = size_one_dims(symbolic, list(example), list(example.values()))
    if not ones:
        return dict(example)
    step = length_step([(1, symbolic[n][d]) for n, ds in ones.items() for d in ds])
    return {n: resized(v, dict.fromkeys(ones[n]), step) if n in ones else v
            for n, v in example.items()}


def checked_symbolic(request: Any, lowered: Any, relower: Callable[[Any], Any],
                     adopt: bool = True) -> Any:
    """``request`` (a ``Request``), whose step is ``lowered``, with each symbolic dim bounded
    to the sizes the captured code holds for, once the step is proved the same program at
    another length (``relower(request.at_other_lengths())``); raises ``InputError`` else.

    torch.export's guards narrow a dim to what the code holds for (BERT's position table
    holds 16 positions: sizes 2 to 16): a dim the request left unbounded takes those bounds
    (checked on every call), one whose bounds ask for more is refused, as is any
    narrowing when ``adopt`` is False (a graph lowered again for another mode).
    """
    symbolic = request.inputs.symbolic
    if not symbolic:
        return request
    dims = ", ".join(f"{n!r} dim {d}" for n, ds in symbolic.items() for d in ds)
    bounded = {n: dict(ds) for n, ds in symbolic.items()}
    for (name, dim), (lower, upper) in _held(symbolic, lowered.original_graph_module).items():
        low, high = symbolic[name][dim]
        raise_low = lower is not None and lower > max(low or 2, 2)
        cut_high = upper is not None and (high is None or upper < high)
        if not (raise_low or cut_high):
            continue
        if not adopt or low is not None or high is not None:
            span = (max(lower or 2, 2), upper)
            raise InputError(_refusal(request.name, dims, f"the captured code only holds for "
                                      f"sizes {_span(*span)} of {name!r} dim {dim} (a branch "
                                      f"or a check on it), where dynamic= asks for "
                                      f"{_span(low or 1, high)}; give bounds it holds, "
                                      f"dynamic={{{name!r}: {{{dim}: {span}}}}}"))
        bounded[name][dim] = (lower if raise_low else low, upper if cut_high else high)
    unkept = _unkept_guard(symbolic, lowered.original_graph_module)
    if unkept is not None:
        raise InputError(_refusal(request.name, dims, f"the captured code only holds where "
                                  f"{unkept} (torch.export's guard on the sizes, which a "
                                  "call cannot be checked against)", images=any(
                                      len(ds) > 1 for ds in symbolic.values())))
    if bounded != symbolic:
        request = dataclasses.replace(request, inputs=dataclasses.replace(
            request.inputs, symbolic=bounded))
    try:
        other = relower(request.at_other_lengths())
    except MbcompileError as exc:
        raise InputError(_refusal(request.name, dims, f"at another length it cannot be "
                                  f"compiled: {exc}")) from exc
    first, second = _program(lowered), _program(other)
    if first != second:
        raise InputError(_refusal(request.name, dims, "the compiled step is not the same "
                                  f"program at two lengths: {_difference(first, second)}"))
    return request


def _span(low: int, high: int | None) -> str:
    return f"{low} and more" if high is None else f"{low} to {high}"


def symbolic_reason(names: Sequence[str], layout: Sequence[Any],
                    varying: Mapping[str, Any]) -> tuple[str, type[Warning], str]:
    """What the warning of a module made symbolic for a call says (``CompiledModule``):
    why, naming the example's own shapes (``layout``: ``input_layout``), and the hint."""
    dims = ", ".join(f"{n!r} dim {d}" for n, ds in varying.items() for d in sorted(ds))
    shown = ", ".join(f"{n!r} {tuple('B' if s is None else s for s in shapes[0])}"
                      for n, (_, shapes) in zip(names, layout)
                      if n in varying and shapes and shapes[0])
    return (f"a call changes the size of {dims} (the example: {shown}), so that dim becomes "
            "symbolic: one step for every size", RecompileWarning,
            "dynamic=True or dynamic={input: {dim: (min, max)}} makes it symbolic from the "
            "start; dynamic=False makes it an error")


def _held(symbolic: Symbolic, gm: fx.GraphModule) -> dict[tuple[str, int], tuple[Any, Any]]:
    """The sizes each symbolic dim's symbol holds for in torch.export's trace (its guards,
    which mbcompile does not keep: ``if n > 4`` holds from 5): (input, dim) -> (lowest,
    highest), None where unbounded; dims a torch.fx trace captured hold for every size."""
    held = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if node.target not in symbolic or not isinstance(val, torch.Tensor):
            continue
        for dim in symbolic[node.target]:
            size = val.shape[dim] if dim < val.dim() else None
            if isinstance(size, torch.SymInt):
                bounds = size.node.shape_env.bound_sympy(size.node.expr)
                held[(str(node.target), dim)] = (_int_or_none(bounds.lower),
                                                 _int_or_none(bounds.upper))
    return held


def _unkept_guard(symbolic: Symbolic, gm: fx.GraphModule) -> str | None:
    """A guard of torch.export's trace on a symbolic dim that is neither a range (kept as
    bounds) nor an equality of sizes (the ids' and the labels' lengths), said in words: a
    size computed from the dims equal to a constant first (a branch the example's size took:
    ViT's ``num_patches == num_positions`` holds only at its config's ``image_size``), then a
    size unequal to a constant (``if n != 16``), a divisibility by a constant (``n % 8 ==
    0``). None where every guard is of the kept kinds."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod, PythonMod

    ours, env = set(), None
    for node in gm.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if node.target in symbolic and isinstance(val, torch.Tensor):
            for dim in symbolic[node.target]:
                size = val.shape[dim] if dim < val.dim() else None
                if isinstance(size, torch.SymInt):
                    ours |= size.node.expr.free_symbols
                    env = size.node.shape_env
    guards = [g.expr for g in (env.guards if env is not None else ())
              if g.expr.free_symbols & ours]
    for expr in guards:  # a branch taken at the example's size: the guard to name
        if isinstance(expr, sympy.Eq) and any(isinstance(side, sympy.Integer) and side != 0
                                              for side in expr.args):  # not a divisibility
            size, value = sorted(expr.args, key=lambda side: isinstance(side, sympy.Integer))
            return (f"{size} == {value}, a branch taken at the example's size (a size "
                    "compared with a constant, as ViT's num_patches == num_positions is at "
                    "its config's image_size)")
    for expr in guards:
        by_constant = any(isinstance(d, sympy.Integer) and abs(int(d)) > 1
                          for m in expr.atoms(Mod, PythonMod, FloorDiv) for d in m.args[1:])
        if (isinstance(expr, sympy.Ne) or expr.has(sympy.Ne) or by_constant) \
                and not _implied(env, expr):
            return str(expr)
    return None


def _implied(env: Any, expr: Any) -> bool:
    """Whether the sizes' ranges (kept as bounds) imply the guard: T5's ``labels`` length
    ``!= 2`` where its range starts at 3."""
    import sympy

    try:
        return env._maybe_evaluate_static(expr, axioms=()) is sympy.true
    except Exception:  # noqa: BLE001 - a private helper of torch's: unknown means not implied
        return False


def _int_or_none(bound: Any) -> int | None:
    """A sympy bound as an int; None for an infinite one (sympy's and torch's ``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError):
        return None


def _refusal(model: str, dims: str, why: str, images: bool = False) -> str:
    """``images``: two dims of one input vary (an image's height and width)."""
    fix = PAD_FIX if not images else (
        "resize every batch to one image size (the model's image_size) and compile with "
        "dynamic=False, which fixes every shape but the batch dim; for images of several "
        "sizes, compile one module per size (dynamic=False, an example of that size)")
    return (f"{model} cannot run one compiled step for every size of {dims}: {why}.\n"
            "  The model bakes a length in (a size read off an input used as a number, a "
            "table sliced to a fixed length, a branch or a reshape that needs one size).\n"
            f"  Fix: {fix}")


def _program(lowered: Any) -> tuple[Any, ...]:
    """What a lowered step runs: the code of each of its graphs (the top graph, the body,
    the coupled part), and the side effects it replays."""
    codes = tuple((name, m.code) for name, m in lowered.graph_module.named_modules()
                  if isinstance(m, fx.GraphModule))
    return codes, repr(lowered.effects.records)


def _difference(first: tuple[Any, ...], second: tuple[Any, ...]) -> str:
    """The first line that differs, as the example's length and the other one have it."""
    def lines(program: tuple[Any, ...]) -> list[str]:
        return [*"\n".join(f"{n}: {c}" for n, c in program[0]).splitlines(), program[1]]

    changed = [line[2:].strip() for line in difflib.ndiff(lines(first), lines(second))
               if line[:1] in "-+"]
    if len(changed) < 2:
        return "their side effects differ"
    return f"`{changed[0]}` at the example's length, `{changed[1]}` at another"
