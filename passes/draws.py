"""Random draws made once per step, at the full batch, before the microbatch loop.

A draw whose arguments read no sample's data (only sizes, dtypes, constants, the model's
own generator) is what eager draws once for the whole batch: ``torch.randn(h.shape,
generator=self.g)``, ``torch.rand(B, 1)``, ``torch.randperm(B)``, a batch-free
``torch.randn(4)``. Drawn per microbatch it would give other numbers (CPU's ``randn``
fills 16 values at a time, so even the stream differs), advance a generator once per
microbatch, and be drawn again where the coupled part or the tail reads it. So the
rewrite draws it once, in graph order, before the loop, exactly as eager does, and hands
it to the body like an input (split along its batch dim, or whole when it is batch-free)
and to the coupled part like an input (a per-sample draw joined from its pieces: the
same tensor).

Before (the body)::

    noise = torch.randn(size, generator=_opaque_obj0)      # per microbatch
    add = h + noise

After (top graph, then the body)::

    randn = torch.randn((7, 4), generator=_opaque_obj0)   # once, the full batch
    microbatches = split(x, y, randn, slices=..., in_dims=(0, 0, 0))
    # body(x, y, randn): add = h + randn

An in-place fill of a tensor made by ``h.new_empty(size)`` (or ``new_zeros``, ``new_ones``,
``new_full``: ``h.new_empty(h.shape).normal_(generator=self.g)``) reads no sample's data
either: such a factory reads only ``h``'s dtype and device. It is made before the loop at
the full batch from a stand-in of ``h`` (an empty tensor of its dtype on the batched input's
device), and filled there.

Draws that read the samples (dropout, ``bernoulli(p)``, ``randn_like(h)`` under fx) stay
where they are: drawn per microbatch, and carried from the body to the coupled part as
any per-sample value (``coupling.py``), never drawn twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError
from .facts import FACT, SHAPES, Batched, Coupled, Free, ValueInfo
from .fx_writes import aliases
from .graph_walks import ancestors, descendants
from .rules import node_name
from .sources import source_line
from .state_updates import mutates

__all__ = ["RANDOM_OPS", "emit_draws", "hoisted_draws", "is_draw", "merged_back"]

#: the ops that draw from a generator (functions, methods, in-place fills, ATen spellings)
RANDOM_OPS = frozenset({
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
    "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_", "random_",
    "exponential_", "cauchy_", "log_normal_", "geometric_", "uniform", "random", "exponential",
    "cauchy", "log_normal", "geometric", "native_dropout", "dropout", "dropout_",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
    "rrelu", "rrelu_with_noise", "gumbel_softmax", "normal_functional",
    # torch.distributions' samplers: Gamma, Beta and Dirichlet, Binomial
    "_standard_gamma", "_sample_dirichlet", "binomial"})


def is_draw(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (a layer that draws, ``nn.Dropout``, is a
    ``call_module`` and reads its input: it is never hoisted)."""
    return node.op in ("call_function", "call_method") and node_name(node) in RANDOM_OPS


def _is_data(n: fx.Node) -> bool:
    """A tensor (or a tuple holding one): a value that may carry samples' data. Sizes,
    shapes, dtypes and devices do not."""
    info = n.meta.get(SHAPES)
    if isinstance(info, ValueInfo):
        return info.is_tensor
    if isinstance(info, tuple):
        return any(isinstance(i, ValueInfo) and i.is_tensor for i in info)
    return n.op == "placeholder"


#: factories whose tensor argument gives only the dtype and device (``h.new_empty(size)``)
_NEW_FACTORIES = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})
#: factories that also take its shape and strides (``torch.empty_like(h)``)
_LIKE_FACTORIES = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})


def _reads_only_metadata(n: fx.Node) -> bool:
    """``h.new_empty(size)`` and kin: a tensor with no sample's data, though made from ``h``
    (none of its other arguments is a tensor)."""
    return (n.op in ("call_function", "call_method") and node_name(n) in _NEW_FACTORIES
            and bool(n.args) and not any(_is_data(a) for a in n.all_input_nodes
                                         if a is not n.args[0]))


def _carries_data(n: fx.Node) -> bool:
    """What the walk from the samples passes: tensors, but not past a factory of new ones."""
    return _is_data(n) and not _reads_only_metadata(n)


def _made_at_full_batch(n: fx.Node, reached: set[fx.Node]) -> bool:
    """A value the top graph makes at the full batch: a size read off a batched tensor, or a
    factory that reads only a batched tensor's dtype and device."""
    return n in reached and (_as_constant(n) or _reads_only_metadata(n))


def _needed(draws: Sequence[fx.Node], reached: set[fx.Node]) -> set[fx.Node]:
    """What ``draws`` are computed from, not past what the top graph makes at the full
    batch; a factory's own arguments but its tensor (its sizes) are needed too."""

    def through(a: fx.Node) -> bool:
        return not _made_at_full_batch(a, reached)

    needed = ancestors(draws, through=through)
    factories = [a for a in needed if a in reached and _reads_only_metadata(a)]
    for f in factories:
        needed |= ancestors([a for a in f.all_input_nodes if a is not f.args[0]],
                            through=through)
    return needed


def _batched_inputs(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"
            and not isinstance(n.meta.get(FACT), Free)]


def _as_constant(n: fx.Node) -> bool:
    """A number, shape or dtype read off a batched tensor: evaluated at the full batch."""
    info = n.meta.get(SHAPES)
    if isinstance(info, ValueInfo) and not info.is_tensor:
        return isinstance(info.int_a, (int, float))
    if isinstance(info, tuple) and info:
        return all(isinstance(i, ValueInfo) and not i.is_tensor
                   and isinstance(i.int_a, int) for i in info)
    return n.op == "call_function" and n.target is getattr and n.args[1] in ("dtype", "device")


def hoisted_draws(graph: fx.Graph) -> list[fx.Node]:
    """The draws to make once, before the loop, in graph order: those whose arguments read
    no sample's data, per-sample along a whole batch dim (or batch-free, or only read by
    the coupled part), computable from the graph's unbatched inputs, attributes and the
    full batch's sizes."""
    sources = _batched_inputs(graph)
    # what a batched input's data reaches: through tensors only (a size carries no data)
    reached = descendants(sources, through=_carries_data)
    _refuse_generator_fills_of_likes(graph, sources, reached)
    out = []
    for n in graph.nodes:
        if not is_draw(n) or (n in reached and _is_data(n)):
            continue
        fact = n.meta.get(FACT)
        if isinstance(fact, Batched) and not (fact.major and not fact.positions):
            continue  # its pieces are not rows of the batch: drawn where it is
        if not isinstance(fact, (Batched, Free, Coupled)):
            continue
        if all(a not in reached or a.op == "placeholder" and a not in sources
               or _made_at_full_batch(a, reached) for a in _needed([n], reached) - {n}):
            if isinstance(fact, Free):  # (a batched one: each body writes its own rows)
                _written_refused(n)
            out.append(n)
    return out


def _written_refused(draw: fx.Node) -> None:
    """Refuse a batch-free draw to hoist that a later op writes in place (torchvision's
    ``stochastic_depth(mode="batch")``: ``noise.div_(keep)``): made once before the loop, it
    is one tensor every microbatch's body would write again (divided 2, 4, 8 times; found
    by a hunt). torch.export's graphs write nothing in place, so only fx's meets it."""
    seen, todo = {draw}, [draw]
    while todo:
        for user in todo.pop().users:
            if mutates(user) and user.args and user.args[0] in seen:
                raise CaptureError(
                    f"a random draw made once per step is written in place at "
                    f"{source_line(user)}; made before the microbatch loop, every microbatch "
                    "would write it again. Fix: write it out of place (noise = noise / keep), "
                    "or compile with capture='auto' or capture='export'")
            if user not in seen and aliases(user):  # a view of it: a write writes the draw
                seen.add(user)
                todo.append(user)


def _refuse_generator_fills_of_likes(graph: fx.Graph, sources: Sequence[fx.Node],
                                     reached: set[fx.Node]) -> None:
    """``torch.empty_like(h).normal_(generator=self.g)`` reads no sample's data, so eager's
    numbers are due, from a model-owned generator advanced once; but the fill's values
    depend on the strides ``h`` has at the full batch, which the graph does not record, so
    it cannot be drawn before the loop. Drawn per microbatch it would differ from eager, and
    so would the generator: refused. (From torch's global generator, like ``randn_like(h)``,
    it is a draw per microbatch: the documented difference.)"""
    past_likes = descendants(sources, through=lambda n: _carries_data(n) and not (
        n.op in ("call_function", "call_method") and node_name(n) in _LIKE_FACTORIES))
    for n in graph.nodes:
        if (is_draw(n) and isinstance(n.kwargs.get("generator"), fx.Node) and n in reached
                and n not in past_likes):
            raise CaptureError(
                f"a random fill of a tensor made like a batched one, from a generator of the "
                f"model (torch.empty_like(h).normal_(generator=g)), at {source_line(n)}: "
                "eager draws it once for the whole batch, and its numbers depend on h's "
                "strides there, so drawn per microbatch it would give other numbers and "
                "advance the generator more than once. Fix: draw it from the shape, "
                "h.new_empty(h.shape).normal_(generator=g) or torch.randn(h.shape, "
                "generator=g, dtype=h.dtype), which mbcompile draws once per step as eager "
                "does")


def emit_draws(graph: fx.Graph, env: dict[fx.Node, Any], draws: Sequence[fx.Node],
               batch: int, rows: tuple[int, int] | None = None) -> dict[fx.Node, Any]:
    """The ``draws`` and what they need into ``graph`` (``env`` maps the source graph's
    placeholders already there): sizes read off batched tensors become their value at
    ``batch`` samples, a device read off one is the batched input's device. Returns what
    the body reads of each draw: the draw, or with ``rows`` (this process's samples of the
    global ``batch``, a rank's share) a per-sample draw's own rows.

    On ranks every rank draws the whole global batch, from generators that agree when the
    ranks are seeded alike, so each generator advances as eager's, each rank's rows are
    eager's rows, and the coupled part of a two-phase step (run on the whole batch on every
    rank) reads the whole draw::

        randn = torch.randn((8, 4), generator=_opaque_obj0)   # gbs 8, on each rank
        rows = randn.narrow(0, 4, 4)                           # rank 1's samples 4-7
        microbatches = split(x, y, rows, ...)
    """
    if not draws:
        return {}
    source = draws[0].graph
    inputs = _batched_inputs(source)
    base = _analysed_batch(inputs)
    reached = descendants(inputs, through=_carries_data)
    needed = _needed(draws, reached)
    for n in source.nodes:
        if n not in needed or n in env:
            continue
        if n in reached and _as_constant(n):
            env[n] = _constant(n, graph, env, inputs, base, batch)
        elif n in reached:  # h.new_empty(size): from a stand-in of h's dtype and device
            stand_in = graph.call_function(torch.empty, (0,), {
                "dtype": n.args[0].meta[SHAPES].dtype,
                "device": _device_of(n.args[0], graph, env, inputs)})
            env[n] = graph.node_copy(n, lambda a, h=n.args[0], s=stand_in: s if a is h
                                     else env[a])
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return {d: _rows(graph, env[d], d, rows) for d in draws}


def _rows(graph: fx.Graph, drawn: Any, draw: fx.Node, rows: tuple[int, int] | None) -> Any:
    """What the body reads of ``drawn``: its ``rows`` along its batch dim (per-sample); the
    whole draw without ``rows``, or when it is batch-free. A draw whose batch dim holds
    ``factor`` rows per sample (``torch.rand(B * T)``) is split as (samples, factor) there
    (as ``fake_probe`` fakes it for a probe; the body flattens it back: ``merged_back``)."""
    fact = draw.meta.get(FACT)
    if not isinstance(fact, Batched):
        return drawn
    if fact.factor != 1:
        drawn = graph.call_method("unflatten", (drawn, fact.dim, (-1, fact.factor)))
    if rows is None:
        return drawn
    start, stop = rows
    return graph.call_method("narrow", (drawn, fact.dim, start, stop - start))


def merged_back(graph: fx.Graph, placeholder: fx.Node, draw: fx.Node) -> fx.Node:
    """The body's value of ``draw`` from its ``placeholder``: as split (``_rows``), with a
    batch dim of ``factor`` rows per sample flattened back."""
    fact = draw.meta.get(FACT)
    if not isinstance(fact, Batched) or fact.factor == 1:
        return placeholder
    merged = graph.call_method("flatten", (placeholder, fact.dim, fact.dim + 1))
    merged.meta = dict(draw.meta)
    return merged


def _analysed_batch(inputs: Sequence[fx.Node]) -> int:
    """The batch size the shapes were recorded at (a batched input's batch dim)."""
    for p in inputs:
        info, fact = p.meta.get(SHAPES), p.meta.get(FACT)
        if isinstance(info, ValueInfo) and info.is_tensor and isinstance(fact, Batched):
            return info.shape_a[fact.dim]
    raise ValueError("no batched tensor input to read the batch size from")


def _number(info: ValueInfo, base: int, batch: int) -> Any:
    """A number recorded at batches ``base`` and ``base + 1``, at ``batch`` (affine)."""
    if info.int_b is None or info.int_b == info.int_a:
        return info.int_a
    return info.int_a + (info.int_b - info.int_a) * (batch - base)


def _constant(n: fx.Node, graph: fx.Graph, env: dict[fx.Node, Any],
              inputs: Sequence[fx.Node], base: int, batch: int) -> Any:
    info = n.meta.get(SHAPES)
    if isinstance(info, ValueInfo):
        return _number(info, base, batch)
    if isinstance(info, tuple):
        return tuple(_number(i, base, batch) for i in info)
    tensor = n.args[0]
    if n.args[1] == "dtype":
        return tensor.meta[SHAPES].dtype
    return _device_of(tensor, graph, env, inputs)


def _device_of(tensor: fx.Node, graph: fx.Graph, env: dict[fx.Node, Any],
               inputs: Sequence[fx.Node]) -> fx.Node:
    """The device of the batched input ``tensor`` is computed from, read in ``graph``."""
    first = next(p for p in inputs if p in ancestors([tensor]))
    return graph.call_function(getattr, (env[first], "device"))
