"""Microbatch rewrite pass: an analysed graph becomes split -> loop(body) -> accumulate.

Before (facts from the batch analysis in brackets)::

    def forward(self, x, y):
        h = self.l(x)                       # [per-sample(dim 0)]
        loss = F.cross_entropy(h, y)        # [batch-reduction, mean]
        return (loss, h)

After::

    def forward(self, x, y):
        microbatches = split(x, y, slices=((0, 2), (2, 4), ...), in_dims=(0, 0))
        body = self.body
        loop = microbatch_loop(body, microbatches, fused_index=0, systems=(2, 2, 2))
        h = accumulate_cat(loop, 0, dim=0)
        cross_entropy_sum = accumulate_sum(loop, 1, systems=(2, 2, 2))
        cross_entropy_count = accumulate_sum(loop, 2, systems=(2, 2, 2))
        loss = mean_combine(cross_entropy_sum, cross_entropy_count)
        return (loss, h)

    # self.body: the per-sample part, with each mean turned into (sum, count)
    def forward(self, x, y):
        h = self.l(x)
        cross_entropy = cross_entropy_partial(h, y)
        return (cross_entropy[0], cross_entropy[1], h)

What follows the reductions (the "tail": losses added, scaled, divided by counts)
runs once, after the loop, on the exact global sums. New nodes copy ``meta`` from
the node they stand for, so source lines survive.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import ops, partials
from .batch_analysis import BatchAnalysis
from .coupling import Partition, partition
from .draws import emit_draws, hoisted_draws, merged_back
from .facts import (
    FACT,
    REDUCTION,
    SHAPES,
    Batched,
    BatchSize,
    Container,
    Coupled,
    ReductionSpec,
    ValueInfo,
    at_analysed_batch_only,
)
from .graph_code import graph_module
from .graph_walks import ancestors
from .recompute import checkpoint_blocks

__all__ = ["Cut", "constants_at", "cut_graph", "microbatch_rewrite", "two_phase_parts"]


@dataclass(frozen=True)
class Cut:
    """The analysed graph cut at the loop: the body and how its outputs are joined."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    leaves: list[Any]
    part: Partition
    frontier: list[fx.Node]
    body: fx.GraphModule
    specs: list[ops.BodyOutput]
    slots: dict[fx.Node, list[int]]  # reduction or frontier value -> body output indices
    names: dict[int, str]  # body output index -> name of the value after the loop
    source: dict[int, fx.Node]  # body output index -> the node whose source line it is
    coupled: fx.GraphModule | None = None  # a two-phase step's coupled part (C)
    free: tuple[fx.Node, ...] = ()  # the graph inputs C reads besides the frontier
    draws: tuple[fx.Node, ...] = ()  # random draws made once, before the loop (draws.py)
    body_draws: tuple[fx.Node, ...] = ()  # those the body reads, after the graph's inputs


def cut_graph(analysis: BatchAnalysis, keep: Collection[int] | None = None,
              batch: int | None = None) -> Cut:
    """Cut the analysed graph at the loop for the output leaves ``keep`` (None: all):
    made once per analysis and batch size, read by the cost model and the rewrite.

    ``batch``: the full batch the cut runs at (default: the analysed one); the batch
    sizes the tail reads as numbers (``loss * x.size(0)``) take their value at it.
    """
    if analysis.rejected is not None and not analysis.two_phase:
        raise analysis.rejected
    gm = analysis.graph_module
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    # outputs not kept are never computed after the loop, nor kept per microbatch
    leaves = [x if keep is None or i in keep else None for i, x in enumerate(out_node.args[0])]
    roots = [x for x in leaves if isinstance(x, fx.Node)]
    draws = hoisted_draws(gm.graph)
    part = partition(gm.graph, roots=roots, inputs=draws)
    in_body = _body_nodes(part, [*placeholders, *draws])
    # fx's asserts on fixed arguments run once, after the loop
    checks = [n for n in nodes if n.op not in ("placeholder", "output") and n.is_impure()
              and n not in in_body]
    if checks:
        part = partition(gm.graph, checks, roots, draws)
        in_body = _body_nodes(part, [*placeholders, *draws])
    if batch is not None:
        part.constants = constants_at(part, batch)
    # output leaves first, in their order, then what only the tail reads (graph order)
    frontier = list(dict.fromkeys([x for x in leaves if x in part.frontier] + part.frontier))
    reductions = part.reductions

    # 1. The body: everything the per-sample values and the partial sums need.
    body_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = _input_like(body_graph, p)
    body_draws = tuple(d for d in draws if d in in_body)
    for d in body_draws:  # drawn before the loop: the body reads its rows like an input
        env[d] = merged_back(body_graph, _input_like(body_graph, d), d)
    body_outputs: list[fx.Node] = []
    specs: list[ops.BodyOutput] = []
    slots: dict[fx.Node, list[int]] = {}  # reduction or frontier value -> body output indices
    for n in nodes:
        if n in in_body and n not in env:
            env[n] = body_graph.node_copy(n, lambda a: env[a])
        elif n in reductions:
            slots[n] = _emit_partial(n, body_graph, env, body_outputs, specs, gm)
    for value in frontier:
        slots[value] = [len(body_outputs)]
        body_outputs.append(env[value])
        specs.append(ops.BodyOutput("cat", value.meta[FACT].dim))
    body_graph.output(tuple(body_outputs))
    body = graph_module(gm, body_graph, "MicrobatchBody")  # its code: made where it runs
    names = {i: v.name for v in frontier for i in slots[v]}
    source = {i: v for v in frontier for i in slots[v]}  # whose line it is
    for n in reductions:
        names.update(zip(slots[n], (f"{n.name}_sum", f"{n.name}_count")))
        source.update((i, n) for i in slots[n])

    coupled, free = _coupled_module(gm, part, frontier, slots, specs, names, source, leaves,
                                    draws, batch) if analysis.two_phase else (None, ())
    return Cut(gm, placeholders, leaves, part, frontier, body, specs, slots, names, source,
               coupled, free, tuple(draws), body_draws)


def two_phase_parts(analysis: BatchAnalysis, cut: Cut | None = None
                    ) -> tuple[fx.GraphModule, fx.GraphModule, Partition, tuple[fx.Node, ...]]:
    """P (the body: the graph's inputs -> per-sample frontier values and partial sums),
    C (``coupled``: those, joined over the whole batch, -> the graph's outputs), the
    partition and the graph inputs C reads besides them (passed in after them), as the
    rewrite builds them (the same ``cut``, when given), for the cost model to probe apart."""
    parts = cut if cut is not None else cut_graph(analysis)
    assert parts.coupled is not None
    return parts.body, parts.coupled, parts.part, parts.free


def microbatch_rewrite(analysis: BatchAnalysis, *, slices: Sequence[tuple[int, int]],
                       systems: Sequence[int], in_dims: Mapping[str, Any],
                       keep: Collection[int] | None = None,
                       recompute: bool = False, cut: Cut | None = None,
                       rows: tuple[int, int] | None = None) -> fx.GraphModule:
    """Return the microbatched ``GraphModule`` (with the body as submodule ``body``).

    ``slices`` are the non-empty microbatches' (start, stop) in the batch the
    module is called with (one process's share), ``systems`` how many of them each
    system of this process runs. The partial sums go through ``all_reduce_sums``
    (the sum over processes; a backend binds it) before anything reads them.

    A graph whose analysis found ops that mix samples (``analysis.two_phase``) gets a
    second submodule, ``coupled``: the tail, run once on the whole batch by
    ``two_phase_step`` (see ``coupling.py``) instead of after the loop.

    ``keep``: the output leaves to return (None: all); the others come back as None and
    are neither computed after the loop nor kept per microbatch (a training step's
    logits that nobody reads). ``recompute``: the body's repeated blocks run under
    activation checkpointing (``recompute.py``). ``cut``: the graph already cut for ``keep``
    (``cut_graph``), as the analysis hands it to the cost model too. ``rows``: on ranks,
    (this process's first sample, the global batch): draws are made at the global batch,
    and the body reads this process's rows of them (``draws.emit_draws``).
    """
    parts = cut if cut is not None else cut_graph(analysis, keep)
    gm, placeholders, leaves = parts.gm, parts.placeholders, parts.leaves
    part, frontier, slots, specs = parts.part, parts.frontier, parts.slots, parts.specs
    names, source, body = parts.names, parts.source, parts.body
    if recompute:
        blocks = checkpoint_blocks(body)
        if blocks is not None:  # its outputs are the body's: counted on the body's ops
            blocks.__dict__["unsplit"] = body  # (seeding.step_seed; not a submodule)
            body = blocks

    # 2. The top graph: split -> loop -> accumulate -> tail, or split -> two-phase step.
    top = fx.Graph()
    top_env: dict[fx.Node, Any] = {p: top.node_copy(p) for p in placeholders}
    share = sum(b - a for a, b in slices)
    start, batch = rows if rows is not None else (0, share)
    drawn = emit_draws(top, top_env, parts.draws, batch,
                       None if rows is None else (start, start + share))
    dims = [in_dims.get(p.target) for p in placeholders] + [
        d.meta[FACT].dim if isinstance(d.meta[FACT], Batched) else None for d in parts.body_draws]
    mbs = _call(top, ops.split, (*(top_env[p] for p in placeholders),
                                 *(drawn[d] for d in parts.body_draws)),
                {"slices": tuple(slices), "in_dims": tuple(dims)}, "microbatches")
    body_ref = top.get_attr("body")
    root: dict[str, Any] = {"body": body}
    sizes = tuple(b - a for a, b in slices)
    if analysis.two_phase:
        assert parts.coupled is not None
        root["coupled"] = parts.coupled
        free = parts.free
        step = _call(top, ops.two_phase_step,
                     (body_ref, top.get_attr("coupled"), mbs, *(top_env[p] for p in free)),
                     {"outputs": tuple((o.kind, o.dim) for o in specs),
                      "loss_index": analysis.coupled_loss, "systems": tuple(systems),
                      "sizes": sizes}, "two_phase")
        results = [_call(top, operator.getitem, (step, i), {}, x.name, x)
                   if isinstance(x, fx.Node) else x for i, x in enumerate(leaves)]
        if rows is not None:  # C ran on the whole batch: a rank returns its rows, as a split
            results = [_rows_of(top, r, x, start, share) for r, x in zip(results, leaves)]
        top.output(tuple(results))
    else:
        loss = analysis.trained_loss
        fused = slots[loss][0] if loss is not None else None
        count_index = slots[loss][1] if loss is not None and len(slots[loss]) == 2 else None
        loop = _call(top, ops.microbatch_loop, (body_ref, mbs),
                     {"fused_index": fused, "count_index": count_index,
                      "systems": tuple(systems), "sizes": sizes}, "loop")
        acc = _accumulated(top, loop, specs, names, source, systems)
        _emit_tail(top, top_env, part, frontier, slots, acc, None if rows is None else rows[1],
                   shapes=rows is not None)
        top.output(tuple(top_env[x] if isinstance(x, fx.Node) else x for x in leaves))
    for n in top.nodes:
        if n.op in ("get_attr", "call_module") and n.target not in root:
            root[n.target] = _fetch(gm, n.target)
    rewritten = graph_module(root, top, "Microbatched" + type(gm).__name__)
    # sizes whose users became constants (1 / x.size(0) -> 1 / 7); owned graphs only, since
    # fx asks the owning module whether a call_module is impure
    _eliminate_dead_code(rewritten)
    rewritten.graph.lint()
    return rewritten


def _eliminate_dead_code(gm: fx.GraphModule) -> bool:
    """fx's ``Graph.eliminate_dead_code`` on ``gm`` and the graph modules its ``get_attr``
    nodes name (the body, the coupled part), recompiling only those it changed: fx
    recompiles each of them whether it changed or not, which for the body is the whole
    model's code generated again on every compile. True if anything was removed."""
    gm.graph.lint()
    changed = False
    for node in reversed(gm.graph.nodes):  # users first: their inputs lose a user
        if not node.users and not node.is_impure():
            gm.graph.erase_node(node)
            changed = True
    named = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, child in gm.named_children():
        if name in named and isinstance(child, fx.GraphModule):
            changed |= _eliminate_dead_code(child)
    if changed:
        gm.recompile()
    return changed


def constants_at(part: Partition, batch: int) -> dict[fx.Node, int | float]:
    """The numbers the tail reads, at a full batch of ``batch``: a multiple of the batch size
    scales with it, a size that does not grow with the batch (``h.size(-1)``) stays."""
    out = {}
    for n, number in part.constants.items():
        if at_analysed_batch_only(n.meta):  # analysed at each batch
            raise ValueError(f"{n.format_node()} is not a multiple of the batch size")
        fact = n.meta.get(FACT)
        out[n] = fact.factor * batch if isinstance(fact, BatchSize) else number
    return out


def _body_nodes(part: Partition, inputs: list[fx.Node]) -> set[fx.Node]:
    stop = set(inputs)
    return ancestors(part.frontier + [a for r in part.reductions for a in r.all_input_nodes],
                     through=lambda n: n not in stop)


def _accumulated(graph: fx.Graph, loop: fx.Node, specs: Sequence[ops.BodyOutput],
                 names: Mapping[int, str], source: Mapping[int, fx.Node],
                 systems: Sequence[int]) -> list[fx.Node]:
    """Each body output joined over microbatches; partial sums through one collective."""
    acc: list[fx.Node] = []
    for i, spec in enumerate(specs):
        if spec.kind == "cat":
            acc.append(_call(graph, ops.accumulate_cat, (loop, i), {"dim": spec.dim}, names[i],
                             source[i]))
        else:
            acc.append(_call(graph, ops.accumulate_sum, (loop, i), {"systems": tuple(systems)},
                             names[i], source[i]))
    sums = [i for i, s in enumerate(specs) if s.kind == "sum"]
    if sums:  # one collective for every partial sum of the step
        totals = _call(graph, ops.all_reduce_sums, tuple(acc[i] for i in sums), {},
                       "global_sums", source[sums[0]])
        for k, i in enumerate(sums):
            acc[i] = _call(graph, operator.getitem, (totals, k), {}, f"global_{names[i]}",
                           source[i])
    return acc


def _emit_tail(graph: fx.Graph, env: dict[fx.Node, fx.Node], part: Partition,
               frontier: Sequence[fx.Node], slots: Mapping[fx.Node, list[int]],
               joined: Sequence[fx.Node], batch: int | None = None,
               shapes: bool = False) -> None:
    """The tail's nodes into ``graph``: reductions combined from their global partials,
    frontier values from their joined pieces, numbers as their full-batch constants, and
    with ``shapes`` a shape it reads from an input with the batch dims at the whole batch,
    ``batch`` (None: the analysed one), where a rank's inputs hold a share."""
    for n in part.reductions:
        spec: ReductionSpec = n.meta[REDUCTION]
        ids = slots[n]
        if spec.kind == "mean":  # a half-precision mean, summed in float32: rounded once
            half = _half(n)
            env[n] = _call(graph, partials.mean_combine, (joined[ids[0]], joined[ids[1]]),
                           {"dtype": half} if half is not None else {}, n.name)
        else:
            env[n] = joined[ids[0]]
        env[n].meta = dict(n.meta)
    for value in frontier:
        env[value] = joined[slots[value][0]]
        env[value].meta = dict(value.meta)
    for n, number in part.constants.items():  # a batch size after the loop: the global one
        env[n] = _call(graph, operator.pos, (number,), {}, n.name, n)
    for n in part.tail:
        env[n] = graph.node_copy(n, lambda a: env[a])
        fact, info = n.meta.get(FACT), n.meta.get(SHAPES)
        if not shapes or not isinstance(fact, Container) or not isinstance(info, tuple):
            continue
        sizes = tuple((k, f.factor * batch if batch is not None else info[k].int_a)
                      for k, f in fact.items if isinstance(f, BatchSize) and f.multiple
                      and isinstance(k, int) and k < len(info))
        if sizes:  # read from a rank's share: at the whole batch, as its sizes are
            env[n] = _call(graph, ops.global_shape, (env[n], sizes), {}, f"{n.name}_global", n)


def _coupled_module(gm: fx.GraphModule, part: Partition, frontier: Sequence[fx.Node],
                    slots: Mapping[fx.Node, list[int]], specs: Sequence[ops.BodyOutput],
                    names: Mapping[int, str], source: Mapping[int, fx.Node],
                    leaves: Sequence[Any], draws: Collection[fx.Node] = (),
                    batch: int | None = None) -> tuple[fx.GraphModule, tuple[fx.Node, ...]]:
    """The coupled part C as a module: the joined body outputs (per-sample values and
    global partial sums, in body output order), then the unbatched inputs it reads (the
    graph's placeholders, returned beside it: the top graph passes them in)."""
    graph = fx.Graph()
    joined = []
    for i in range(len(specs)):
        ph = graph.placeholder(names[i])
        ph.meta = dict(source[i].meta)
        joined.append(ph)
    read = {a for t in part.tail for a in t.all_input_nodes}
    free_inputs = [n for n in gm.graph.nodes
                   if (n.op == "placeholder" or n in draws) and n in read and n not in frontier]
    env: dict[fx.Node, fx.Node] = {}
    for p in free_inputs:
        env[p] = _input_like(graph, p)
    _emit_tail(graph, env, part, frontier, slots, joined, batch, shapes=True)
    graph.output(tuple(env[x] if isinstance(x, fx.Node) else x for x in leaves))
    return graph_module(gm, graph, "CoupledPart"), tuple(free_inputs)


def _input_like(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A placeholder standing for ``node`` (a graph input, or a draw made before the loop),
    without the input's default: the body and the coupled part are always called with
    every input, and a draw's placeholder after a defaulted one (``forward(x0,
    noise=None)``) would not be valid Python."""
    ph = graph.placeholder(node.target if node.op == "placeholder" else node.name,
                           type_expr=node.type)
    ph.meta = dict(node.meta)
    return ph


def _rows_of(top: fx.Graph, value: Any, leaf: Any, start: int, share: int) -> Any:
    """A per-sample output of a two-phase step on ranks: this rank's rows of the whole
    batch's (``factor`` rows per sample where the batch dim was merged). A coupled one
    (BatchNorm's logits) is per-sample where one dim grows with the batch, by whole rows."""
    fact = leaf.meta.get(FACT) if isinstance(leaf, fx.Node) else None
    info = leaf.meta.get(SHAPES) if isinstance(leaf, fx.Node) else None
    if isinstance(fact, Batched) and fact.major and not fact.positions:
        dim, factor = fact.dim, fact.factor
    elif isinstance(fact, Coupled) and isinstance(info, ValueInfo) and info.is_tensor \
            and len(info.batch_dims) == 1:
        dim = info.batch_dims[0]
        factor = info.shape_b[dim] - info.shape_a[dim]
        if factor <= 0 or info.shape_a[dim] % factor:
            return value
    else:
        return value
    return _call(top, torch.narrow, (value, dim, start * factor, share * factor), {},
                 f"{leaf.name}_rows", leaf)


def _call(graph: fx.Graph, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
          name: str, stands_for: fx.Node | None = None) -> fx.Node:
    """A call_function node named ``name`` (made unique in the graph's namespace); with
    ``stands_for``, it takes a copy of that node's meta, so its source line survives."""
    node = graph.create_node("call_function", fn, args, kwargs, name=name)
    if stands_for is not None:
        node.meta = dict(stands_for.meta)
    return node


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _half(n: fx.Node) -> torch.dtype | None:
    """The dtype of a mean that eager computes in half precision (None: another)."""
    info = n.meta.get(SHAPES)
    return info.dtype if isinstance(info, ValueInfo) and info.dtype in partials.HALF else None


def _emit_partial(n: fx.Node, graph: fx.Graph, env: dict[fx.Node, fx.Node],
                  outputs: list[fx.Node], specs: list[ops.BodyOutput],
                  gm: fx.GraphModule) -> list[int]:
    """Emit the per-microbatch partial(s) of reduction ``n`` into the body."""
    spec: ReductionSpec = n.meta[REDUCTION]
    if spec.partial is None:  # a sum: the op on a microbatch is the partial sum
        env[n] = graph.node_copy(n, lambda a: env[a])
        outputs.append(env[n])
        specs.append(ops.BodyOutput("sum"))
        return [len(outputs) - 1]
    args = fx.node.map_arg(n.args, lambda a: env[a])
    kwargs = dict(fx.node.map_arg(n.kwargs, lambda a: env[a]))
    if n.op == "call_module":
        args = (graph.get_attr(n.target), *args)
    if _half(n) is not None:  # summed in float32 (``partials.HALF``)
        if spec.partial is not partials.mean_partial:
            kwargs["sum_dtype"] = torch.float32
        elif kwargs.get("dtype") is None:
            kwargs["dtype"] = torch.float32
    pair = _call(graph, spec.partial, tuple(args), kwargs, n.name)
    pair.meta = dict(n.meta)
    total = graph.call_function(operator.getitem, (pair, 0))
    count = graph.call_function(operator.getitem, (pair, 1))
    total.meta, count.meta = dict(n.meta), dict(n.meta)
    outputs.extend([total, count])
    specs.extend([ops.BodyOutput("sum"), ops.BodyOutput("sum")])
    return [len(outputs) - 2, len(outputs) - 1]
