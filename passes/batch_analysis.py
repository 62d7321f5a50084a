"""Batch analysis pass: give every node a batch fact, or reject the graph.

Like JAX's batching interpreter, the loop is short: placeholders get their facts
from ``in_dims``, parameters and constants are batch-free, and every other node
asks the rule table (``rules.BATCH_RULES``). A node none of whose inputs
depends on the batch is batch-free whatever its op. A rule that finds samples
being mixed, or an op without a rule, raises ``MixingError`` naming the op, the
node, the user's source line, the path from a batched input, why, and the fix.

Before: ``h = self.l(x); loss = h.mean()``; after, ``node.meta[FACT]``:
``x: per-sample(dim 0)   l: per-sample(dim 0)   mean: batch-reduction``. A rejection
reads (``MixingError``)::

    torch.nn.BatchNorm1d (module 'bn') at node 'bn' cannot be microbatched
      at /home/me/net.py:12: h = self.bn(self.fc(x))
      path from the batched input: x -> fc -> bn
      why: BatchNorm in training mode normalises each channel with the mean and ...
      fix:
        - replace it with GroupNorm or LayerNorm (per-sample statistics)
        - put it in eval mode (model.eval(), or the BatchNorm module's .eval()) ...
        - compile with mbs='none' to run the whole batch at once
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from .errors import MixingError, UnsupportedOpError
from .facts import (
    FACT,
    PARAMS,
    REDUCTION,
    SHAPES,
    Batched,
    BatchSize,
    Container,
    Coupled,
    Fact,
    Free,
    Reduced,
    ValueInfo,
)
from .graph_walks import ancestors
from .guards import own_class
from .penalties import DIFFERENTIATIONS
from .rules import (
    MBS_NONE,
    NoRule,
    Rejected,
    RuleContext,
    apply_rule,
    is_aten,
    is_dispatch_fact,
    lookup_rule,
    loss_rule,
    node_name,
    output_reason,
)
from .sources import source_line

__all__ = ["BatchAnalysis", "analyse_batch", "describe_op", "mixing_error", "source_line"]

_MAX_PATH = 12  # nodes shown of the path from the input before eliding the middle


def describe_op(node: fx.Node, gm: fx.GraphModule) -> str:
    """A readable name for the op: ``torch.nn.BatchNorm1d (module 'bn')``, ``Tensor.view``,
    ``torch.ops.aten.batch_norm``, ``torch.nn.functional.softmax``."""
    if node.op == "call_module":
        cls = own_class(gm.get_submodule(node.target))
        return f"{_qualname(cls)} (module {node.target!r})"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.target in DIFFERENTIATIONS:  # grad_of_sums: torch.autograd.grad as the user wrote it
        return "torch.autograd.grad"
    return _qualname(node.target)


_PUBLIC = (("torch.nn.functional", torch.nn.functional), ("torch.nn", torch.nn),
           ("torch.linalg", torch.linalg), ("torch.fft", torch.fft),
           ("torch.special", torch.special), ("torch", torch))
_PUBLIC_NAMES: dict[int, str] = {}


def _qualname(obj: object) -> str:
    """The public dotted name of a function, class or ATen op (``torch.fft.fft``)."""
    if is_aten(obj):  # any op namespace: torch.ops.aten.sort, torch.ops.transformers.<op>
        namespace, name = str(obj).split(".")[:2]
        return f"torch.ops.{namespace}.{name}"
    if not _PUBLIC_NAMES:  # built once: torch.fft.fft's own __name__ is "fft_fft"
        for public, namespace in reversed(_PUBLIC):
            for attr, value in vars(namespace).items():
                if not attr.startswith("_") and callable(value):
                    _PUBLIC_NAMES[id(value)] = f"{public}.{attr}"
    if id(obj) in _PUBLIC_NAMES:
        return _PUBLIC_NAMES[id(obj)]
    name = getattr(obj, "__name__", None) or str(obj)
    module = getattr(obj, "__module__", None) or ""
    if module == "_operator":
        return f"operator.{name}"
    qual = getattr(obj, "__qualname__", name)
    return f"{module}.{qual}" if module and module != "builtins" else qual


def _path_from_inputs(node: fx.Node, sources: Sequence[fx.Node]) -> list[fx.Node]:
    """The shortest path of nodes from a batched input to ``node`` (networkx on the graph)."""
    import networkx as nx  # here: only a refusal's message needs it (0.2 s to import)

    graph = nx.DiGraph()
    for n in node.graph.nodes:
        graph.add_node(n)
        for user in n.users:
            graph.add_edge(n, user)
    best: list[fx.Node] = []
    for s in sources:
        if nx.has_path(graph, s, node):
            path = nx.shortest_path(graph, s, node)
            if not best or len(path) < len(best):
                best = path
    return best  # empty: no batched input reaches it


def _format_path(path: Sequence[fx.Node]) -> str:
    names = [n.name for n in path] or ["none (it reads no batched input: a buffer, a "
                                       "parameter or a constant)"]
    if len(names) > _MAX_PATH:  # the input end and the op end matter; the middle is elided
        head, tail = 4, _MAX_PATH - 5
        hidden = len(names) - head - tail
        names = [*names[:head], f"... ({hidden} more)", *names[-tail:]]
    return " -> ".join(names)


def mixing_error(node: fx.Node, gm: fx.GraphModule, reason: str, fix: str | Sequence[str],
                 cls: type[MixingError] = MixingError) -> MixingError:
    """The ``MixingError`` for ``node``: op, node, source line, path, why, and fixes."""
    sources = [n for n in gm.graph.nodes
               if n.op == "placeholder" and not isinstance(n.meta.get(FACT), Free)]
    path = _format_path(_path_from_inputs(node, sources))
    fixes = [fix] if isinstance(fix, str) else list(fix)
    fixes = list(dict.fromkeys(f for f in [*fixes, MBS_NONE] if f))
    op = describe_op(node, gm)
    message = (f"{op} at node {node.name!r} cannot be microbatched\n"
               f"  at {source_line(node)}\n"
               f"  path from the batched input: {path}\n"
               f"  why: {reason}\n"
               f"  fix:\n" + "\n".join(f"    - {f}" for f in fixes))
    err = cls(message)
    err.node, err.op, err.reason, err.path = node.name, op, reason, path  # type: ignore[attr-defined]
    err.fixes = tuple(fixes)  # type: ignore[attr-defined]
    err.source_line = source_line(node)  # type: ignore[attr-defined]
    return err


def _carries_gradient(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the value depends on parameters through something differentiable.

    Integer and boolean values (argmax, comparisons, counts) carry no gradient,
    so accuracy counts next to a loss do not count as a second trained output.
    """
    if node.op == "get_attr":  # a parameter; not a buffer, a constant or a generator
        value = _attribute(gm, node.target)
        return isinstance(value, nn.Parameter) or getattr(value, "requires_grad", False) \
            or not isinstance(value, (torch.Tensor, torch.Generator))
    name = node_name(node) if node.op != "call_module" else ""
    if name in _NO_VALUES:
        return False
    broadcast = _broadcast_item(node)
    if node.op == "call_module" and [*gm.get_submodule(node.target).parameters()]:
        found = True
    elif broadcast is not None:  # broadcast_tensors' k-th output is its k-th input's
        found = bool(broadcast.meta.get(PARAMS, False))
    else:
        args = node.args[:1] if name in _FIRST_ARG_VALUES else (node.args, node.kwargs)
        flags: list[bool] = []
        fx.node.map_arg(args, lambda n: flags.append(n.meta.get(PARAMS, False)))
        found = any(flags)
    if not found:
        return False
    info = node.meta.get(SHAPES)
    if isinstance(info, ValueInfo) and not info.is_tensor or isinstance(info, tuple) and not any(
            isinstance(i, ValueInfo) and i.is_tensor for i in info):
        return False  # sizes, shapes and other Python numbers
    if getattr(info, "is_tensor", False) and info.dtype is not None and not (
            info.dtype.is_floating_point or info.dtype.is_complex):
        return False
    return True


def _broadcast_item(node: fx.Node) -> fx.Node | None:
    """The input ``node`` broadcasts, where it is ``broadcast_tensors(...)[k]`` (export's
    ``mse_loss(o, y)``: a metric computed from the target's carries no gradient)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, k = node.args[0], node.args[1]
    if not (isinstance(src, fx.Node) and src.op == "call_function" and isinstance(k, int)
            and src.target in (torch.broadcast_tensors, torch.ops.aten.broadcast_tensors.default)):
        return None
    inputs = src.args[0] if len(src.args) == 1 and isinstance(src.args[0], (list, tuple)) \
        else src.args
    item = inputs[k] if -len(inputs) <= k < len(inputs) else None
    return item if isinstance(item, fx.Node) else None


def _attribute(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for name in target.split("."):
        value = getattr(value, name, None)
    return value


# Ops whose other arguments give only a dtype, device or shape (x.to(y), x.view_as(y)),
# and ops whose values come from none of their arguments (zeros_like(y), x.size()).
_FIRST_ARG_VALUES = frozenset({"to", "type_as", "view_as", "reshape_as", "expand_as",
                               "_to_copy", "new_tensor"})
_NO_VALUES = frozenset({"detach", "detach_", "zeros_like", "ones_like", "empty_like",
                        "full_like", "rand_like", "randn_like", "randint_like", "new_zeros",
                        "new_ones", "new_empty", "new_full", "size", "sym_size", "dim",
                        "numel", "sym_numel", "argmax", "argmin", "rand", "randn", "randint",
                        "randperm"})


def _is_batch_related(fact: Fact) -> bool:
    if isinstance(fact, Container):
        return any(_is_batch_related(f) for _, f in fact.items)
    return isinstance(fact, (Batched, BatchSize, Reduced)) or is_dispatch_fact(fact)


def _unused_in_place(node: fx.Node) -> bool:
    """An in-place op whose result nothing reads: the rewrite follows values, not mutations."""
    name = node_name(node)
    if node.op not in ("call_method", "call_function") or node.users:
        return False
    return name == "setitem" or (name.endswith("_") and not name.endswith("__"))


@dataclass(frozen=True)
class BatchAnalysis:
    """What the batch analysis decided, made once and handed to cost, rewrite and compiler.

    ``graph_module`` carries a fact on every node (``node.meta[FACT]``) unless the
    analysis ``rejected`` the split outright. ``rejected`` is the ``MixingError`` of
    the first op that mixes samples: a plain split would change the result. With
    ``two_phase`` that op and what it feeds are ``Coupled`` and the graph can still
    run exactly as a two-phase step (``passes/coupling.py``); without it the batch
    runs as one microbatch or not at all. ``reductions`` are the reductions over the
    batch the outputs need, in graph order; ``trained_loss`` is the one scalar
    reduction that depends on parameters, whose partial sum the loop backpropagates
    per microbatch (None with several trained losses, or none, or in a two-phase
    graph); ``loss_outputs`` are the output leaves that are trained losses.
    """

    graph_module: fx.GraphModule
    rejected: MixingError | None = None
    reductions: tuple[fx.Node, ...] = ()
    trained_loss: fx.Node | None = None
    loss_outputs: tuple[int, ...] = ()
    two_phase: bool = False
    coupled_loss: int | None = None  # two-phase: the output leaf that is the one scalar loss

    @property
    def fused(self) -> bool:
        """Backward runs inside the call, per microbatch: one microbatch's activations
        (in a two-phase step: one scalar loss, which the coupled part computes)."""
        if self.two_phase:
            return self.coupled_loss is not None
        return self.trained_loss is not None


def analyse_batch(gm: fx.GraphModule, input_facts: Mapping[str, Fact], gbs: int
                  ) -> BatchAnalysis:
    """Write ``node.meta[FACT]`` for every node of ``gm`` (in place); say what follows.

    A graph that mixes samples is not an error here: the result's ``rejected`` holds
    the ``MixingError`` (its node, source line, path and fix), for the caller to raise,
    to run as a two-phase step (``two_phase``), or to run the batch unsplit.
    """
    try:
        coupling = _write_facts(gm, input_facts, gbs)
    except MixingError as exc:
        return BatchAnalysis(gm, rejected=exc)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    needed = ancestors(x for x in leaves if isinstance(x, fx.Node))
    reductions = tuple(n for n in gm.graph.nodes if REDUCTION in n.meta and n in needed)
    losses = tuple(i for i, x in enumerate(leaves)
                   if isinstance(x, fx.Node) and isinstance(x.meta.get(FACT), (Reduced, Coupled))
                   and x.meta.get(PARAMS) and not _is_detach(x))
    if coupling is not None:
        # the loss is the first scalar trained output that couples samples or that a loss
        # function computed, else the first: a statistic returned before it (`p.mean()`
        # before a contrastive loss) or after a cross entropy (a collapse metric
        # `h.std()`) is not the loss; an `aux_loss` next to it is an output too, and a
        # gradient sent into it is refused, never dropped
        losses = tuple(i for i in losses if _is_scalar(leaves[i]))
        likely = [i for i in losses if isinstance(leaves[i].meta.get(FACT), Coupled)
                  or _is_loss_fn(leaves[i], gm)]
        one = (likely or losses)[0] if losses else None
        return BatchAnalysis(gm, coupling, reductions, None, losses, two_phase=True,
                             coupled_loss=one)
    # what a gradient can reach from the outputs: not through detach (state updates)
    differentiable = ancestors((x for x in leaves if isinstance(x, fx.Node)),
                               through=lambda n: not _is_detach(n))
    trained = [n for n in reductions if n.meta.get(PARAMS) and n in differentiable]
    scalar = len(trained) == 1 and _is_scalar(trained[0])
    losses = tuple(i for i in losses if isinstance(leaves[i].meta.get(FACT), Reduced))
    return BatchAnalysis(gm, None, reductions, trained[0] if scalar else None, losses)


def _is_loss_fn(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether a torch loss function (``F.cross_entropy``, ``nn.MSELoss``) computed it."""
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    return node.op != "placeholder" and lookup_rule(node, module) is loss_rule


def _is_scalar(node: fx.Node) -> bool:
    info = node.meta.get(SHAPES)
    return isinstance(info, ValueInfo) and info.is_tensor and info.shape_a == ()


def _is_detach(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in (
        torch.ops.aten.detach.default, torch.detach, torch.Tensor.detach, "detach")


def _write_facts(gm: fx.GraphModule, input_facts: Mapping[str, Fact], gbs: int
                 ) -> MixingError | None:
    """Write every node's fact. A node whose rule finds samples mixed becomes ``Coupled``,
    as does everything it feeds (no rule is asked: it runs on the whole batch); the first
    such node's ``MixingError`` is returned. Other refusals (an op without a rule, an output
    that cannot be joined) raise, since a two-phase step cannot run them either."""
    facts: dict[fx.Node, Fact] = {}
    first: MixingError | None = None
    for node in gm.graph.nodes:
        node.meta[PARAMS] = _carries_gradient(node, gm)
        node.meta.pop(REDUCTION, None)  # a graph analysed again: only this run's reductions
        if node.op == "placeholder":
            fact: Fact = input_facts.get(node.target, Free())
        elif node.op == "get_attr":
            fact = Free()
        elif node.op == "output":
            fact = Free()
            for leaf in node.all_input_nodes:
                _check_output(leaf, facts[leaf], gm)
        else:
            inputs = [facts[n] for n in node.all_input_nodes]
            module: nn.Module | None = gm.get_submodule(node.target) \
                if node.op == "call_module" else None
            if any(_is_coupled(f) for f in inputs):
                fact = Coupled()  # downstream of a mixing op: it sees the whole batch
            elif not any(_is_batch_related(f) for f in inputs):
                fact = Free()  # nothing batched flows in: it cannot mix samples
            else:
                if _unused_in_place(node):
                    raise mixing_error(
                        node, gm, "it changes a batched tensor in place and nothing reads "
                        "its result; mbcompile's rewrite follows values, not mutations",
                        "use the out-of-place form and its result: x = x.masked_fill(m, v), "
                        "x = torch.where(mask, v, x)")
                rule = lookup_rule(node, module)
                ctx = RuleContext(node, facts, gbs, module, tuple(node.args), dict(node.kwargs))
                if rule is None:
                    raise _unsupported(node, gm, module)
                try:
                    fact = apply_rule(rule, ctx)
                except Rejected as rejected:
                    node.meta.pop(REDUCTION, None)
                    first = first or mixing_error(node, gm, rejected.reason, rejected.fixes)
                    fact = Coupled(rejected.reason)
                except NoRule:
                    raise _unsupported(node, gm, module) from None
        facts[node] = fact
        node.meta[FACT] = fact
    if first is not None:
        _refuse_differentiation(gm, first)
    return first


def _refuse_differentiation(gm: fx.GraphModule, first: MixingError) -> None:
    """Raise for a gradient penalty in a graph that couples samples: a gradient taken over a
    mixing op differs per microbatch, and a two-phase step first runs the per-sample part
    without gradients, where none can be taken (``rules/differentiation.py``)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in DIFFERENTIATIONS:
            continue
        if getattr(first, "node", None) == node.name:
            raise first
        where = f"{first.op} at {first.source_line}: {first.reason}"  # type: ignore[attr-defined]
        if _is_coupled(node.meta[FACT]):
            raise mixing_error(
                node, gm, f"the function it differentiates couples samples ({where}), so "
                "each microbatch's gradient would see only its own samples",
                "keep the differentiated function per sample: BatchNorm in eval mode, or "
                "GroupNorm or LayerNorm; no statistics over the batch")
        raise mixing_error(
            node, gm, f"the step's loss couples samples ({where}); such a step runs the "
            "per-sample part first without gradients (two-phase), where a gradient penalty "
            "cannot be taken", "make the rest of the loss per sample, or compile the model "
            "that computes the penalty on its own")


def _is_coupled(fact: Fact) -> bool:
    if isinstance(fact, Container):
        return any(_is_coupled(f) for _, f in fact.items)
    return isinstance(fact, Coupled)


def _check_output(leaf: fx.Node, fact: Fact, gm: fx.GraphModule) -> None:
    dispatched = output_reason(fact)
    if dispatched is not None:
        raise mixing_error(leaf, gm, dispatched, "undo the permutation before returning the "
                           "rows (index them with the inverse permutation, or index_add them "
                           "back into token order)")
    if isinstance(fact, Batched) and not fact.major:
        raise mixing_error(leaf, gm, "it is returned with samples interleaved with another "
                           "dim, so microbatch outputs cannot be concatenated in order",
                           "reshape so the batch dim leads before returning it")
    if isinstance(fact, Batched) and fact.positions:
        raise mixing_error(leaf, gm, "it returns each sample's position in the batch "
                           "(torch.arange(B)), which restarts at 0 in every microbatch",
                           "return per-sample data, not positions")
    if isinstance(fact, BatchSize) and not fact.multiple:
        return  # a number computed from the global batch size: the rewrite keeps it global


def _unsupported(node: fx.Node, gm: fx.GraphModule, module: nn.Module | None) -> MixingError:
    key = _op_key_repr(node, module)
    ways = [f"if it treats samples independently, register a rule: "
            f"mbcompile.register_batch_rule({key}, 'per_sample')"]
    if module is not None:
        ways.append(f"or trust the layer as per-sample: mbcompile.trust_module({key})")
    else:
        ways.append("or move the call into an nn.Module of yours and trust it: "
                    "mbcompile.trust_module(YourModule)")
    return mixing_error(node, gm, "mbcompile has no batch rule for this op, and it does not "
                        "guess whether an op keeps samples independent", ways,
                        UnsupportedOpError)


def _op_key_repr(node: fx.Node, module: nn.Module | None) -> str:
    if node.op == "call_method":
        return repr(node.target)
    if module is not None:
        return _qualname(own_class(module))
    return _qualname(node.target)
