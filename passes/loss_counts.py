"""Count pass: the part of a microbatch body that computes the trained loss's count alone.

A mean over the batch is divided once by its global count (``partials.py``), and a
training step must know that count before the first microbatch's backward, so that
every backward is seeded with the gradient eager's full-batch loss gives it (the way
the HF Trainer's ``get_batch_samples`` counts the batch's tokens before its first
backward). Where the count depends on the data (targets that are not
``ignore_index``, class weights), it depends on the inputs only, never on the model:
this pass keeps just that much of the body, from its inputs to the count::

    body (per microbatch)                      count graph (same inputs)
      logits = self.lm(ids)                      shift = labels[:, 1:]
      shift = labels[:, 1:]                      n = cross_entropy_count(None, shift)
      s, n = cross_entropy_partial(logits, shift)
      return (s, n, logits)                      return n

>>> counts = count_graph(body, count_index=1)   # None: the count needs the model
>>> n = counts(*microbatch)                     # a 0-dim tensor: (labels != -100).sum()

Only class losses count from the data (``LossKind.CLASSES``); every other mean counts
elements, a number the shapes fix, which the runtime reads off the first microbatch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from . import partials
from .graph_walks import ancestors
from .state_updates import mutates

__all__ = ["count_graph", "data_count_graph"]


def count_graph(body: fx.GraphModule, count_index: int) -> fx.GraphModule | None:
    """``body``'s inputs -> output ``count_index`` (a class loss's count), without the
    model; None where the count is not a class loss's or needs a trained parameter."""
    out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    count = values[count_index]
    if not (isinstance(count, fx.Node) and count.target is operator.getitem
            and count.args[1] == 1 and isinstance(count.args[0], fx.Node)):
        return None
    pair = count.args[0]
    counter = _counter(body, pair)
    if counter is None:
        return None
    trained = _trained(body)
    # the score argument (the model's output) is what the count never reads: left out
    args = tuple(None if _reads(a, trained) else a for a in pair.args)
    kwargs = {k: None if _reads(v, trained) else v for k, v in pair.kwargs.items()
              if k != "sum_dtype"}  # (the partial's, not the loss's)
    needed = [a for a in (*args, *kwargs.values()) if isinstance(a, fx.Node)]
    if any(_reads(a, trained) for a in needed):
        return None
    graph, env = _inputs_and(body, ancestors(needed))
    node = graph.call_function(counter, fx.node.map_arg(args, lambda a: env[a]),
                               fx.node.map_arg(kwargs, lambda a: env[a]))
    return _counting(body, graph, node, "LossCount")


def data_count_graph(body: fx.GraphModule, index: int) -> fx.GraphModule | None:
    """``body``'s inputs -> output ``index``, where that output is a count the loss divides
    by and is computed from the data alone (``(labels != -100).sum()``, ``mask.float().sum()``:
    a hand-written token mean ``tok.sum() / mask.sum()``); None where it reads a trained
    parameter, calls a layer, draws or writes into an input or state (run again before the
    loop, it would draw or write again); a write into a tensor it made itself is kept
    (``lab = labels.clone(); lab.masked_fill_(ids == pad, -100)``)."""
    from .draws import is_draw  # (draws reads the rules, which read the partials)

    out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    count = values[index]
    if not isinstance(count, fx.Node):
        return None
    keep, trained = ancestors([count]), _trained(body)
    if any(n in trained or n.op == "call_module" or is_draw(n) or (
            mutates(n) and not _writes_its_own(n, keep)) for n in keep):
        return None
    graph, env = _inputs_and(body, keep)
    return _counting(body, graph, env[count], "DataCount")


def _inputs_and(body: fx.GraphModule, keep: set[fx.Node]
                ) -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    """A graph of ``body``'s inputs (all of them: it is called as the body is) and the nodes
    of ``keep``, copied in order, and each copy by its original."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in body.graph.nodes:
        if n.op == "placeholder" or n in keep:
            env[n] = graph.node_copy(n, lambda a: env[a])
    return graph, env


def _counting(body: fx.GraphModule, graph: fx.Graph, count: fx.Node, name: str
              ) -> fx.GraphModule:
    """``graph`` returning ``count``, as a module of ``body``'s attributes."""
    graph.output(count)
    gm = fx.GraphModule(body, graph, name)
    gm.graph.lint()
    return gm


def _writes_its_own(node: fx.Node, keep: set[fx.Node]) -> bool:
    """Whether the in-place ``node`` writes a tensor made among ``keep`` by an op that makes
    a new one (not an input, state, or a view of either: ``fx_writes.aliases``)."""
    from .fx_writes import aliases, written_tensor

    target = written_tensor(node) if node.args else None
    return isinstance(target, fx.Node) and target in keep and target.op in (
        "call_function", "call_method") and not aliases(target) and not mutates(target)


def _counter(body: fx.GraphModule, pair: fx.Node) -> Callable[..., Any] | None:
    """The count-only twin of the partial ``pair`` calls (its arguments as they are), or
    None for a partial whose count the shapes fix."""
    target = pair.target
    if pair.op == "call_function" and target is partials.module_loss_partial:
        module = pair.args[0]
        if not (isinstance(module, fx.Node) and module.op == "get_attr"):
            return None
        loss = partials.loss_for(operator.attrgetter(module.target)(body))
        return _module_count if loss is not None and loss.kind is partials.CLASSES else None
    for loss in partials.LOSSES:
        if loss.kind is not partials.CLASSES:
            continue
        if target is loss.partial:
            return _functional_count(loss.fn)
        for packet, partial in loss.aten_partials.items():
            if target is partial:
                return _aten_count(packet)
    return None


def _class_count(input: Any, target: torch.Tensor, weight: Any, ignore_index: int) -> Any:
    if target.is_floating_point():  # class probabilities: the count needs the scores' shape
        raise _NeedsScores
    return partials._class_count({"input": input, "target": target, "weight": weight,
                                  "ignore_index": ignore_index})


class _NeedsScores(Exception):
    """The count needs the model's output after all (soft targets): no pre-pass."""


def _functional_count(fn: Callable[..., Any]) -> Callable[..., Any]:
    def count(*args: Any, **kwargs: Any) -> Any:
        a = partials._bound(fn, args, kwargs)
        return _class_count(None, a["target"], a.get("weight"), a.get("ignore_index", -100))

    return partials._named(count, f"{fn.__name__}_count",
                           f"The count of ``F.{fn.__name__}(..., reduction='mean')`` alone.")


def _module_count(module: nn.Module, *inputs: Any) -> Any:
    """A class-loss module's count for ``inputs`` (its scores left out)."""
    return _class_count(None, inputs[1], getattr(module, "weight", None),
                        getattr(module, "ignore_index", -100))


def _aten_count(packet: Any) -> Callable[..., Any]:
    schema = packet.default._schema

    def count(*args: Any, **kwargs: Any) -> Any:
        bound: dict[str, Any] = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(args) and not arg.kwarg_only:
                bound[arg.name] = args[i]
            elif arg.name in kwargs:
                bound[arg.name] = kwargs[arg.name]
            elif arg.has_default_value():
                bound[arg.name] = arg.default_value
        return _class_count(None, bound["target"], bound.get("weight"),
                            bound.get("ignore_index", -100))

    return partials._named(count, f"aten_{packet.__name__}_count",
                           f"The count of ``aten.{packet.__name__}(..., reduction=mean)`` alone.")


def _trained(body: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose value reads a trained parameter (directly, or through a module)."""
    params = {id(p) for p in body.parameters() if p.requires_grad}
    found: set[fx.Node] = set()
    for n in body.graph.nodes:
        if n.op == "get_attr":
            value = operator.attrgetter(n.target)(body)
            reads = isinstance(value, nn.Module) and any(p.requires_grad for p in
                                                         value.parameters()) \
                or id(value) in params
        elif n.op == "call_module":
            reads = any(p.requires_grad for p in body.get_submodule(n.target).parameters())
        else:
            reads = False
        if reads or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _reads(value: Any, trained: set[fx.Node]) -> bool:
    return isinstance(value, fx.Node) and value in trained
