"""What a rule sees of one node (``RuleContext``), how it rejects it, and how facts combine.

A rule gets a ``RuleContext`` (the node, its arguments' facts, the shapes of its value at
two batch sizes: ``gbs`` and ``gbs + 1``) and returns the node's fact, or calls
``ctx.mix(...)`` to reject the op. The batch dim of a result is read off those two shapes
(``ctx.batched_out()``): the dim that grows by ``f`` rows per added sample is the batch
dim, ``f`` samples' worth of rows per sample (a ``(B, T) -> (B*T)`` merge has ``f = T``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch.fx as fx
import torch.nn as nn

from ..facts import SHAPES, Batched, BatchSize, Container, Fact, Free, Reduced, ValueInfo

__all__ = [
    "MBS_NONE",
    "Rejected",
    "Rule",
    "RuleContext",
    "batched_facts",
    "factor_of",
    "handles_positions",
    "handles_tokens",
    "has_batched",
    "int_fact",
    "join_facts",
    "number_fact",
]

Rule = Callable[["RuleContext"], Fact]

MBS_NONE = ("run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') "
            "(one system, one microbatch)")



class Rejected(Exception):
    """Raised by ``RuleContext.mix``; the analysis turns it into a ``MixingError``."""

    def __init__(self, reason: str, fixes: Sequence[str]) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fixes = tuple(f for f in fixes if f)

    @property
    def fix(self) -> str:
        return "; or ".join(self.fixes)


@dataclass
class RuleContext:
    """What a rule sees of one node."""

    node: fx.Node
    facts: dict[fx.Node, Fact]
    gbs: int
    module: nn.Module | None = None
    _args: tuple[Any, ...] = field(default=())
    _kwargs: dict[str, Any] = field(default_factory=dict)

    # ----------------------------------------------------------------- inputs
    def arg(self, index: int, name: str | None = None, default: Any = None) -> Any:
        """The raw argument (an fx.Node or a constant) by position or keyword.

        ``index`` is the position in the call (for ``call_module`` nodes, after
        the module itself); ``name`` also matches ATen's ``self`` for ``input``.
        """
        for key in (name, "self" if name == "input" else None):
            if key is not None and key in self._kwargs:
                return self._kwargs[key]
        if 0 <= index < len(self._args):
            return self._args[index]
        return default

    def fact(self, value: Any) -> Fact:
        """The fact of an argument; constants are batch-free."""
        if isinstance(value, fx.Node):
            return self.facts[value]
        if isinstance(value, (tuple, list)):
            return join_facts([self.fact(v) for v in value], self)
        return Free()

    def arg_facts(self) -> list[Fact]:
        """Facts of every argument (positional and keyword, flattened)."""
        out: list[Fact] = []
        fx.node.map_arg((self._args, self._kwargs), lambda n: out.append(self.facts[n]))
        return out

    def info(self, value: Any = None) -> Any:
        """The ``ValueInfo`` of the node's value, or of an argument node."""
        node = self.node if value is None else value
        return node.meta.get(SHAPES) if isinstance(node, fx.Node) else None

    def ndim(self, value: Any) -> int:
        info = self.info(value)
        return info.ndim if isinstance(info, ValueInfo) and info.is_tensor else 0

    def is_tensor(self, value: Any) -> bool:
        info = self.info(value)
        return isinstance(info, ValueInfo) and info.is_tensor

    # ---------------------------------------------------------------- verdicts
    def mix(self, reason: str, *fixes: str) -> NoReturn:
        """Reject the op: ``reason`` says why it mixes samples, ``fixes`` what to do."""
        raise Rejected(reason, fixes)

    def specialise(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                   target: Any = None) -> None:
        """Rewrite the node into the call it makes at the full batch, spelled so that it
        makes the same call on a microbatch of any size (``squeeze()`` on (B, 1, C) ->
        ``squeeze((1,))``, which keeps the batch dim of a 1-sample microbatch).

        The node's values at the full batch, hence its ``SHAPES``, stay as they were; so
        the rewrite's body, the cost model's probes and the captured graph itself (which
        runs as it is when nothing is split) all make the specialised call.
        """
        node = self.node
        if target is not None:
            node.target = target
        node.args, node.kwargs = tuple(args), dict(kwargs or {})
        self._args, self._kwargs = tuple(node.args), dict(node.kwargs)
        owner = node.graph.owning_module
        if owner is not None:
            owner.recompile()  # its forward is generated from the graph

    def batched_out(self, major: bool | None = None) -> Fact:
        """The node's value as per-sample, locating the batch dim from its shapes.

        Ops that return several tensors get a ``Container`` with one fact each.
        """
        info = self.info()
        if isinstance(info, tuple):
            return Container(tuple((i, self._piece(p, major)) for i, p in enumerate(info)))
        if not isinstance(info, ValueInfo) or not info.is_tensor:
            return int_fact(self)
        return self._piece(info, major)

    def _piece(self, info: Any, major: bool | None) -> Fact:
        if isinstance(info, tuple):
            return Container(tuple((i, self._piece(p, major)) for i, p in enumerate(info)))
        if not isinstance(info, ValueInfo):
            return Free()
        if not info.is_tensor:
            return number_fact(info, self)
        dims = info.batch_dims
        if len(dims) == 0:
            self.mix("its output no longer has a batch dim: it selects, drops or combines "
                     "samples (indexing, slicing or reducing the batch dim)",
                     "keep the batch dim whole: index, slice and reduce only the other dims")
        if len(dims) > 1:
            self.mix(f"its output has {len(dims)} dims that grow with the batch "
                     f"(shape {tuple(info.shape_a)} at batch {self.gbs}), so it pairs "
                     "every sample with every other sample",
                     "compute the interaction within each sample (in-batch negatives, "
                     "x @ x.T and similar need the whole batch)")
        d = dims[0]
        factor = factor_of(info.shape_a[d], info.shape_b[d], self.gbs)
        if factor is None:
            self.mix(f"dim {d} has {info.shape_a[d]} rows at batch {self.gbs} and "
                     f"{info.shape_b[d]} at batch {self.gbs + 1}: not a whole number of rows "
                     "per sample, so part of the batch is dropped or the batch size is baked "
                     "in (a constant in a view, a slice of the batch dim)",
                     "derive batch sizes from the input (x.size(0) or -1) and keep the "
                     "batch dim whole")
        if major is None:
            major = all(f.major for f in batched_facts(self.arg_facts()))
        return Batched(d, factor, major or factor == 1)


def factor_of(size_a: int, size_b: int, gbs: int) -> int | None:
    f = size_b - size_a
    return f if f > 0 and size_a == f * gbs else None


def batched_facts(facts: Iterable[Fact]) -> list[Batched]:
    return [f for f in facts if isinstance(f, Batched)]


def join_facts(facts: Iterable[Fact], ctx: RuleContext) -> Fact:
    """The fact of a value computed from several facts by an op applied per sample."""
    facts = list(facts)
    if any(isinstance(f, Reduced) for f in facts):
        if any(isinstance(f, Batched) for f in facts):
            ctx.mix("it combines per-sample values with a statistic of the whole batch "
                    "(such as x - x.mean(0)): each microbatch would see only its own "
                    "statistic",
                    "use per-sample normalisation (LayerNorm, GroupNorm) or statistics over "
                    "the non-batch dims")
        return Reduced(count=all(f.count for f in facts if isinstance(f, Reduced)))
    if any(isinstance(f, Batched) for f in facts):
        return ctx.batched_out()
    if any(isinstance(f, BatchSize) for f in facts):
        return int_fact(ctx)
    if any(isinstance(f, Container) for f in facts):
        return ctx.batched_out() if has_batched(facts) else Free()
    return Free()


def has_batched(facts: Iterable[Fact]) -> bool:
    for f in facts:
        if isinstance(f, Container) and has_batched(g for _, g in f.items):
            return True
        if isinstance(f, (Batched, BatchSize)):
            return True
    return False


def number_fact(info: ValueInfo, ctx: RuleContext) -> Fact:
    """A Python number seen at two batch sizes: free, a batch size, or derived from one.

    A number computed from a batch size is derived from it even where its two values
    agree: ``x.size(0) > 4`` and ``min(x.size(0), 4)`` are the same at gbs and gbs + 1,
    but not at a microbatch's size, which the loop body would compute them at.
    """
    if info.int_a is None:
        return Free()
    if info.int_a == info.int_b:
        derived = any(isinstance(f, BatchSize) for f in ctx.arg_facts())
        return BatchSize(0, multiple=False) if derived else Free()
    factor = factor_of(info.int_a, info.int_b, ctx.gbs)
    return BatchSize(factor) if factor else BatchSize(0, multiple=False)


def int_fact(ctx: RuleContext) -> Fact:
    """Facts of Python numbers derived from batch sizes, read off their two values."""
    info = ctx.info()
    if isinstance(info, ValueInfo) and info.is_tensor:
        return ctx.batched_out()
    if isinstance(info, tuple):
        return ctx.batched_out()
    if not isinstance(info, ValueInfo):
        return Free()
    return number_fact(info, ctx)


def handles_positions(rule: Rule) -> Rule:
    """Mark a rule that decides about ``arange(B)`` positions itself (``apply_rule`` skips
    its check of positions used as values)."""
    rule.handles_positions = True  # type: ignore[attr-defined]
    return rule


def handles_tokens(rule: Rule) -> Rule:
    """Mark a rule that decides about token-dispatch values itself (``apply_rule`` does not
    show it sorted rows as samples: ``tokens.per_row``)."""
    rule.handles_tokens = True  # type: ignore[attr-defined]
    return rule
