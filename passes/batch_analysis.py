"""Batch analysis pass: give every node a batch fact, or reject the graph.

Like JAX's batching interpreter, the loop is short: placeholders get their facts
from ``in_dims``, parameters and constants are batch-free, and every other node
asks the rule table (``batch_rules.BATCH_RULES``). A node none of whose inputs
depends on the batch is batch-free whatever its op. A rule that finds samples
being mixed, or an op without a rule, raises ``MixingError`` naming the op, the
node, the user's source line, the path from a batched input, why, and the fix.

Before: ``h = self.l(x); loss = h.mean()``; after, ``node.meta[FACT]``::

    x: per-sample(dim 0)   l: per-sample(dim 0)   mean: batch-reduction
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import networkx as nx
import torch.fx as fx
import torch.nn as nn

from mbcompile.errors import MixingError, UnsupportedOpError

from .batch_rules import RuleContext, _Rejected, lookup_rule, node_name
from .facts import FACT, PARAMS, Batched, BatchSize, Container, Fact, Free, Reduced

__all__ = ["analyse_batch", "describe_op", "source_line"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)')


def source_line(node: fx.Node) -> str:
    """``file:line: code`` of the user's line that created ``node``."""
    for path, line, code in _FRAME.findall(node.stack_trace or ""):
        if "/torch/" not in path and "/mbcompile/" not in path:
            return f"{path}:{line}: {code.strip()}"
    return "<source line not recorded>"


def describe_op(node: fx.Node, gm: fx.GraphModule) -> str:
    """A readable name for the node's op: ``nn.BatchNorm1d``, ``torch.softmax``, ``.view``."""
    if node.op == "call_module":
        return f"{type(gm.get_submodule(node.target)).__name__} (module {node.target!r})"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{node_name(node)}" if module else node_name(node)


def _path_from_inputs(node: fx.Node, sources: list[fx.Node]) -> list[fx.Node]:
    graph = nx.DiGraph()
    for n in node.graph.nodes:
        for user in n.users:
            graph.add_edge(n, user)
    best: list[fx.Node] = []
    for s in sources:
        if s in graph and node in graph and nx.has_path(graph, s, node):
            path = nx.shortest_path(graph, s, node)
            if not best or len(path) < len(best):
                best = path
    return best or [node]


def mixing_error(node: fx.Node, gm: fx.GraphModule, reason: str, fix: str,
                 cls: type[MixingError] = MixingError) -> MixingError:
    sources = [n for n in gm.graph.nodes
               if n.op == "placeholder" and not isinstance(n.meta.get(FACT), Free)]
    path = " -> ".join(n.name for n in _path_from_inputs(node, sources))
    fixes = [f for f in (fix, "compile with mbs='none' to run the whole batch at once") if f]
    message = (f"{describe_op(node, gm)} at node {node.name!r} cannot be microbatched\n"
               f"  at {source_line(node)}\n"
               f"  path from the batched input: {path}\n"
               f"  why: {reason}\n"
               f"  fix: " + "; or ".join(dict.fromkeys(fixes)))
    err = cls(message)
    err.node, err.op, err.reason, err.path = node.name, describe_op(node, gm), reason, path  # type: ignore[attr-defined]
    return err


def _depends_on_params(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "get_attr":
        return True
    if node.op == "call_module" and any(True for _ in gm.get_submodule(node.target).parameters()):
        return True
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n.meta.get(PARAMS, False)))
    return any(found)


def _is_batch_related(fact: Fact) -> bool:
    if isinstance(fact, Container):
        return any(_is_batch_related(f) for _, f in fact.items)
    return isinstance(fact, (Batched, BatchSize, Reduced))


def analyse_batch(gm: fx.GraphModule, input_facts: Mapping[str, Fact], gbs: int
                  ) -> fx.GraphModule:
    """Write ``node.meta[FACT]`` for every node of ``gm`` (in place) and return it."""
    facts: dict[fx.Node, Fact] = {}
    for node in gm.graph.nodes:
        node.meta[PARAMS] = _depends_on_params(node, gm)
        if node.op == "placeholder":
            fact: Fact = input_facts.get(node.target, Free())
        elif node.op == "get_attr":
            fact = Free()
        elif node.op == "output":
            fact = Free()
            for leaf in node.all_input_nodes:
                out = facts[leaf]
                if isinstance(out, Batched) and not out.major:
                    raise mixing_error(leaf, gm, "it is returned with samples interleaved "
                                       "with another dim, so microbatch outputs cannot be "
                                       "concatenated in order",
                                       "reshape so the batch dim leads before returning it")
        else:
            inputs: list[Fact] = []
            fx.node.map_arg((node.args, node.kwargs), lambda n: inputs.append(facts[n]))
            module: nn.Module | None = gm.get_submodule(node.target) \
                if node.op == "call_module" else None
            if not any(_is_batch_related(f) for f in inputs):
                fact = Free()  # nothing batched flows in: it cannot mix samples
            else:
                rule = lookup_rule(node, module)
                if rule is None:
                    raise mixing_error(
                        node, gm, "mbcompile has no batch rule for this op, and it does not "
                        "guess whether an op keeps samples independent",
                        "if it treats samples independently, register a rule: "
                        f"mbcompile.register_batch_rule({_op_key_repr(node)}, 'per_sample'), or "
                        "for a module mbcompile.trust_module(YourModule)", UnsupportedOpError)
                ctx = RuleContext(node, facts, gbs, module, tuple(node.args), dict(node.kwargs))
                try:
                    fact = rule(ctx)
                except _Rejected as rejected:
                    raise mixing_error(node, gm, rejected.reason, rejected.fix) from None
        facts[node] = fact
        node.meta[FACT] = fact
    return gm


def _op_key_repr(node: fx.Node) -> str:
    if node.op == "call_method":
        return repr(node.target)
    if node.op == "call_module":
        return "YourModuleClass"
    target = node.target
    return f"{getattr(target, '__module__', '')}.{node_name(node)}".lstrip(".")
