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
from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from . import ops, partials
from .batch_analysis import BatchAnalysis
from .facts import FACT, REDUCTION, SHAPES, Batched, BatchSize, ReductionSpec, ValueInfo

__all__ = ["microbatch_rewrite"]


def _ancestors(roots: Sequence[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """Nodes needed to compute ``roots``, not looking past the ``stop`` nodes."""
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(n.all_input_nodes)
    return seen


def microbatch_rewrite(analysis: BatchAnalysis, *, slices: Sequence[tuple[int, int]],
                       systems: Sequence[int], in_dims: Mapping[str, Any]) -> fx.GraphModule:
    """Return the microbatched ``GraphModule`` (with the body as submodule ``body``).

    ``slices`` are the non-empty microbatches' (start, stop) in the batch the
    module is called with (one process's share), ``systems`` how many of them each
    system of this process runs. The partial sums go through ``all_reduce_sums``
    (the sum over processes; a backend binds it) before anything reads them.
    """
    if analysis.rejected is not None:
        raise analysis.rejected
    gm = analysis.graph_module
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = nodes[-1]
    leaves = list(out_node.args[0])
    reductions = list(analysis.reductions)
    batched_leaves = list(dict.fromkeys(
        x for x in leaves if isinstance(x, fx.Node) and isinstance(x.meta[FACT], Batched)))

    # 1. The body: everything the per-sample outputs and the partial sums need.
    body_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for p in placeholders:
        env[p] = body_graph.node_copy(p)
    in_body = _ancestors(batched_leaves + [a for r in reductions for a in r.all_input_nodes],
                         set(placeholders))
    body_outputs: list[fx.Node] = []
    specs: list[ops.BodyOutput] = []
    slots: dict[fx.Node, list[int]] = {}  # reduction -> its body output indices
    for n in nodes:
        if n in in_body and n.op != "placeholder":
            env[n] = body_graph.node_copy(n, lambda a: env[a])
        elif n in reductions:
            slots[n] = _emit_partial(n, body_graph, env, body_outputs, specs, gm)
    for leaf in batched_leaves:
        slots[leaf] = [len(body_outputs)]
        body_outputs.append(env[leaf])
        specs.append(ops.BodyOutput("cat", leaf.meta[FACT].dim))
    body_graph.output(tuple(body_outputs))
    body = fx.GraphModule(gm, body_graph, "MicrobatchBody")

    # 2. The top graph: split -> loop -> accumulate -> tail.
    top = fx.Graph()
    top_env: dict[fx.Node, fx.Node] = {p: top.node_copy(p) for p in placeholders}
    mbs = _call(top, ops.split, tuple(top_env[p] for p in placeholders),
                {"slices": tuple(slices),
                 "in_dims": tuple(in_dims.get(p.target) for p in placeholders)}, "microbatches")
    body_ref = top.get_attr("body")
    loss = analysis.trained_loss
    fused = slots[loss][0] if loss is not None else None
    count_index = slots[loss][1] if loss is not None and len(slots[loss]) == 2 else None
    loop = _call(top, ops.microbatch_loop, (body_ref, mbs),
                 {"fused_index": fused, "count_index": count_index, "systems": tuple(systems),
                  "sizes": tuple(b - a for a, b in slices)}, "loop")
    names = {i: leaf.name for leaf in batched_leaves for i in slots[leaf]}
    source = {i: leaf for leaf in batched_leaves for i in slots[leaf]}  # whose line it is
    for n in reductions:
        names.update(zip(slots[n], (f"{n.name}_sum", f"{n.name}_count")))
        source.update((i, n) for i in slots[n])
    acc: list[fx.Node] = []
    for i, spec in enumerate(specs):
        if spec.kind == "cat":
            acc.append(_call(top, ops.accumulate_cat, (loop, i), {"dim": spec.dim}, names[i],
                             source[i]))
        else:
            acc.append(_call(top, ops.accumulate_sum, (loop, i), {"systems": tuple(systems)},
                             names[i], source[i]))
    sums = [i for i, s in enumerate(specs) if s.kind == "sum"]
    if sums:  # one collective for every partial sum of the step
        totals = _call(top, ops.all_reduce_sums, tuple(acc[i] for i in sums), {}, "global_sums",
                       source[sums[0]])
        for k, i in enumerate(sums):
            acc[i] = _call(top, operator.getitem, (totals, k), {}, f"global_{names[i]}",
                           source[i])
    for n in reductions:
        spec: ReductionSpec = n.meta[REDUCTION]
        ids = slots[n]
        if spec.kind == "mean":
            top_env[n] = _call(top, partials.mean_combine, (acc[ids[0]], acc[ids[1]]), {},
                               n.name)
        else:
            top_env[n] = acc[ids[0]]
        top_env[n].meta = dict(n.meta)
    for leaf in batched_leaves:
        top_env[leaf] = acc[slots[leaf][0]]
        top_env[leaf].meta = dict(leaf.meta)
    stop = set(top_env)
    checks = [n for n in nodes if n.op not in ("placeholder", "output") and n.is_impure()
              and n not in in_body]  # fx's asserts on fixed arguments run once, after the loop
    tail = _ancestors([x for x in leaves if isinstance(x, fx.Node)] + checks, stop)
    for n in nodes:
        if n in top_env or n not in tail or n.op == "output":
            continue
        if isinstance(n.meta.get(FACT), BatchSize):  # a batch size after the loop: the global one
            info: ValueInfo = n.meta[SHAPES]
            top_env[n] = _call(top, operator.pos, (info.int_a,), {}, n.name, n)
            continue
        top_env[n] = top.node_copy(n, lambda a: top_env[a])
    top.output(tuple(top_env[x] if isinstance(x, fx.Node) else x for x in leaves))
    root = {"body": body}
    for n in top.nodes:
        if n.op in ("get_attr", "call_module") and n.target != "body":
            root[n.target] = _fetch(gm, n.target)
    rewritten = fx.GraphModule(root, top, "Microbatched" + type(gm).__name__)
    # sizes whose users became constants (1 / x.size(0) -> 1 / 7); owned graphs only, since
    # fx asks the owning module whether a call_module is impure
    if rewritten.graph.eliminate_dead_code():
        rewritten.recompile()
    rewritten.graph.lint()
    return rewritten


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
    kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
    if n.op == "call_module":
        args = (graph.get_attr(n.target), *args)
    pair = _call(graph, spec.partial, tuple(args), dict(kwargs), n.name)
    pair.meta = dict(n.meta)
    total = graph.call_function(operator.getitem, (pair, 0))
    count = graph.call_function(operator.getitem, (pair, 1))
    total.meta, count.meta = dict(n.meta), dict(n.meta)
    outputs.extend([total, count])
    specs.extend([ops.BodyOutput("sum"), ops.BodyOutput("sum")])
    return [len(outputs) - 2, len(outputs) - 1]
