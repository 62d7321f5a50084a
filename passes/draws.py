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

Draws that read the samples (dropout, ``bernoulli(p)``, ``randn_like(h)`` under fx) stay
where they are: drawn per microbatch, and carried from the body to the coupled part as
any per-sample value (``coupling.py``), never drawn twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from .facts import FACT, SHAPES, Batched, Coupled, Free, ValueInfo
from .graph_walks import ancestors, descendants
from .rules import node_name

__all__ = ["RANDOM_OPS", "emit_draws", "hoisted_draws", "is_draw"]

#: the ops that draw from a generator (functions, methods, in-place fills, ATen spellings)
RANDOM_OPS = frozenset({
    "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
    "rand_like", "randn_like", "randint_like", "normal_", "uniform_", "bernoulli_", "random_",
    "exponential_", "cauchy_", "log_normal_", "geometric_", "uniform", "random", "exponential",
    "cauchy", "log_normal", "geometric", "native_dropout", "dropout", "dropout_",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d",
    "rrelu", "rrelu_with_noise", "gumbel_softmax", "normal_functional"})


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
    reached = descendants(sources, through=_is_data)
    out = []
    for n in graph.nodes:
        if not is_draw(n) or (n in reached and _is_data(n)):
            continue
        fact = n.meta.get(FACT)
        if isinstance(fact, Batched) and not (fact.factor == 1 and fact.major
                                              and not fact.positions):
            continue  # its pieces are not rows of the batch: drawn where it is
        if not isinstance(fact, (Batched, Free, Coupled)):
            continue
        needed = ancestors([n], through=lambda a: not (a in reached and _as_constant(a)))
        if all(a not in reached or a.op == "placeholder" and a not in sources
               or _as_constant(a) for a in needed - {n}):
            out.append(n)
    return out


def emit_draws(graph: fx.Graph, env: dict[fx.Node, Any], draws: Sequence[fx.Node],
               batch: int) -> None:
    """The ``draws`` and what they need into ``graph`` (``env`` maps the source graph's
    placeholders already there): sizes read off batched tensors become their value at
    ``batch`` samples, a device read off one is the batched input's device."""
    if not draws:
        return
    source = draws[0].graph
    inputs = _batched_inputs(source)
    base = _analysed_batch(inputs)
    reached = descendants(inputs, through=_is_data)
    needed = ancestors(draws, through=lambda a: not (a in reached and _as_constant(a)))
    for n in source.nodes:
        if n not in needed or n in env:
            continue
        if n in reached and _as_constant(n):
            env[n] = _constant(n, graph, env, inputs, base, batch)
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])


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
    # the device of the batched input the tensor is computed from
    first = next(p for p in inputs if p in ancestors([tensor]))
    return graph.call_function(getattr, (env[first], "device"))
