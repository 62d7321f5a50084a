"""The ops the microbatch rewrite inserts: split, loop, accumulate, and one collective.

Backend-neutral: each has a reference meaning written here, so a rewritten graph
runs as it is (one process, every microbatch's activations kept until
backward). A backend binds the loop and the collective to its own
implementations (``bind``): mbcompile's simulated backend runs each microbatch's
backward inside the loop, its torch.distributed backend also all-reduces across
ranks. One step of ``gbs 10 over 3 systems, mbs 2`` (sizes ((2, 2), (2, 1), (2, 1))):

1. ``split`` cuts each batched input into views ``[0:2] [2:4] | [4:6] [6:7] |
   [7:9] [9:10]`` (no copies; empty microbatches never appear);
2. ``microbatch_loop`` runs the body on each view and returns every microbatch's
   outputs;
3. ``accumulate_cat`` joins per-sample outputs in the original order and
   ``accumulate_sum`` adds partial sums per system, then across the systems this
   process runs;
4. ``all_reduce_sums`` adds the partial sums of every process (identity in one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .graph_code import graph_module

__all__ = [
    "BodyOutput",
    "LOOP_OPS",
    "TensorHook",
    "accumulate_cat",
    "accumulate_sum",
    "all_reduce_sums",
    "bind",
    "fsdp_unit_enter",
    "fsdp_unit_exit",
    "global_shape",
    "Microbatches",
    "microbatch_loop",
    "op_of",
    "split",
    "two_phase_step",
]


@dataclass(frozen=True)
class BodyOutput:
    """How one output of the body is combined over microbatches."""

    kind: str  # "cat": per-sample, joined along ``dim``; "sum": a partial sum
    dim: int = 0


def _narrow(value: Any, dim: int | None, start: int, length: int) -> Any:
    """Rows [start, start + length) of every tensor in ``value`` along ``dim`` (views)."""
    if dim is None:
        return value
    if isinstance(value, torch.Tensor):  # the usual input: no pytree walk on every microbatch
        return value.narrow(dim, start, length)
    return pytree.tree_map(
        lambda t: t.narrow(dim, start, length) if isinstance(t, torch.Tensor) else t, value)


class Microbatches(list):  # type: ignore[type-arg]
    """``split``'s microbatches, and ``whole``: the inputs they cut, where the microbatches
    are all of them, in order (None otherwise). What is summed over the microbatches and
    exact in any order (an integer count) can then be computed once, on ``whole``."""

    whole: tuple[Any, ...] | None = None


def split(*inputs: Any, slices: Sequence[tuple[int, int]], in_dims: Sequence[Any]
          ) -> Microbatches:
    """Views of ``inputs`` for every non-empty microbatch, in global batch order."""
    out = Microbatches(tuple(_narrow(x, d, start, stop - start) for x, d in zip(inputs, in_dims))
                       for start, stop in slices)
    if _covers(inputs, in_dims, slices):
        out.whole = inputs
    return out


def _covers(inputs: Sequence[Any], in_dims: Sequence[Any], slices: Sequence[tuple[int, int]]
            ) -> bool:
    """Whether ``slices`` cut every row of the batched inputs, each once, in order (plain
    tensors only: a nested input is not looked into)."""
    stop = 0
    for a, b in slices:
        if a != stop:
            return False
        stop = b
    batched = [(x, d) for x, d in zip(inputs, in_dims) if d is not None]
    return bool(batched) and all(isinstance(x, torch.Tensor) and x.shape[d] == stop
                                 for x, d in batched)


def as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def microbatch_loop(body: Callable[..., Any], microbatches: list[tuple[Any, ...]], *,
                    fused_index: int | None, systems: Sequence[int],
                    count_index: int | None = None, sizes: Sequence[int] = (),
                    drawn: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every microbatch's body outputs (reference meaning: a plain loop).

    ``fused_index`` names the body output that is the trained loss's partial sum
    (a backend may run its backward per microbatch), ``count_index`` its count,
    ``systems`` how many microbatches each system runs and ``sizes`` their samples.
    ``drawn``: values drawn before the loop that the loss reads after it (``loss * lam``),
    with which a backend seeds the backwards it runs in the loop (``seeding.py``).
    """
    return [as_tuple(body(*mb)) for mb in microbatches]


def accumulate_cat(results: list[tuple[Any, ...]], index: int, dim: int) -> torch.Tensor:
    """Per-sample output ``index`` of every microbatch, joined in the original order."""
    pieces = [r[index] for r in results]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def accumulate_sum(results: list[tuple[Any, ...]], index: int, systems: Sequence[int]) -> Any:
    """Partial sums added within each system, then across this process's systems."""
    totals, start = [], 0
    for count in systems:
        part = [r[index] for r in results[start:start + count]]
        start += count
        if part:
            total = part[0]
            for p in part[1:]:
                total = total + p
            totals.append(total)
    total = totals[0]
    for t in totals[1:]:
        total = total + t
    return total


def global_shape(shape: Any, sizes: Sequence[tuple[int, int]]) -> Any:
    """A shape after the loop (``x.shape``, printed or returned) with its batch dims at the
    step's whole batch, ``sizes`` as (dim, size): on a rank ``x`` holds its share, where a
    size read from it as a number is the whole batch's (``microbatch_rewrite``)."""
    if not isinstance(shape, tuple):
        return shape
    values = list(shape)
    for dim, size in sizes:
        values[dim] = size
    return torch.Size(values) if isinstance(shape, torch.Size) else type(shape)(values)


def all_reduce_sums(*values: Any) -> tuple[Any, ...]:
    """Partial sums added over every process of the step (reference: one process)."""
    return values


def two_phase_step(body: Callable[..., Any], coupled: Callable[..., Any],
                   microbatches: list[tuple[Any, ...]], *free: Any,
                   outputs: Sequence[tuple[str, int]], loss_index: int | None,
                   systems: Sequence[int], sizes: Sequence[int] = ()) -> tuple[Any, ...]:
    """The body per microbatch, its outputs joined, then the coupled part once.

    Reference meaning (one process, every microbatch's activations kept until
    backward): ``outputs`` says how each body output is joined, as ``(kind, dim)`` (a
    ``BodyOutput``'s fields, plain so that the graph's code can spell them): ``cat``
    pieces in batch order along ``dim``, ``sum`` partial sums, then added over
    processes. ``free`` are the
    unbatched inputs the coupled part reads, ``loss_index`` its output that is the one
    scalar loss (a backend runs the three phases of a two-phase step around it).
    """
    results = [as_tuple(body(*mb)) for mb in microbatches]
    joined = [accumulate_cat(results, i, dim) if kind == "cat"
              else accumulate_sum(results, i, systems) for i, (kind, dim) in enumerate(outputs)]
    sums = [i for i, (kind, _) in enumerate(outputs) if kind == "sum"]
    for i, total in zip(sums, all_reduce_sums(*(joined[i] for i in sums))):
        joined[i] = total
    return as_tuple(coupled(*joined, *free))


class TensorHook:
    """A tensor hook that forward registers (``h.register_hook(fn)``), kept as an op.

    The node ``tensor_hook(h)`` stands for ``h`` everywhere in the graph: it is ``h`` as a
    view, with ``fn`` registered on it, so ``fn`` sees the gradient of every use of ``h``
    and may replace it, as in eager. Inside the microbatch loop it runs on each
    microbatch's gradient, which is the full batch's for any hook linear in the gradient
    (a scale, a mask, a sign flip). fx prints it as ``mbcompile_passes_ops_tensor_hook``.
    """

    __name__ = "tensor_hook"  # what fx names the node (the module is this one's)

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        self.fn = fn

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = x.view_as(x)
        if y.requires_grad:
            y.register_hook(self.fn)
        return y

    def __repr__(self) -> str:
        return f"tensor_hook({getattr(self.fn, '__qualname__', self.fn)!r})"


def fsdp_unit_enter(unit: str, *values: Any) -> tuple[Any, ...]:
    """Marker: the sharded submodule ``unit`` is called with ``values`` (its tensor
    arguments). The identity here; the torch.distributed backend runs FSDP's
    pre-forward (all-gather) in its place (``mbcompile/execution/fsdp.py``)."""
    return values


def fsdp_unit_exit(unit: str, *values: Any) -> tuple[Any, ...]:
    """Marker: the sharded submodule ``unit`` returns ``values``. The identity here;
    the backend runs FSDP's post-forward (reshard, backward hooks) in its place."""
    return values


#: The ops a backend may bind: the loop, the collective and the two-phase step.
LOOP_OPS = (microbatch_loop, all_reduce_sums, two_phase_step)


def bind(gm: fx.GraphModule, bindings: dict[Callable[..., Any], Callable[..., Any]]
         ) -> fx.GraphModule:
    """A copy of rewritten ``gm`` whose ``LOOP_OPS`` call the backend's ``bindings``.

    The body and every other attribute are shared, not copied; only the top graph is
    new, so a bound and an unbound module can live side by side. Its code is made where it
    first runs, or by ``graph_code.code_now``.
    """
    unknown = set(bindings) - set(LOOP_OPS)
    if unknown:
        raise ValueError(f"only {[f.__name__ for f in LOOP_OPS]} can be bound, not {unknown}")
    for op, impl in bindings.items():
        impl.mbcompile_op = op  # type: ignore[attr-defined]  # what op_of() answers
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        if n.op == "call_function" and n.target in bindings:
            env[n].target = bindings[n.target]
    graph.lint()
    return graph_module(gm, graph, type(gm).__name__)


def op_of(target: Any) -> Any:
    """The backend-neutral op a (possibly bound) node target stands for."""
    return getattr(target, "mbcompile_op", target)
