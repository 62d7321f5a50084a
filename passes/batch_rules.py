"""Batch rules: one table, op -> rule, registered by family.

A rule gets a ``RuleContext`` (the node, its arguments' facts, the shapes of its
value at two batch sizes) and returns the node's fact, or calls ``ctx.mix(...)``
to reject the op. Keys are:

- a module class (``nn.Linear``) for ``call_module`` nodes,
- a function (``torch.relu``, ``F.linear``, ``operator.add``) for ``call_function``
  nodes of ``torch.fx.symbolic_trace`` graphs,
- an ATen overload packet (``torch.ops.aten.linear``) for the ``call_function``
  nodes of ``torch.export`` graphs (any overload maps to its packet),
- a method name string (``"view"``) for ``call_method`` nodes.

The table (``TABLE``, a ``RuleTable``) closes this file and reads top to bottom:
one op or op group per line, its rule, and a comment on what it does to the batch
dim, the way JAX registers ``primitive_batchers[prim] = rule``. A group names all
the spellings of its ops (``torch.X``, ``Tensor.X``, ``F.X``, ``torch.ops.aten.X``);
groups too long for the line are spelled out just above the table, and rules that
need more than a line are functions above those. Losses are declared once each, in
``partials.LOSSES``, which gives both their partials and, here, their rule.

As in JAX, an op without a rule is rejected, never guessed. Users add rules with
``register_batch_rule(op, rule)`` and trust whole layers with ``trust_module``;
``with scoped(): ...`` undoes whatever was registered inside it, and
``TABLE.snapshot()`` lets a test suite check that it left the table as it found it.

Worked example, ``loss = F.cross_entropy(self.head(x).view(-1, V), y.view(-1))``:

1. ``x`` is ``Batched(0)`` (an input); ``self.head`` is ``nn.Linear``, whose rule
   checks the batch dim is not the contracted last dim.
2. ``view(-1, V)`` merges (B, T) into B*T rows: ``reshape_rule`` sees from the
   shapes at gbs and gbs+1 that dim 0 scales as T*B, batch-major: ``Batched(0, T)``.
3. ``cross_entropy`` with ``reduction='mean'`` is a reduction over the batch:
   ``loss`` returns ``Reduced`` and records a ``ReductionSpec("mean",
   cross_entropy_partial)`` so the rewrite computes (sum, count) per microbatch.

Two values need more care than "which dim is the batch":

- ``BatchSize`` ints (``x.size(0)``) may shape tensors (``view(B, -1)``,
  ``zeros(B, D)``, ``arange(B)``) but never enter per-sample arithmetic: a
  microbatch would see its own size (``pointwise`` rejects ``x * x.size(0)``);
- ``torch.arange(B)`` is ``Batched(positions=True)``: each sample's index in
  its batch. It may index the batch dim of a batched tensor (the identity
  ``x[torch.arange(B), labels]``) and go through reshapes and casts, nothing
  else, since positions restart at 0 in every microbatch (``apply_rule``).

Facts are about the full-batch program. An op whose meaning depends on the batch
size is kept when the full batch keeps samples apart, and if a microbatch would
act differently the rule rewrites the node (``ctx.specialise``) into the call it
makes at the full batch: ``(B, 1, C).squeeze()`` drops dim 1 alone there (B > 1),
so it becomes ``squeeze((1,))``, which a 1-sample microbatch runs the same way.
``x.new_ones(T, T)`` of a batched ``x`` is batch-free (``x`` gives only its dtype),
``x.new_ones(B, T)`` per-sample, and a pad of ``(0, 0)`` leaves the batch dim alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from . import ops, partials
from .facts import (
    PARAMS,
    REDUCTION,
    SHAPES,
    Batched,
    BatchSize,
    Container,
    Fact,
    Free,
    Reduced,
    ReductionSpec,
    ValueInfo,
)

__all__ = [
    "BATCH_RULES",
    "FAMILIES",
    "POSITION_PRESERVING",
    "TABLE",
    "TRUSTED_MODULES",
    "RuleContext",
    "RuleTable",
    "TableState",
    "apply_rule",
    "lookup_rule",
    "node_name",
    "register_batch_rule",
    "rule_key",
    "scoped",
    "trust_module",
]

Rule = Callable[["RuleContext"], Fact]

MBS_NONE = ("run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') "
            "(one system, one microbatch)")


# ---------------------------------------------------------------------------
# The table object: op -> rule, with scoped registration
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class TableState:
    """What a ``RuleTable`` holds at one moment; equal states mean equal tables."""

    rules: Mapping[Any, Rule]
    position_preserving: frozenset[Any]
    trusted: frozenset[type[nn.Module]]


class RuleTable:
    """op -> rule; the ops whose rules keep ``arange(B)`` positions; trusted module classes.

    The three are plain containers that stay the same objects for the table's life
    (``BATCH_RULES`` is ``TABLE.rules``), so ``restore`` and ``scope`` work in place.

    >>> with TABLE.scope():
    ...     register_batch_rule(my_ops.fused_gelu, "per_sample")   # gone after the block
    """

    def __init__(self) -> None:
        self.rules: dict[Any, Rule] = {}
        self.position_preserving: set[Any] = set()
        self.trusted: set[type[nn.Module]] = set()

    def add(self, ops: Iterable[Any], rule: Rule, *, keeps_positions: bool = False) -> None:
        """One table line: ``rule`` for every op of the group (``None``: a spelling this
        torch lacks). ``keeps_positions``: the ops only move or copy elements, so
        ``arange(B)`` positions stay positions through them."""
        for op in ops:
            if op is None:
                continue
            self.rules[rule_key(op)] = rule
            if keeps_positions:
                self.position_preserving.add(rule_key(op))

    def lookup(self, node: fx.Node, module: nn.Module | None) -> Rule | None:
        """The rule for ``node``: by module class (most derived first), function or method name."""
        if node.op == "call_module":
            for cls in type(module).__mro__:
                if cls in self.rules:
                    return self.rules[cls]
            return None
        try:
            return self.rules.get(rule_key(node.target))
        except TypeError:  # an unhashable target
            return None

    def snapshot(self) -> TableState:
        """A frozen copy: compare it (``==``, ``changes_since``) or ``restore`` it later."""
        return TableState(types.MappingProxyType(dict(self.rules)),
                          frozenset(self.position_preserving), frozenset(self.trusted))

    def restore(self, state: TableState) -> None:
        """Put the table back to ``state``, in place."""
        self.rules.clear()
        self.rules.update(state.rules)
        self.position_preserving.clear()
        self.position_preserving.update(state.position_preserving)
        self.trusted.clear()
        self.trusted.update(state.trusted)

    def changes_since(self, state: TableState) -> list[str]:
        """What differs from ``state``, one line per op (empty when nothing does)."""
        now = self.snapshot()
        ops = [*state.rules, *(k for k in now.rules if k not in state.rules)]
        out = [f"rule for {op!r}: {state.rules.get(op)!r} -> {now.rules.get(op)!r}"
               for op in ops if state.rules.get(op) is not now.rules.get(op)]
        out += [f"keeps positions: {op!r}" for op in now.position_preserving
                ^ state.position_preserving]
        out += [f"trusted: {cls!r}" for cls in now.trusted ^ state.trusted]
        return out

    @contextlib.contextmanager
    def scope(self) -> Iterator[RuleTable]:
        """Registrations made inside the block are undone on the way out (also on error)."""
        state = self.snapshot()
        try:
            yield self
        finally:
            self.restore(state)


#: The one table (filled at the bottom of this file).
TABLE = RuleTable()
BATCH_RULES = TABLE.rules
#: Ops that only move or copy elements: ``arange(B)`` positions stay positions through them.
POSITION_PRESERVING = TABLE.position_preserving
#: Module classes the capture pass keeps as leaves (``trust_module``).
TRUSTED_MODULES = TABLE.trusted


def scoped() -> contextlib.AbstractContextManager[RuleTable]:
    """``with scoped(): register_batch_rule(...)``: the registration lasts for the block."""
    return TABLE.scope()


class _Rejected(Exception):
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
            return _join([self.fact(v) for v in value], self)
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
        raise _Rejected(reason, fixes)

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
            return _int_fact(self)
        return self._piece(info, major)

    def _piece(self, info: Any, major: bool | None) -> Fact:
        if isinstance(info, tuple):
            return Container(tuple((i, self._piece(p, major)) for i, p in enumerate(info)))
        if not isinstance(info, ValueInfo):
            return Free()
        if not info.is_tensor:
            return _number_fact(info, self)
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
        factor = _factor(info.shape_a[d], info.shape_b[d], self.gbs)
        if factor is None:
            self.mix(f"dim {d} has {info.shape_a[d]} rows at batch {self.gbs} and "
                     f"{info.shape_b[d]} at batch {self.gbs + 1}: not a whole number of rows "
                     "per sample, so part of the batch is dropped or the batch size is baked "
                     "in (a constant in a view, a slice of the batch dim)",
                     "derive batch sizes from the input (x.size(0) or -1) and keep the "
                     "batch dim whole")
        if major is None:
            major = all(f.major for f in _batched(self.arg_facts()))
        return Batched(d, factor, major or factor == 1)


def _factor(size_a: int, size_b: int, gbs: int) -> int | None:
    f = size_b - size_a
    return f if f > 0 and size_a == f * gbs else None


def _batched(facts: Iterable[Fact]) -> list[Batched]:
    return [f for f in facts if isinstance(f, Batched)]


def _join(facts: Iterable[Fact], ctx: RuleContext) -> Fact:
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
        return _int_fact(ctx)
    if any(isinstance(f, Container) for f in facts):
        return ctx.batched_out() if _has_batched(facts) else Free()
    return Free()


def _has_batched(facts: Iterable[Fact]) -> bool:
    for f in facts:
        if isinstance(f, Container) and _has_batched(g for _, g in f.items):
            return True
        if isinstance(f, (Batched, BatchSize)):
            return True
    return False


def _number_fact(info: ValueInfo, ctx: RuleContext) -> Fact:
    """A Python number seen at two batch sizes: free, a batch size, or derived from one."""
    if info.int_a is None or info.int_a == info.int_b:
        return Free()
    factor = _factor(info.int_a, info.int_b, ctx.gbs)
    return BatchSize(factor) if factor else BatchSize(0, multiple=False)


def _int_fact(ctx: RuleContext) -> Fact:
    """Facts of Python numbers derived from batch sizes, read off their two values."""
    info = ctx.info()
    if isinstance(info, ValueInfo) and info.is_tensor:
        return ctx.batched_out()
    if isinstance(info, tuple):
        return ctx.batched_out()
    if not isinstance(info, ValueInfo):
        return Free()
    return _number_fact(info, ctx)



# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------

def rule_key(op: Any) -> Any:
    """The table key of an op: ATen overloads map to their packet."""
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket
    if isinstance(op, ops.TensorHook):
        return ops.TensorHook  # one rule for every hook forward registers
    return op


def register_batch_rule(op: Any, rule: Rule | str) -> None:
    """Register ``rule`` for ``op`` (a module class, function, method name or ATen op).

    ``rule`` is a function ``(RuleContext) -> Fact`` or the name of a built-in
    family: ``"per_sample"`` (the op never mixes samples: the output's batch dim
    is found from its shape), ``"pointwise"`` (elementwise: also rejects a
    non-linear function of a batch reduction), ``"linear"`` (linear in its
    inputs, so reductions pass through), ``"free"`` (batch-free unless shaped
    by the batch). Inside ``with scoped():`` the rule lasts for the block.

    >>> mbcompile.register_batch_rule(my_ops.fused_gelu, "per_sample")
    >>> mbcompile.register_batch_rule("my_method", lambda ctx: ctx.batched_out())
    """
    if isinstance(rule, str):
        try:
            rule = FAMILIES[rule]
        except KeyError:
            raise ValueError(f"unknown rule family {rule!r}; one of {sorted(FAMILIES)}") from None
    if not callable(rule):
        raise TypeError(f"a batch rule is a function (RuleContext) -> Fact or a family name, "
                        f"got {rule!r}")
    TABLE.rules[rule_key(op)] = rule


def trust_module(module_type: type[nn.Module]) -> type[nn.Module]:
    """Trust every instance of ``module_type`` as per-sample (a leaf, never traced into).

    Use it for your own layers that you know treat samples independently
    (custom kernels, code fx cannot trace): ``torch.fx`` capture keeps them as
    single ``call_module`` nodes, and the batch analysis finds their output's
    batch dim from its shape. Works as a class decorator too.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"trust_module takes an nn.Module subclass, got {module_type!r}")
    register_batch_rule(module_type, per_sample)
    TABLE.trusted.add(module_type)
    return module_type


def lookup_rule(node: fx.Node, module: nn.Module | None) -> Rule | None:
    """The rule for ``node``: by module class (most derived first), function or method name."""
    return TABLE.lookup(node, module)


def apply_rule(rule: Rule, ctx: RuleContext) -> Fact:
    """Run ``rule``, then police ``arange(B)`` positions (see the module docstring)."""
    fact = rule(ctx)
    positions = [f for f in _batched(ctx.arg_facts()) if f.positions]
    if not positions or getattr(rule, "handles_positions", False):
        return fact
    key = ctx.module.__class__ if ctx.module is not None else rule_key(ctx.node.target)
    others = [f for f in _batched(ctx.arg_facts()) if not f.positions]
    keeps = key in TABLE.position_preserving
    if keeps and not others and isinstance(fact, Batched) and fact.factor == positions[0].factor:
        return dataclasses.replace(fact, positions=True)
    if isinstance(fact, Container) and keeps and not others:
        return Container(tuple((k, dataclasses.replace(f, positions=True))  # pieces of arange
                               if isinstance(f, Batched) else (k, f) for k, f in fact.items))
    ctx.mix("it uses each sample's position in the batch (torch.arange(B)) as a value; "
            "positions restart at 0 in every microbatch, so sample i would see a different "
            "number",
            "use arange(B) only to index the batch dim (x[torch.arange(B), idx]); for "
            "positions along the sequence use torch.arange(T)")


def _handles_positions(rule: Rule) -> Rule:
    rule.handles_positions = True  # type: ignore[attr-defined]
    return rule


# ---------------------------------------------------------------------------
# Spellings: every name an op goes by
# ---------------------------------------------------------------------------

def aten(*names: str) -> list[Any]:
    """ATen overload packets (``torch.ops.aten.<name>``) that exist in this torch."""
    out = []
    for name in names:
        try:
            out.append(getattr(torch.ops.aten, name))
        except (AttributeError, RuntimeError):
            continue
    return out


def spellings(*names: str, functional: bool = True, method: bool = True,
              torch_ns: bool = True, aten_ns: bool = True) -> list[Any]:
    """``torch.X``, ``Tensor.X`` (as the method name), ``F.X`` and ``aten.X`` for each name."""
    out: list[Any] = []
    for name in names:
        if torch_ns and hasattr(torch, name):
            out.append(getattr(torch, name))
        if method and hasattr(torch.Tensor, name):
            out.append(name)
        if functional and hasattr(F, name):
            out.append(getattr(F, name))
        if aten_ns:
            out.extend(aten(name))
    return out


def _mods(*names: str) -> list[type[nn.Module]]:
    return [getattr(nn, n) for n in names if hasattr(nn, n)]


def is_aten(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))


def node_name(node: fx.Node) -> str:
    """The op's short name: ``view``, ``linear`` (for ``aten.linear.default`` too)."""
    t = node.target
    if isinstance(t, str):
        return t
    if is_aten(t):
        return str(t).split(".")[1]  # "aten.linear.default" -> "linear"
    return getattr(t, "__name__", str(t))


# ---------------------------------------------------------------------------
# Rule families
# ---------------------------------------------------------------------------

def free(ctx: RuleContext) -> Fact:
    """Creation ops (``torch.zeros(3)``): batch-free unless shaped by the batch."""
    return _join(ctx.arg_facts(), ctx)


def _no_batch_size_values(ctx: RuleContext, facts: Sequence[Fact]) -> None:
    if any(isinstance(f, BatchSize) for f in facts) and ctx.is_tensor(ctx.node) and not any(
            isinstance(f, Reduced) for f in facts):
        ctx.mix("it uses the batch size (x.size(0), len(x)) as a value in per-sample work: "
                "inside the microbatch loop it is the microbatch's size, not the batch's",
                "use the batch size only for shapes (view, expand, zeros), or divide a "
                "reduction by it (loss.sum() / x.size(0)), which mbcompile keeps global")


def pointwise(ctx: RuleContext) -> Fact:
    """Elementwise / broadcasting op: samples stay independent."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts) and not _batched(facts):
        ctx.mix("it applies a non-linear function to a reduction over the batch (such as "
                "loss.sqrt() or acc ** 2); mbcompile combines reductions across microbatches "
                "linearly and only divides sums by counts",
                "apply the non-linear function per sample before reducing, or return the "
                "reduction and transform it outside the model")
    _no_batch_size_values(ctx, facts)
    return _join(facts, ctx)


def linear(ctx: RuleContext) -> Fact:
    """Ops linear in each argument (negation, casts, reshapes): reductions pass through."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return _join(facts, ctx)
    return per_sample(ctx)


def _linear_arith(op: str) -> Rule:
    """+, -: linear in both. *: linear if one side is batch-free. /: if the divisor is."""

    def rule(ctx: RuleContext) -> Fact:
        a, b = ctx.fact(ctx.arg(0)), ctx.fact(ctx.arg(1))
        if op == "div" and ctx.arg(2, "rounding_mode") is not None:
            return pointwise(ctx)  # floor / trunc division is not linear
        reduced = [f for f in (a, b) if isinstance(f, Reduced)]
        if not reduced:
            _no_batch_size_values(ctx, (a, b))
            return _join((a, b), ctx)
        if op in ("add", "sub"):
            return _join((a, b), ctx)
        if isinstance(a, Reduced) and isinstance(b, Reduced):
            if op == "div" and b.count:
                return Reduced(count=a.count)  # sum / count: a mean, exact on the totals
            ctx.mix("it multiplies or divides two reductions over the batch, which is not "
                    "linear in the samples",
                    "divide only by counts computed from the inputs (mask.sum(), "
                    "(labels != -100).sum()), which mbcompile adds up before dividing")
        if op == "div" and isinstance(b, Reduced):
            ctx.mix("it divides by a reduction over the batch that depends on the parameters, "
                    "which is not linear in the samples",
                    "divide by counts computed from the inputs only")
        other = b if isinstance(a, Reduced) else a
        if isinstance(other, BatchSize):
            return Reduced(count=a.count if isinstance(a, Reduced) else False)  # sum / B
        return _join((a, b), ctx)

    return rule


def per_sample(ctx: RuleContext) -> Fact:
    """The op never mixes samples (its batch dim is found from the output's shape)."""
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return pointwise(ctx)
    return _join(facts, ctx)


def _check_batch_not_in(ctx: RuleContext, value: Any, dims: Sequence[int], what: str,
                        *fixes: str) -> None:
    fact = ctx.fact(value)
    if not isinstance(fact, Batched):
        return
    ndim = ctx.ndim(value)
    if ndim and fact.dim in {d % ndim for d in dims}:
        ctx.mix(f"it {what} along dim {fact.dim}, which is the batch dim",
                *(fixes or (f"make it {what} along a non-batch dim",)))


def along(get_dims: Callable[[RuleContext], Sequence[int]], what: str, *fixes: str,
          inputs: Sequence[tuple[int, str]] = ((0, "input"),)) -> Rule:
    """The op couples elements along some dims of its inputs: fine unless the batch dim."""

    def rule(ctx: RuleContext) -> Fact:
        dims = get_dims(ctx)
        for index, name in inputs:
            _check_batch_not_in(ctx, ctx.arg(index, name), dims, what, *fixes)
        return per_sample(ctx)

    return rule


def _all_dims(ctx: RuleContext, value: Any) -> list[int]:
    return list(range(ctx.ndim(value)))


def _dim_arg(index: int = 1, name: str = "dim", default: Any = None,
             of: tuple[int, str] = (0, "input")) -> Callable[[RuleContext], list[int]]:
    """Dims named by an argument; ``None`` or ``[]`` mean every dim of the input."""

    def get(ctx: RuleContext) -> list[int]:
        d = ctx.arg(index, name, default)
        if d is None or (isinstance(d, (tuple, list)) and len(d) == 0):
            return _all_dims(ctx, ctx.arg(*of))
        if isinstance(d, fx.Node):  # a symbolic dim: assume the worst
            return _all_dims(ctx, ctx.arg(*of))
        return list(d) if isinstance(d, (tuple, list)) else [d]

    return get


def _last(k: int) -> Callable[[RuleContext], list[int]]:
    return lambda ctx: list(range(-k, 0))



def _softmax_dims(ctx: RuleContext) -> list[int]:
    """softmax's dim (a module's ``.dim``); ``None`` is the legacy implicit dim (0 for 0-, 1-
    and 3-d inputs, else 1)."""
    d = ctx.module.dim if ctx.module is not None else ctx.arg(1, "dim")
    if d is None:
        ndim = ctx.ndim(ctx.arg(0, "input"))
        return [0 if ndim in (0, 1, 3) else 1]
    return [d]


def _module_dim(ctx: RuleContext) -> list[int]:
    """The dim a module was built with (``nn.GLU(dim)``)."""
    return [ctx.module.dim]


def _normalized_dims(ctx: RuleContext) -> list[int]:
    """LayerNorm/RMSNorm: the last ``len(normalized_shape)`` dims (the module's, or the
    functional's argument)."""
    shape = (ctx.module.normalized_shape if ctx.module is not None
             else ctx.arg(1, "normalized_shape"))
    return list(range(-_length(ctx, shape), 0))


def _compared_dims(ctx: RuleContext) -> list[int]:
    """cosine_similarity compares vectors along its dim (default 1); pairwise_distance and
    cdist along the last dim."""
    if isinstance(ctx.module, nn.CosineSimilarity):
        return [ctx.module.dim]
    if ctx.module is None and node_name(ctx.node) == "cosine_similarity":
        return [ctx.arg(2, "dim", 1)]
    return [-1]


def _every_dim(ctx: RuleContext) -> list[int]:
    return _all_dims(ctx, ctx.arg(0))


def _pad_dims(ctx: RuleContext) -> list[int]:
    """F.pad(x, pad) pads the last len(pad) // 2 dims, except those padded by (0, 0) (LongT5
    spells a pad of one dim as zeros for every dim, the batch dim too); a module's int
    padding pads every spatial dim."""
    pad = ctx.module.padding if ctx.module is not None else ctx.arg(1, "pad", ctx.arg(1, "padding"))
    if isinstance(pad, int):
        n = _spatial_of(ctx) or 1
        return list(range(-n, 0))
    if not isinstance(pad, (tuple, list)):  # a node holding the list: assume every dim
        return _all_dims(ctx, ctx.arg(0, "input"))
    return [-1 - k for k in range(len(pad) // 2)
            if not (_is_zero(ctx, pad[2 * k]) and _is_zero(ctx, pad[2 * k + 1]))]


def _is_zero(ctx: RuleContext, value: Any) -> bool:
    """A constant 0, or a batch-free number that is 0 (export's SymInt arithmetic)."""
    if isinstance(value, fx.Node):
        info = ctx.info(value)
        return isinstance(ctx.fact(value), Free) and isinstance(info, ValueInfo) and (
            not info.is_tensor and info.int_a == 0 and info.int_b == 0)
    return isinstance(value, int) and value == 0


def _length(ctx: RuleContext, value: Any) -> int:
    """len() of a shape argument: a list, or a node holding one (``x.shape[-1:]``)."""
    if isinstance(value, (tuple, list)):
        return len(value)
    if isinstance(value, int):
        return 1
    info = ctx.info(value)
    if isinstance(info, tuple):
        return len(info)
    return ctx.ndim(ctx.arg(0, "input"))  # unknown: assume every dim (rejects over the batch)


def _tril_dims(ctx: RuleContext) -> list[int]:
    return [-2, -1]


def _diagonal_dims(ctx: RuleContext) -> list[int]:
    if node_name(ctx.node) == "diag" or node_name(ctx.node) == "trace":
        return _all_dims(ctx, ctx.arg(0, "input"))
    return [ctx.arg(2, "dim1", 0), ctx.arg(3, "dim2", 1)]


def _roll_dims(ctx: RuleContext) -> list[int]:
    d = ctx.arg(2, "dims")
    if d is None or (isinstance(d, (tuple, list)) and not d):
        return _all_dims(ctx, ctx.arg(0, "input"))  # roll of the flattened tensor
    return list(d) if isinstance(d, (tuple, list)) else [d]


def _unfold_dims(ctx: RuleContext) -> list[int]:
    return [ctx.arg(1, "dimension")]


def _flip_dims(ctx: RuleContext) -> list[int]:
    d = ctx.arg(1, "dims")
    return list(d) if isinstance(d, (tuple, list)) else [d]



def channels_first(spatial: int | None, what: str, *, input_index: int = 0,
                   input_name: str = "input", extra: Sequence[tuple[int, str]] = ()) -> Rule:
    """(N, C, *spatial) ops (conv, pooling, upsampling, GroupNorm): the batch must be N.

    ``spatial`` is the number of spatial dims when the op fixes it (``Conv2d``: 2;
    ``None``: read it off the op's name, ``max_pool2d``; 0: any): a 3-d input to a
    2-d conv is unbatched (C, H, W), so its dim 0 is channels, not samples.
    """

    def rule(ctx: RuleContext) -> Fact:
        for index, name in ((input_index, input_name), *extra):
            value = ctx.arg(index, name)
            fact = ctx.fact(value)
            if not isinstance(fact, Batched):
                continue
            ndim = ctx.ndim(value)
            n = spatial if spatial is not None else _spatial_of(ctx)
            n = None if n == 0 else n
            if fact.dim != 0 or (n is not None and ndim != n + 2):
                expected = f"{n + 2}-d (N, C, ...)" if n is not None else "(N, C, ...)"
                ctx.mix(f"it {what} a {ndim}-d input whose batch dim is {fact.dim}; it treats "
                        f"only dim 0 of a {expected} input as samples, so here the batch is "
                        "mixed in as channels or space",
                        "move the batch dim first (x.movedim(d, 0)) and pass a batched "
                        f"{expected} input")
        return per_sample(ctx)

    return rule


def _spatial_of(ctx: RuleContext) -> int | None:
    """Spatial dims of a module or functional (N, C, ...) op, when its name tells them."""
    name = type(ctx.module).__name__ if ctx.module is not None else node_name(ctx.node)
    for n in (1, 2, 3):
        if f"{n}d" in name.lower():
            return n
    return None


def reduction(kind: str = "sum", partial: Callable[..., Any] | None = None, *,
              nonlinear: bool | str = False,
              dims: Callable[[RuleContext], Sequence[int]] | None = None) -> Rule:
    """Sum/mean-style reductions: over the batch dim they become a ``ReductionSpec``.

    ``nonlinear`` marks a reduction (max, var, ...) that is rejected over the batch
    dim, named in the message by the op's own name (``True``) or by the string given.
    ``torch.max(a, b)`` (two tensors) is elementwise.
    """
    get_dims = dims or _dim_arg(1, "dim")

    def rule(ctx: RuleContext) -> Fact:
        other = (node_name(ctx.node) if nonlinear is True else nonlinear) or ""
        x = ctx.arg(0, "input")
        second = ctx.arg(1, "other")
        if other in ("max", "min") and ctx.is_tensor(second):
            return pointwise(ctx)  # torch.max(a, b): elementwise maximum
        fact = ctx.fact(x)
        if isinstance(fact, Reduced):
            if other:
                ctx.mix(f"it takes the {other} of a reduction over the batch, which is not "
                        "linear in the samples", "reduce each sample first")
            return fact  # summing / averaging the remaining dims is linear
        if not isinstance(fact, Batched):
            return per_sample(ctx)
        ndim = ctx.ndim(x)
        if fact.dim not in {d % ndim for d in get_dims(ctx)}:
            return per_sample(ctx)
        if other:
            ctx.mix(f"it takes the {other} over the batch dim, which couples samples "
                    "non-linearly (the result of a microbatch is not a part of the batch's)",
                    f"take the {other} over the non-batch dims only")
        ctx.node.meta[REDUCTION] = ReductionSpec(kind, partial)
        return Reduced(count=not ctx.node.meta.get(PARAMS, True))

    return rule


def loss_rule(ctx: RuleContext) -> Fact:
    """A loss of ``partials.LOSSES``: per-sample with reduction='none', else a reduction
    over the batch ('sum': a partial sum; 'mean': a (sum, count) pair)."""
    loss = partials.loss_for(ctx.module if ctx.module is not None else ctx.node.target)
    if loss is None:
        raise TypeError(f"{node_name(ctx.node)} is not a loss of partials.LOSSES")
    if ctx.module is not None:
        mode, partial = ctx.module.reduction, partials.module_loss_partial
    elif is_aten(ctx.node.target):
        mode, partial = _aten_reduction(ctx), loss.aten_partials[rule_key(ctx.node.target)]
    else:
        mode, partial = partials.loss_reduction(loss.fn, ctx._args, ctx._kwargs), loss.partial
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return pointwise(ctx)
    batched = _batched(facts)
    if not batched:
        return _join(facts, ctx)
    if loss.kind.n_first and any(f.dim != 0 for f in batched):
        ctx.mix("its batch dim is not dim 0 (the N of (N, C, ...)), so the loss "
                "would treat samples as classes",
                "move the batch dim to dim 0 (x.movedim(d, 0)) before the loss")
    if mode == "none":
        return ctx.batched_out()
    ctx.node.meta[REDUCTION] = ReductionSpec("sum" if mode == "sum" else "mean",
                                             None if mode == "sum" else partial)
    return Reduced()


def _aten_reduction(ctx: RuleContext) -> str:
    """An ATen loss's ``reduction`` (0 none, 1 mean, 2 sum) as the string."""
    schema = ctx.node.target._schema
    names = [a.name for a in schema.arguments]
    value = ctx.arg(names.index("reduction"), "reduction", 1)
    return {0: "none", 1: "mean", 2: "sum"}[int(value)]


def reshape_rule(ctx: RuleContext) -> Fact:
    """view/reshape/flatten: the batch dim must stay a batch-major (or B-innermost) block."""
    x = ctx.arg(0, "input")
    fact = ctx.fact(x)
    if not isinstance(fact, Batched):
        return linear(ctx)
    info_in, info_out = ctx.info(x), ctx.info()
    out = ctx.batched_out(major=True)
    assert isinstance(out, Batched)
    major = True
    for shape_in, shape_out in ((info_in.shape_a, info_out.shape_a),
                                (info_in.shape_b, info_out.shape_b)):
        outer_in = math.prod(shape_in[:fact.dim]) * (1 if fact.major else fact.factor)
        outer_out = math.prod(shape_out[:out.dim])
        if outer_out == outer_in:
            major = True
        elif outer_out * out.factor == outer_in:
            major = False
        else:
            ctx.mix(f"it reshapes {tuple(info_in.shape_a)} to {tuple(info_out.shape_a)} at "
                    f"batch {ctx.gbs}, mixing rows of different samples (or baking in the "
                    "batch size)",
                    "keep the batch dim leading, e.g. x.view(x.size(0), -1), and use -1 or "
                    "x.size(0) instead of a constant batch size")
    return Batched(out.dim, out.factor, major or out.factor == 1)


def squeeze_rule(ctx: RuleContext) -> Fact:
    """squeeze() / squeeze(d): at the full batch the batch dim has B > 1 rows, so it is
    never squeezed, but a microbatch of one sample would lose it. The node is specialised
    to the dims it drops at the full batch: (B, 1, C).squeeze() -> squeeze((1,)),
    (B, C).squeeze(0) -> squeeze(()), the identity."""
    x = ctx.arg(0, "input")
    fact, info = ctx.fact(x), ctx.info(x)
    if not isinstance(fact, Batched) or not isinstance(info, ValueInfo):
        return per_sample(ctx)
    dims = ctx.arg(1, "dim")
    named = list(range(info.ndim)) if dims is None else (
        list(dims) if isinstance(dims, (tuple, list)) else [dims])
    if not all(isinstance(d, int) for d in named):
        ctx.mix("it squeezes dims computed at run time, which may include the batch dim "
                "of a 1-sample microbatch", "squeeze constant dims: x.squeeze(-1)")
    if info.shape_a[fact.dim] == 1:
        ctx.mix(f"at the full batch of {ctx.gbs} it drops the batch dim itself",
                "squeeze only size-1 non-batch dims: x.squeeze(-1)")
    named = [d % info.ndim for d in named]
    if dims is None or fact.dim in named:  # what a microbatch of one would squeeze differs
        dropped = tuple(d for d in named if info.shape_a[d] == 1)
        target = ctx.node.target
        if is_aten(target):  # aten.squeeze.default / .dim -> aten.squeeze.dims
            target = rule_key(target).dims
        ctx.specialise((x, list(dropped) if is_aten(target) else dropped), target=target)
    return per_sample(ctx)


def repeat_rule(ctx: RuleContext) -> Fact:
    """x.repeat(r0, r1, ...): copies along the batch dim are interleaved, not batch-major."""
    x = ctx.arg(0, "input")
    fact = ctx.fact(x)
    out = per_sample(ctx)
    if not isinstance(fact, Batched) or not isinstance(out, Batched) or out.factor == 1:
        return out
    return dataclasses.replace(out, major=False)  # [x0..xB, x0..xB]: sample rows are apart


def _index_entries(ctx: RuleContext, index: Any, ndim: int) -> list[tuple[int, Any]]:
    """``(input dim, entry)`` for each entry of a Python index that consumes input dims."""
    entries = list(index) if isinstance(index, (tuple, list)) else [index]

    def width(e: Any) -> int:
        if e is None or e is Ellipsis:
            return 0
        info = ctx.info(e)
        if isinstance(info, ValueInfo) and info.is_tensor and info.dtype == torch.bool:
            return max(info.ndim, 1)
        return 1

    used = sum(width(e) for e in entries)
    out: list[tuple[int, Any]] = []
    dim = 0
    for e in entries:
        if e is Ellipsis:
            dim += ndim - used
            continue
        w = width(e)
        for k in range(w):
            out.append((dim + k, e))
        dim += w
    return out


def _check_tensor_index(ctx: RuleContext, source: Any, by_dim: dict[int, Any]) -> None:
    """Indexing ``source`` with tensors: the batch dim may only be indexed by positions."""
    fact = ctx.fact(source)
    for dim, idx in by_dim.items():
        ifact = ctx.fact(idx)
        if not (isinstance(idx, fx.Node) and ctx.is_tensor(idx)):
            continue
        if isinstance(fact, Batched) and dim == fact.dim:
            if isinstance(ifact, Batched) and ifact.positions and ifact.factor == fact.factor \
                    and fact.major:
                continue  # x[arange(B)]: each sample picks itself
            ctx.mix("it selects rows of the batch dim with an index tensor (x[idx] along "
                    "the batch): sample i of the output can come from any sample",
                    "index only the non-batch dims; to pick one row per sample use "
                    "x[torch.arange(x.size(0)), idx] or torch.gather along a feature dim")
        if isinstance(ifact, Batched) and ifact.positions:
            ctx.mix("it indexes a batch-free tensor with sample positions (table[arange(B)]): "
                    "positions restart at 0 in every microbatch",
                    "index batch-free tables with per-sample data (ids), not with positions")


@_handles_positions
def getitem_rule(ctx: RuleContext) -> Fact:
    """``x[i]`` on tuples picks a fact; on tensors the batch dim must stay whole."""
    container, index = ctx.arg(0), ctx.arg(1)
    fact = ctx.fact(container)
    if isinstance(fact, Container):
        if isinstance(index, slice):  # x.shape[-1:]: the items it keeps, renumbered
            kept = [f for _, f in fact.items][index]
            return Container(tuple(enumerate(kept)))
        return fact.get(index)
    info_in = ctx.info(container)
    if isinstance(info_in, tuple):  # a tuple-valued op without per-piece facts
        return _join([fact], ctx) if not isinstance(fact, Batched) else ctx.batched_out()
    if isinstance(info_in, ValueInfo) and not info_in.is_tensor:
        return _int_fact(ctx)  # x.shape[0], size()[1]
    entries = _index_entries(ctx, index, ctx.ndim(container))
    tensors = {d: e for d, e in entries if isinstance(e, fx.Node) and ctx.is_tensor(e)}
    _check_tensor_index(ctx, container, tensors)
    out = per_sample(ctx)
    if (isinstance(fact, Batched) and fact.positions and not tensors
            and isinstance(out, Batched) and out.factor == fact.factor):
        return dataclasses.replace(out, positions=True)  # pos[:, None]
    return out


@_handles_positions
def aten_index_rule(ctx: RuleContext) -> Fact:
    """aten.index(x, [i0, i1, ...]): advanced indexing, entry k indexes dim k (None: all)."""
    source, indices = ctx.arg(0, "input"), ctx.arg(1, "indices") or []
    by_dim: dict[int, Any] = {}
    dim = 0
    for idx in indices:
        info = ctx.info(idx)
        width = info.ndim if isinstance(info, ValueInfo) and info.dtype == torch.bool else 1
        for k in range(width):
            by_dim[dim + k] = idx
        dim += width
    _check_tensor_index(ctx, source, {d: i for d, i in by_dim.items() if i is not None})
    return per_sample(ctx)


def _dim_of(ctx: RuleContext, value: Any, d: Any) -> int | None:
    ndim = ctx.ndim(value)
    return d % ndim if isinstance(d, int) and ndim else None


@_handles_positions
def index_select_rule(ctx: RuleContext) -> Fact:
    """index_select(x, dim, idx): along the batch dim only with arange(B) (identity)."""
    source, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d = _dim_of(ctx, source, dim)
    _check_tensor_index(ctx, source, {d: idx} if d is not None else {})
    return per_sample(ctx)


@_handles_positions
def gather_rule(ctx: RuleContext) -> Fact:
    """gather/scatter/take_along_dim along a non-batch dim, index batched like the input.

    ``out[i][j] = x[i][idx[i][j]]`` (dim 1) stays in sample i when x and idx share
    the batch dim; along the batch dim it reads other samples.
    """
    name = node_name(ctx.node)
    if name == "take_along_dim":
        source, idx, dim = ctx.arg(0, "input"), ctx.arg(1, "indices"), ctx.arg(2, "dim")
    else:
        source, dim, idx = ctx.arg(0, "input"), ctx.arg(1, "dim"), ctx.arg(2, "index")
    d = _dim_of(ctx, source, dim)
    fact, ifact = ctx.fact(source), ctx.fact(idx)
    if isinstance(fact, Batched) and d == fact.dim and not (
            isinstance(ifact, Batched) and ifact.positions):
        ctx.mix(f"it {'writes' if 'scatter' in name or 'index_' in name else 'reads'} along "
                "the batch dim with an index tensor, so a sample's output comes from (or goes "
                "to) other samples",
                "gather and scatter along a non-batch dim")
    if isinstance(ifact, Batched) and ifact.positions:
        ctx.mix("it uses sample positions (torch.arange(B)) as gather/scatter indices; "
                "positions restart at 0 in every microbatch", "gather with per-sample data")
    if isinstance(ifact, Batched) and isinstance(fact, Batched) and ifact.dim != fact.dim:
        ctx.mix(f"its index has the batch at dim {ifact.dim} but the input at dim {fact.dim}, "
                "so the index of one sample reads another sample's row",
                "give the index the input's batch dim")
    if isinstance(ifact, Batched) and not isinstance(fact, Batched) and ifact.dim != d \
            and ctx.is_tensor(source) and ctx.ndim(source) > 1:
        ctx.mix("it reads row i of a batch-free tensor for sample i (its index has the batch "
                "along a dim it does not gather), a position-dependent value",
                "expand the batch-free tensor to the batch first, or gather along the "
                "index's batch dim")
    return per_sample(ctx)


@_handles_positions
def index_put_rule(ctx: RuleContext) -> Fact:
    """index_put(x, indices, values) (``x[idx] = v``): the batch dim by a mask or positions."""
    source, indices = ctx.arg(0, "input"), ctx.arg(1, "indices") or []
    fact = ctx.fact(source)
    dim = 0
    for idx in indices:
        info = ctx.info(idx)
        width = info.ndim if isinstance(info, ValueInfo) and info.dtype == torch.bool else 1
        ifact = ctx.fact(idx)
        if isinstance(fact, Batched) and dim <= fact.dim < dim + width and idx is not None:
            aligned = isinstance(ifact, Batched) and (
                ifact.positions or (width > 1 and ifact.dim == fact.dim - dim))
            if not aligned:
                ctx.mix("it writes into rows of the batch dim chosen by an index tensor, so "
                        "one sample's values can land in another sample",
                        "assign with a per-sample mask: torch.where(mask, v, x)")
        dim += width
    return per_sample(ctx)


def copy_rule(ctx: RuleContext) -> Fact:
    """copy(self, src): src's values broadcast into self's shape and dtype, the functional
    form of ``x.copy_(y)`` and ``x[...] = y``. Only the values of src reach the result, so
    it is per-sample as src is (in self's layout when src is batch-free); a reduction
    copied into a batch-free tensor stays a reduction (the copy is linear)."""
    src = ctx.arg(1, "src")
    sfact = ctx.fact(src)
    if isinstance(sfact, Batched):
        # broadcasting cannot resize src's batch dim: it lands on the output's one batch dim
        return ctx.batched_out(major=sfact.major)
    return linear(ctx)


def _number_at(ctx: RuleContext, value: Any, batch: int) -> int | None:
    """An int argument (a constant or export's SymInt node) at batch gbs (0) or gbs + 1 (1)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    info = ctx.info(value)
    if isinstance(info, ValueInfo) and not info.is_tensor:
        return info.int_a if batch == 0 else info.int_b
    return None


def _whole_slice(ctx: RuleContext, value: Any, dim: int, start: Any, end: Any,
                 step: Any) -> bool:
    """Whether ``value[start:end:step]`` along ``dim`` keeps every row at both batch sizes
    (``x[0:B]``, ``x[:]``, ``x[0:sys.maxsize]``): then a write there replaces the whole dim."""
    info = ctx.info(value)
    if not isinstance(info, ValueInfo) or not info.is_tensor:
        return False
    for batch, shape in enumerate((info.shape_a, info.shape_b)):
        size = shape[dim]
        first = 0 if start is None else _number_at(ctx, start, batch)
        last = size if end is None else _number_at(ctx, end, batch)
        stride = 1 if step is None else _number_at(ctx, step, batch)
        if first is None or last is None or stride != 1:
            return False
        first, last = (first + size if first < 0 else first), (last + size if last < 0 else last)
        if first > 0 or last < size:
            return False
    return True


def _scatter_into(name: str, src_dims: Callable[[RuleContext, int], list[int]],
                  written: Callable[[RuleContext, Batched, int], str | None]) -> Rule:
    """``<op>_scatter(self, src, ...)``: self with src written into a region of it (the
    functional form of ``x[region] = src``). Per-sample when every sample's part of src
    lands in that sample's rows of self: src's batch dim must map onto self's (with the
    same rows per sample and order), and the region must not pick rows of the batch dim.

    ``src_dims(ctx, ndim)`` lists, for each dim of src, the dim of self it lands on;
    ``written(ctx, fact, ndim)`` says how the write picks rows of self's batch dim
    ``fact.dim`` (a reason to reject), or None when it leaves that dim whole.
    """

    def rule(ctx: RuleContext) -> Fact:
        dst, src = ctx.arg(0, "input"), ctx.arg(1, "src")
        dfact, sfact = ctx.fact(dst), ctx.fact(src)
        ndim = ctx.ndim(dst)
        fact = dfact if isinstance(dfact, Batched) else None
        if isinstance(sfact, Batched):
            lands = src_dims(ctx, ndim)[sfact.dim] if sfact.dim < ctx.ndim(src) else None
            moved = dataclasses.replace(sfact, dim=lands if lands is not None else -1)
            if fact is not None and (moved.dim, moved.factor, moved.major) != (
                    fact.dim, fact.factor, fact.major):
                ctx.mix(f"it writes a tensor whose batch dim ({sfact}) lands on dim "
                        f"{moved.dim} of a tensor batched as {fact}, so one sample's values "
                        "go into another sample's rows",
                        f"give the written value the batch dim of the tensor it is written "
                        f"into ({name} keeps dims in place)")
            fact = fact or moved
        if fact is not None and fact.dim >= 0:
            reason = written(ctx, fact, ndim)
            if reason is not None:
                ctx.mix(f"{reason}, so which samples receive the values depends on where a "
                        "microbatch starts",
                        "write along a non-batch dim (x[:, 1:] = y), or into every sample "
                        "with a per-sample mask: torch.where(mask, y, x)")
        return per_sample(ctx)

    return rule


def _dim_at(ctx: RuleContext, index: int, name: str, ndim: int, default: int = 0) -> int:
    d = ctx.arg(index, name, default)
    return d % ndim if isinstance(d, int) and ndim else -1


def _slice_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """slice_scatter(self, src, dim, start, end, step): rows start:end:step of dim."""
    dim = _dim_at(ctx, 2, "dim", ndim)
    if dim != fact.dim or _whole_slice(ctx, ctx.arg(0, "input"), dim, ctx.arg(3, "start"),
                                       ctx.arg(4, "end"), ctx.arg(5, "step")):
        return None
    return f"it writes into a slice of the batch dim (x[start:end] = y along dim {dim})"


def _select_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """select_scatter(self, src, dim, index): the one row ``index`` of dim."""
    if _dim_at(ctx, 2, "dim", ndim) != fact.dim:
        return None
    return f"it writes into row {ctx.arg(3, 'index')} of the batch dim (x[i] = y)"


def _diagonal_written(ctx: RuleContext, fact: Batched, ndim: int) -> str | None:
    """diagonal_scatter(self, src, offset, dim1, dim2): the diagonal of dims dim1, dim2."""
    if fact.dim not in (_dim_at(ctx, 3, "dim1", ndim), _dim_at(ctx, 4, "dim2", ndim, 1)):
        return None
    return "it writes the diagonal of a pair of dims that includes the batch dim"


def _same_dims(ctx: RuleContext, ndim: int) -> list[int]:
    return list(range(ndim))  # slice_scatter: src has self's dims


def _all_but_selected(ctx: RuleContext, ndim: int) -> list[int]:
    dim = _dim_at(ctx, 2, "dim", ndim)
    return [d for d in range(ndim) if d != dim]  # select_scatter: src lacks the selected dim


def _diagonal_src_dims(ctx: RuleContext, ndim: int) -> list[int]:
    pair = (_dim_at(ctx, 3, "dim1", ndim), _dim_at(ctx, 4, "dim2", ndim, 1))
    return [d for d in range(ndim) if d not in pair] + [-1]  # the diagonal goes last


slice_scatter_rule = _scatter_into("slice_scatter", _same_dims, _slice_written)
select_scatter_rule = _scatter_into("select_scatter", _all_but_selected, _select_written)
diagonal_scatter_rule = _scatter_into("diagonal_scatter", _diagonal_src_dims,
                                      _diagonal_written)


def masked_scatter_rule(ctx: RuleContext) -> Fact:
    """masked_scatter(self, mask, source): the masked positions of self, in row-major order
    over the whole tensor, take source's elements one after another. Over a batched self
    the element a sample takes depends on how many positions earlier samples mask."""
    facts = ctx.arg_facts()
    if _has_batched(facts):
        ctx.mix("it fills the masked positions with source's elements in order over the whole "
                "batch, so the values sample i receives depend on how many positions the "
                "samples before it mask (and a microbatch starts again at source's first "
                "element)",
                "give the values the shape of the tensor and select with the mask: "
                "torch.where(mask, values, x)")
    return _join(facts, ctx)


@_handles_positions
def arange_rule(ctx: RuleContext) -> Fact:
    """torch.arange(B): each sample's position in its batch (0, 1, ..., B-1)."""
    args = [a for a in ctx._args]
    start = ctx._kwargs.get("start", args[0] if len(args) >= 2 else 0)
    end = ctx._kwargs.get("end", args[1] if len(args) >= 2 else (args[0] if args else None))
    step = ctx._kwargs.get("step", args[2] if len(args) >= 3 else 1)
    facts = [ctx.fact(v) for v in (start, end, step)]
    if not any(isinstance(f, (BatchSize, Batched, Reduced)) for f in facts):
        return Free()
    efact = ctx.fact(end)
    if (isinstance(efact, BatchSize) and efact.multiple and ctx.fact(start) == Free()
            and start == 0 and step == 1):
        out = ctx.batched_out(major=True)
        if isinstance(out, Batched):
            return dataclasses.replace(out, positions=True)
    ctx.mix("it builds a range from the batch size that is not 0..B-1 (a start, step or "
            "end that is not a whole batch), which changes with every microbatch",
            "use torch.arange(x.size(0)) to index samples, or sizes of non-batch dims")


@_handles_positions
def size_rule(ctx: RuleContext) -> Fact:
    """x.size(d) / x.shape / numel: ints (or tuples) that may be multiples of the batch size."""
    info = ctx.info()
    if isinstance(info, tuple):
        return Container(tuple((i, _int_of(v, ctx)) for i, v in enumerate(info)))
    return _int_fact(ctx)


def read_value_rule(ctx: RuleContext) -> Fact:
    """x.item() / x.tolist(): Python values read out of batched data."""
    ctx.mix("it reads tensor values into Python (.item(), .tolist()), so what follows depends "
            "on the data of the whole batch (or of one microbatch), not on shapes",
            "keep the computation in tensors: use torch.where or a mask instead of Python "
            "branches and numbers")


def _int_of(info: Any, ctx: RuleContext) -> Fact:
    return _number_fact(info, ctx) if isinstance(info, ValueInfo) else Free()


@_handles_positions
def getattr_rule(ctx: RuleContext) -> Fact:
    """getattr(x, name): ``.shape`` ints, ``.values``/``.indices`` of a namedtuple result."""
    obj, name = ctx.arg(0), ctx.arg(1)
    fact = ctx.fact(obj)
    info = ctx.info(obj)
    if isinstance(fact, Container):
        fields = getattr(info, "fields", None) or ("values", "indices")
        if name in fields:
            return fact.get(fields.index(name))
    if name in ("shape", "ndim", "dtype", "device", "is_cuda", "layout", "requires_grad"):
        return size_rule(ctx)
    if name in ("T", "mT", "H", "mH", "real", "imag", "data"):
        return per_sample(ctx)
    return size_rule(ctx)


def _value_arg(index: int | None, name: str | None = None, *, like_self: bool = True) -> Rule:
    """Creation ops: shaped by the batch at most; the fill value must not be a batch size.

    ``like_self=False``: ``x.new_zeros(size)`` and kin take only dtype and device from
    ``x``, so a batched ``x`` does not make them batched; their size arguments do.
    """

    @_handles_positions
    def rule(ctx: RuleContext) -> Fact:
        if index is not None:
            value = ctx.arg(index, name)
            vfact = ctx.fact(value)
            if isinstance(vfact, BatchSize) or (
                    isinstance(vfact, Batched) and vfact.positions):
                ctx.mix("it fills a tensor with the batch size or sample positions, which "
                        "are the microbatch's inside the loop",
                        "use the batch size only for shapes")
        facts = ctx.arg_facts() if like_self else _facts_after_self(ctx)
        out = _join(facts, ctx)  # reductions pass through (linear)
        if isinstance(out, Batched) and out.positions:
            out = dataclasses.replace(out, positions=False)
        return out

    return rule


def _facts_after_self(ctx: RuleContext) -> list[Fact]:
    """Facts of every argument but ``self`` (a method's tensor, ATen's ``self``)."""
    out: list[Fact] = []
    rest = (ctx._args[1:], {k: v for k, v in ctx._kwargs.items() if k not in ("self", "input")})
    fx.node.map_arg(rest, lambda n: out.append(ctx.facts[n]))
    return out


size_like_rule = _value_arg(None)
new_like_rule = _value_arg(None, like_self=False)
new_full_rule = _value_arg(2, "fill_value", like_self=False)
new_tensor_rule = _value_arg(1, "data", like_self=False)


def matmul_rule(ctx: RuleContext) -> Fact:
    """a @ b: fine while the batch dim is a batch (not a contracted) dim of each side."""
    name = node_name(ctx.node)
    first = 1 if name in ("addmm", "baddbmm", "addbmm", "addmv", "addr") else 0
    a, b = ctx.arg(first, "mat1"), ctx.arg(first + 1, "mat2")
    _check_batch_not_in(ctx, a, [-1], "contracts",
                        "put the batch dim before the contracted (last) dim of the left side")
    if ctx.ndim(b) >= 2:
        _check_batch_not_in(ctx, b, [-2], "contracts",
                            "put the batch dim outside the contracted dim of the right side")
    if name == "addbmm":
        _check_batch_not_in(ctx, a, [0], "sums the products over")
    return per_sample(ctx)


def chunk_rule(ctx: RuleContext) -> Fact:
    """split/chunk/unbind along a non-batch dim: every piece keeps the batch dim."""
    x = ctx.arg(0, "input")
    name = node_name(ctx.node)
    dim = ctx.arg(1, "dim", 0) if name == "unbind" else ctx.arg(2, "dim", 0)
    _check_batch_not_in(ctx, x, [dim], "splits", "split along a non-batch dim")
    fact = ctx.fact(x)
    if not isinstance(fact, Batched):
        return _join(ctx.arg_facts(), ctx)
    out = ctx.batched_out()
    if isinstance(out, Container):
        return Container(tuple((i, dataclasses.replace(f, factor=fact.factor, major=fact.major)
                                if isinstance(f, Batched) else f) for i, f in out.items))
    return out


def _pieces(ctx: RuleContext, tensors: Any) -> list[tuple[Fact, int]]:
    """(fact, ndim) of each tensor in a list argument, or in a node holding a tuple."""
    if isinstance(tensors, fx.Node):  # torch.stack(x.unbind(1))
        fact, info = ctx.fact(tensors), ctx.info(tensors)
        facts = [f for _, f in fact.items] if isinstance(fact, Container) else []
        ndims = [i.ndim if isinstance(i, ValueInfo) else 0 for i in info or ()]
        return list(zip(facts, ndims))
    return [(ctx.fact(t), ctx.ndim(t)) for t in tensors or ()]


def cat_rule(ctx: RuleContext) -> Fact:
    """cat/stack: per-sample tensors joined along a non-batch dim."""
    name = node_name(ctx.node)
    dim = ctx.arg(1, "dim", 0)
    for fact, ndim in _pieces(ctx, ctx.arg(0, "tensors")):
        if name in ("hstack", "column_stack"):
            dims = [1] if ndim > 1 else [0]
        elif name in ("vstack", "row_stack"):
            dims = [0]
        elif name == "dstack":
            dims = [2] if ndim > 2 else []
        elif name in ("cat", "concat", "concatenate"):
            dims = [dim]
        else:
            continue  # stack: a new dim, the shapes check the rest
        if isinstance(fact, Batched) and ndim and fact.dim in {d % ndim for d in dims}:
            ctx.mix(f"it concatenates along dim {fact.dim}, which is the batch dim",
                    "concatenate along a non-batch dim (torch.cat(xs, dim=1))")
    return per_sample(ctx)  # batch-free pieces along a feature dim are fine: shapes tell



def batch_norm_rule(ctx: RuleContext) -> Fact:
    """BatchNorm: eval mode uses running statistics (per-sample); training mixes."""
    mod = ctx.module
    if mod is not None:
        uses_batch_stats = mod.training or not mod.track_running_stats
    elif node_name(ctx.node).endswith("no_training"):  # aten._native_batch_norm_legit_no_training
        uses_batch_stats = False
    else:  # F.batch_norm(x, mean, var, w, b, training), aten.batch_norm(x, w, b, mean, var, ...)
        mean_at = 3 if is_aten(ctx.node.target) else 1
        uses_batch_stats = bool(ctx.arg(5, "training", False)) or (
            ctx.arg(mean_at, "running_mean") is None)
    x = ctx.arg(0, "input")
    if uses_batch_stats and isinstance(ctx.fact(x), Batched):
        ctx.mix("BatchNorm in training mode normalises each channel with the mean and "
                "variance of the whole batch, so every sample's output depends on every "
                "other sample",
                "replace it with GroupNorm or LayerNorm (per-sample statistics)",
                "put it in eval mode (model.eval(), or the BatchNorm module's .eval()) to "
                "use its running statistics")
    return channels_first(0, "normalises")(ctx)


def instance_norm_rule(ctx: RuleContext) -> Fact:
    """InstanceNorm: per sample, but updating running stats in training averages samples."""
    mod = ctx.module
    if mod is not None:
        tracking = mod.training and mod.track_running_stats
    else:
        tracking = ctx.arg(1, "running_mean") is not None and bool(
            ctx.arg(5, "use_input_stats", True))
        if is_aten(ctx.node.target):  # aten.instance_norm(x, w, b, mean, var, use_input_stats)
            tracking = ctx.arg(3, "running_mean") is not None and bool(
                ctx.arg(5, "use_input_stats", True))
    if tracking and isinstance(ctx.fact(ctx.arg(0, "input")), Batched):
        ctx.mix("InstanceNorm with track_running_stats updates its running statistics with "
                "an average over the batch",
                "set track_running_stats=False, or use eval mode")
    return channels_first(0, "normalises")(ctx)


def sdpa_rule(ctx: RuleContext) -> Fact:
    """scaled_dot_product_attention: (..., L, E) inputs; the batch must be a leading dim."""
    for i, name in enumerate(("query", "key", "value", "attn_mask")):
        _check_batch_not_in(ctx, ctx.arg(i, name), [-1, -2], "attends",
                            "keep the batch in a leading dim: (B, heads, L, E)")
    return per_sample(ctx)


def _batch_first(ctx: RuleContext) -> bool:
    """A sequence layer's batch_first: its own, its first attention layer's (transformer
    stacks), or ATen's argument (``aten.lstm.input(input, hx, params, has_biases, layers,
    dropout, train, bidirectional, batch_first)``)."""
    mod = ctx.module
    if mod is None:
        return bool(ctx.arg(8, "batch_first", False))
    if hasattr(mod, "batch_first"):
        return bool(mod.batch_first)
    attn = next((m for m in mod.modules() if isinstance(m, nn.MultiheadAttention)), None)
    return bool(attn.batch_first) if attn is not None else False


def _check_batch_first(ctx: RuleContext, inputs: Sequence[tuple[int, str]],
                       consequence: str) -> None:
    """A 3-d input of a sequence layer must have its batch dim where batch_first says."""
    want = 0 if _batch_first(ctx) else 1
    for index, name in inputs:
        value = ctx.arg(index, name)
        f = ctx.fact(value)
        if isinstance(f, Batched) and ctx.ndim(value) == 3 and f.dim != want:
            ctx.mix(f"its batch dim is {want} (batch_first={want == 0}) but the input's batch "
                    f"dim is {f.dim}, so {consequence}",
                    "pass inputs with the batch dim where the layer expects it (or set "
                    "batch_first to match)")


def multihead_attention_rule(ctx: RuleContext) -> Fact:
    """nn.MultiheadAttention: per-sample along its batch dim (0 if batch_first else 1)."""
    _check_batch_first(ctx, ((0, "query"), (1, "key"), (2, "value")),
                       "samples would attend to each other")
    mask = ctx.arg(4, "attn_mask")
    mfact = ctx.fact(mask)
    if isinstance(mfact, Batched) and ctx.ndim(mask) == 2:
        ctx.mix("its 2-d attn_mask grows with the batch, so it would pair samples",
                "pass a per-sample mask as (B * num_heads, L, S) or key_padding_mask (B, S)")
    return per_sample(ctx)


def rnn_rule(ctx: RuleContext) -> Fact:
    """RNN/LSTM/GRU: per sample along dim 0 (batch_first) or 1; hidden states carry dim 1."""
    _check_batch_first(ctx, ((0, "input"),),
                       "it would run over samples as if they were time steps")
    x, hx = ctx.arg(0, "input"), ctx.arg(1, "hx")
    states = list(hx) if isinstance(hx, (tuple, list)) else [hx]
    xfact = ctx.fact(x)
    for s in states:
        sf = ctx.fact(s) if isinstance(s, fx.Node) else Free()
        for f in ([g for _, g in sf.items] if isinstance(sf, Container) else [sf]):
            if isinstance(f, Batched) and f.dim != 1:
                ctx.mix(f"its initial hidden state has the batch at dim {f.dim}; RNN states "
                        "are (layers, B, hidden) whatever batch_first says",
                        "pass h0 with the batch at dim 1")
    if ctx.ndim(x) == 2 and isinstance(xfact, Batched):
        ctx.mix("it gets an unbatched (L, features) sequence whose time steps are samples",
                "add the batch dim: (B, L, features) with batch_first=True")
    return per_sample(ctx)


def transformer_layer_rule(ctx: RuleContext) -> Fact:
    """nn.Transformer*Layer: like MultiheadAttention, per sample along its batch dim."""
    _check_batch_first(ctx, ((0, "src"), (1, "tgt"), (2, "memory")),
                       "samples would attend to each other")
    for name in ("mask", "src_mask", "tgt_mask", "memory_mask"):
        m = ctx._kwargs.get(name)
        if isinstance(ctx.fact(m), Batched) and ctx.ndim(m) == 2:
            ctx.mix(f"its 2-d {name} grows with the batch, so it would pair samples",
                    "pass per-sample masks as key_padding_mask (B, S)")
    return per_sample(ctx)


def embedding_rule(table_index: int, table_name: str = "weight") -> Rule:
    """embedding(ids, table): rows of a batch-free table picked per sample."""
    return along(lambda ctx: [0], "looks up rows", "look up rows of a batch-free table",
                 inputs=((table_index, table_name),))


def embedding_bag_rule(ctx: RuleContext) -> Fact:
    """EmbeddingBag: (B, L) ids pool per sample; flat ids with offsets are one bag list."""
    if ctx.module is not None:  # module(input, offsets=None)
        ids, offsets = ctx.arg(0, "input"), ctx.arg(1, "offsets")
    elif is_aten(ctx.node.target):  # aten.embedding_bag(weight, indices, offsets, ...)
        ids, offsets = ctx.arg(1, "indices"), ctx.arg(2, "offsets")
    else:  # F.embedding_bag(input, weight, offsets=None, ...)
        ids, offsets = ctx.arg(0, "input"), ctx.arg(2, "offsets")
    if offsets is not None and isinstance(ctx.fact(ids), Batched):
        ctx.mix("its bags are given by offsets into one flat index tensor, so the split "
                "points do not follow samples",
                "pass 2-d (B, L) indices (pad with padding_idx) so each row is one bag")
    _check_batch_not_in(ctx, ids, [-1], "pools a bag")
    return per_sample(ctx)


@_handles_positions
def drop_rule(ctx: RuleContext) -> Fact:
    """Ops that produce no value the model uses (asserts, prints): batch-free."""
    return Free()


@_handles_positions
def unit_marker(ctx: RuleContext) -> Fact:
    """An FSDP unit marker hands its values on unchanged: one fact per value."""
    return Container(tuple((i, ctx.fact(v)) for i, v in enumerate(ctx.node.args[1:])))


@_handles_positions
def detach_rule(ctx: RuleContext) -> Fact:
    """detach/alias and the like: the same values (positions stay positions)."""
    x = ctx.arg(0, "input")
    f = ctx.fact(x)
    out = linear(ctx)
    if isinstance(f, Batched) and isinstance(out, Batched) and f.positions:
        return dataclasses.replace(out, positions=True)
    return out



# ---------------------------------------------------------------------------
# Op groups: the spellings of table lines too long to list on the line itself
# ---------------------------------------------------------------------------

UNARY_MATH = spellings(
    "abs", "absolute", "acos", "arccos", "acosh", "asin", "arcsin", "asinh", "atan", "arctan",
    "atanh", "ceil", "cos", "cosh", "deg2rad", "digamma", "erf", "erfc", "erfinv", "exp",
    "exp2", "expm1", "fix", "floor", "frac", "lgamma", "log", "log10", "log1p", "log2", "logit",
    "i0", "nan_to_num", "rad2deg", "reciprocal", "round", "rsqrt", "sgn", "sigmoid", "sign",
    "signbit", "sin", "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "positive",
    "isnan", "isinf", "isfinite", "isposinf", "isneginf", "isreal", "logical_not",
    "bitwise_not", "clamp", "clamp_min", "clamp_max", "clip", "pow", "float_power",
    "conj", "conj_physical", "angle") + [
    "abs_", "ceil_", "clamp_", "clamp_min_", "clamp_max_", "exp_", "floor_", "log_", "pow_",
    "reciprocal_", "round_", "rsqrt_", "sigmoid_", "sqrt_", "tanh_", "trunc_", "nan_to_num_",
    "clip_"]
ACTIVATIONS = spellings(
    "relu", "relu_", "relu6", "gelu", "silu", "mish", "elu", "elu_", "selu", "celu",
    "leaky_relu", "leaky_relu_", "hardtanh", "hardtanh_", "softplus", "softsign",
    "tanhshrink", "hardswish", "hardsigmoid", "logsigmoid", "log_sigmoid", "threshold",
    "hardshrink", "softshrink", "rrelu", "prelu", "_prelu_kernel", "silu_", "hardswish_",
    "hardsigmoid_", "threshold_", "selu_", "celu_", "rrelu_") + _mods(
    "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "ELU", "SELU", "CELU", "LeakyReLU", "Hardtanh",
    "Softplus", "Softsign", "Tanhshrink", "Hardswish", "Hardsigmoid", "LogSigmoid", "Threshold",
    "Hardshrink", "Softshrink", "RReLU", "PReLU", "Sigmoid", "Tanh", "Identity")
DROPOUTS = spellings(
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "feature_dropout", "native_dropout", "dropout_", "alpha_dropout_",
    "feature_dropout_") + _mods(
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")
BINARY = spellings(
    "maximum", "minimum", "fmax", "fmin", "fmod", "remainder", "atan2", "arctan2", "hypot",
    "copysign", "nextafter", "xlogy", "logaddexp", "logaddexp2", "floor_divide", "eq", "ne",
    "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal", "not_equal",
    "isclose", "logical_and", "logical_or", "logical_xor", "bitwise_and", "bitwise_or",
    "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift", "where", "masked_fill",
    "masked_fill_", "lerp", "addcmul", "addcdiv", "heaviside", "bucketize", "polar",
    "complex", "ldexp", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__", "isin")
OPERATORS = [
    operator.floordiv, operator.mod, operator.pow, operator.eq, operator.ne, operator.lt,
    operator.le, operator.gt, operator.ge, operator.and_, operator.or_, operator.invert,
    operator.xor, operator.lshift, operator.rshift, operator.abs, "__eq__", "__ne__", "__lt__",
    "__gt__", "__le__", "__ge__", "__pow__", "__rpow__", "__floordiv__", "__rfloordiv__",
    "__mod__", "__rmod__", "__invert__", "__abs__", "__iand__", "__ior__", "__ixor__", "eq_",
    "ne_", "lt_", "gt_", "le_", "ge_", "logical_not_", "logical_and_", "logical_or_"]
ADDS = [operator.add, operator.iadd, "add", "add_", "__add__", "__radd__", "__iadd__",
        *spellings("add", method=False)]
SUBS = [operator.sub, operator.isub, "sub", "sub_", "__sub__", "__rsub__", "__isub__",
        *spellings("sub", "subtract", "rsub", method=False), "subtract"]
MULS = [operator.mul, operator.imul, "mul", "mul_", "__mul__", "__rmul__", "__imul__",
        "multiply", *spellings("mul", "multiply", method=False)]
DIVS = [operator.truediv, operator.itruediv, "div", "div_", "__truediv__", "__rtruediv__",
        "__itruediv__", "true_divide", "divide",
        *spellings("div", "true_divide", "divide", method=False)]
NEGS = [operator.neg, operator.pos, "neg", "negative", "__neg__", "__pos__",
        *spellings("neg", "negative", method=False)]
CASTS = [
    "float", "double", "half", "bfloat16", "long", "int", "short", "char", "byte", "bool", "to",
    "type", "type_as", "cpu", "cuda", "contiguous", "clone", "requires_grad_", "pin_memory",
    "share_memory_", "float16", "float32",
    *spellings("clone", "_to_copy", "to", "contiguous", "lift_fresh_copy", "_to_dtype",
               "resolve_conj", "resolve_neg", "type_as", method=False)]
DETACHES = ["detach", "detach_", *spellings("detach", "alias", "lift_fresh", "lift",
                                            method=False)]
EXPORT_CHECKS = aten("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
                     "sym_constrain_range_for_size", "_assert_async")
RESHAPES = [
    "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "ravel", nn.Flatten,
    nn.Unflatten, *spellings("reshape", "flatten", "unflatten", "view", "_unsafe_view",
                             "view_copy", "_reshape_alias", "ravel", "view_as", "reshape_as",
                             method=False)]
DIM_MOVES = [
    "permute", "transpose", "transpose_", "t", "swapaxes", "swapdims", "movedim", "moveaxis",
    "unsqueeze", "unsqueeze_", "expand", "expand_as", "broadcast_to", "narrow", "select",
    "slice", "as_strided", "adjoint", "mT", "mH", torch.broadcast_tensors,
    *aten("broadcast_tensors"),
    *spellings("permute", "transpose", "t", "swapaxes", "swapdims", "movedim", "moveaxis",
               "unsqueeze", "expand", "expand_as", "broadcast_to", "narrow", "select", "slice",
               "permute_copy", "transpose_copy", "unsqueeze_copy", "expand_copy", "slice_copy",
               "select_copy", "narrow_copy", "atleast_1d", "atleast_2d", "atleast_3d",
               "numpy_T", "adjoint", "matrix_H", "mT", "mH", method=False)]
SQUEEZES = ["squeeze", "squeeze_", *spellings("squeeze", "squeeze_copy", method=False)]
REPEATS = ["repeat", "tile", *spellings("repeat", "tile", method=False)]
REPEAT_INTERLEAVES = ["repeat_interleave", *spellings("repeat_interleave", method=False)]
FLIPS = ["flip", *spellings("flip", method=False)]
ROLLS = ["roll", *spellings("roll", method=False)]
TRIANGLES = ["tril", "triu", "tril_", "triu_", *spellings("tril", "triu", method=False)]
DIAGONALS = ["diagonal", "diag", "trace", "diagflat",
             *spellings("diagonal", "diag", "trace", "diagflat", method=False)]
UNFOLDS = ["unfold", *spellings("unfold", method=False, functional=False)]
SPLITS = [
    "chunk", "split", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit",
    *spellings("chunk", "split", "unbind", "tensor_split", "split_with_sizes", "hsplit",
               "vsplit", "dsplit", "split_copy", "unbind_copy", method=False)]
JOINS = spellings("cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
                  "column_stack", "row_stack", method=False)
SIZES = ["size", "dim", "numel", "ndimension", "nelement", "stride", "element_size", "__len__",
         len, *spellings("sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "numel",
                         "size", "stride", method=False)]
NUMBERS = [torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not,
           torch.sym_sqrt, math.ceil, math.floor, math.sqrt, math.prod, int, float, abs]
VALUE_READS = ["item", "tolist", *aten("item", "_local_scalar_dense")]
INDEX_SELECTS = ["index_select", *spellings("index_select", method=False)]
GATHERS = [
    "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
    "scatter_reduce_", "take_along_dim", "index_add", "index_add_", "index_fill", "index_fill_",
    "index_copy", "index_copy_", "index_reduce",
    *spellings("gather", "scatter", "scatter_add", "scatter_reduce", "take_along_dim",
               "index_add", "index_fill", "index_reduce", "index_copy", method=False)]
SEARCHES = [torch.searchsorted, *aten("searchsorted")]
INDEX_PUTS = ["index_put", "index_put_",
              *spellings("index_put", "_index_put_impl", "_unsafe_index_put", method=False)]
CREATIONS = [
    "zero_", "zeros_like", "ones_like", "empty_like", "rand_like", "randn_like",
    "randint_like", "normal_", "uniform_", "bernoulli_", "random_", "exponential_",
    *spellings("zeros", "ones", "empty", "rand", "randn", "randint", "zeros_like", "ones_like",
               "empty_like", "rand_like", "randn_like", "randint_like", "empty_strided", "eye",
               "bernoulli", "normal", "randperm", "linspace", "logspace", "empty_permuted",
               "zero", "triu_indices", "tril_indices", method=False)]
NEW_CREATIONS = spellings("new_zeros", "new_ones", "new_empty", "new_empty_strided",
                          torch_ns=False, functional=False)
FULLS = [*spellings("full", method=False), torch.full_like, *aten("full_like"), "fill_",
         *aten("fill")]
TENSORS = [torch.tensor, torch.as_tensor, torch.scalar_tensor, *aten("scalar_tensor", "tensor")]
MATMULS = [
    operator.matmul, "__matmul__", "__rmatmul__", "matmul", "mm", "bmm", "mv", "addmm",
    "baddbmm", "addbmm", "addmv", *spellings("matmul", "mm", "bmm", "mv", "addmm", "baddbmm",
                                             "addbmm", "addmv", "_addmm_activation",
                                             method=False)]
PRODUCTS = [
    "dot", "vdot", "inner", "outer", "ger", "kron", "tensordot", "cross", "linalg_cross",
    *spellings("dot", "vdot", "inner", "outer", "ger", "kron", "tensordot", "cross", "einsum",
               "chain_matmul", "linalg_cross", method=False)]
LINEARS = [nn.Linear, nn.LazyLinear, *spellings("linear", method=False)]
BILINEARS = [nn.Bilinear, *spellings("bilinear", method=False)]
EMBEDDING_BAGS = [nn.EmbeddingBag, F.embedding_bag,
                  *aten("embedding_bag", "_embedding_bag", "_embedding_bag_forward_only")]
CONVS_AND_POOLS = _mods(
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
    "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d", "LazyConvTranspose2d",
    "LazyConvTranspose3d", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d",
    "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d",
    "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "LPPool1d", "LPPool2d",
    "LPPool3d", "FractionalMaxPool2d", "FractionalMaxPool3d", "MaxUnpool1d", "MaxUnpool2d",
    "MaxUnpool3d") + spellings(
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d",
    "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "adaptive_max_pool1d",
    "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d", "lp_pool3d",
    "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
    "fractional_max_pool3d_with_indices", "adaptive_max_pool1d_with_indices",
    "adaptive_max_pool2d_with_indices", "adaptive_max_pool3d_with_indices", "max_unpool1d",
    "max_unpool2d", "max_unpool3d", "upsample_nearest1d", "upsample_nearest2d",
    "upsample_nearest3d", "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
    "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa",
    method=False)
CONVOLUTIONS = spellings("convolution", "_convolution", "conv_tbc", method=False)
RESAMPLES = [
    nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d, nn.PixelShuffle,
    nn.PixelUnshuffle, nn.ChannelShuffle, nn.Fold, nn.Unfold, F.interpolate, F.upsample,
    F.upsample_nearest, F.upsample_bilinear, F.fold, F.unfold, F.pixel_shuffle,
    F.pixel_unshuffle, F.channel_shuffle, torch.pixel_shuffle, torch.pixel_unshuffle,
    torch.channel_shuffle, *aten("pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
                                 "native_channel_shuffle", "im2col", "col2im")]
GRID_SAMPLES = [F.grid_sample, F.affine_grid,
                *aten("grid_sampler", "grid_sampler_2d", "grid_sampler_3d",
                      "affine_grid_generator")]
PADS = [F.pad, torch.constant_pad_nd, *aten(
    "pad", "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "_pad_circular",
    "_pad_enum")] + _mods(
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d",
    "ReplicationPad2d", "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d")
LAYER_NORMS = [nn.LayerNorm, nn.RMSNorm, F.layer_norm, F.rms_norm,
               *aten("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")]
GROUP_NORMS = [nn.GroupNorm, F.group_norm, *aten("group_norm", "native_group_norm")]
BATCH_NORMS = _mods(
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
    "LazyBatchNorm2d", "LazyBatchNorm3d") + [F.batch_norm] + aten(
    "batch_norm", "native_batch_norm", "_batch_norm_impl_index", "cudnn_batch_norm",
    "_batch_norm_with_update", "_batch_norm_no_update", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training")
INSTANCE_NORMS = _mods(
    "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LazyInstanceNorm1d",
    "LazyInstanceNorm2d", "LazyInstanceNorm3d") + [F.instance_norm, *aten("instance_norm")]
LOCAL_NORMS = [nn.LocalResponseNorm, nn.CrossMapLRN2d, F.local_response_norm]
SOFTMAXES = spellings("softmax", "log_softmax", "softmin", "_softmax", "_log_softmax",
                      "_safe_softmax")
SCANS = spellings("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "cumsum_",
                  "_logcumsumexp")
SORTS = spellings("sort", "argsort", "msort")
RANKS = spellings("topk", "kthvalue")
VECTOR_PAIRS = [F.cosine_similarity, F.pairwise_distance, nn.CosineSimilarity,
                nn.PairwiseDistance, torch.cdist,
                *aten("cosine_similarity", "pairwise_distance", "cdist", "_cdist_forward")]
PDISTS = [F.pdist, torch.pdist, *aten("pdist", "_pdist_forward")]
ATTENTIONS = spellings("scaled_dot_product_attention", "_scaled_dot_product_attention_math",
                       "_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_efficient_attention",
                       "_scaled_dot_product_flash_attention", method=False)
TRANSFORMERS = _mods("TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder",
                     "TransformerDecoder", "Transformer")
RNNS = [nn.RNN, nn.LSTM, nn.GRU, *aten("lstm", "gru", "rnn_tanh", "rnn_relu")]
RNN_CELLS = [nn.RNNCell, nn.LSTMCell, nn.GRUCell,
             *aten("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")]
NONLINEAR_REDUCTIONS = spellings(
    "amax", "amin", "max", "min", "aminmax", "logsumexp", "prod", "std", "var", "std_mean",
    "var_mean", "argmax", "argmin", "median", "nanmedian", "mode", "all", "any",
    "count_nonzero", "nanmean", "quantile", "nanquantile")
VECTOR_NORMS = [*spellings("norm", "linalg_vector_norm", "frobenius_norm", "nuclear_norm"),
                torch.linalg.vector_norm, torch.linalg.norm, "norm"]
MATRIX_NORMS = [torch.linalg.matrix_norm, *aten("linalg_matrix_norm")]
DATA_SHAPED = spellings("histc", "bincount", "unique", "unique_consecutive", "nonzero",
                        "argwhere", "masked_select")
LOSS_SPELLINGS = [op for loss in partials.LOSSES for op in loss.spellings]

# Rules whose arguments are too long for their table line.
_PAIR = ((0, "x1"), (1, "x2"))
flip_rule = along(_flip_dims, "reverses the order", "flip a non-batch dim")
roll_rule = along(_roll_dims, "rolls elements", "roll a non-batch dim")
triangle_rule = along(_tril_dims, "masks by position",
                      "build (T, T) masks from torch.arange(T) or a batch-free ones((T, T))")
linear_layer_rule = along(_last(1), "contracts features",
                          "put the batch dim before the feature dim")
bilinear_rule = along(_last(1), "contracts features", inputs=((0, "input1"), (1, "input2")))
softmax_rule = along(_softmax_dims, "normalises", "normalise along a non-batch dim")
scan_rule = along(_dim_arg(1, "dim"), "accumulates", "scan along time or features")
sort_rule = along(_dim_arg(1, "dim", -1), "sorts", "sort along a non-batch dim")
rank_rule = along(_dim_arg(2, "dim", -1), "ranks", "rank along features")
pad_rule = along(_pad_dims, "pads", "pad only the trailing non-batch dims")
matrix_norm_rule = reduction(nonlinear="norm", dims=_dim_arg(2, "dim", (-2, -1)))


# ---------------------------------------------------------------------------
# The table: one op or op group, its rule, what it does to the batch dim
# ---------------------------------------------------------------------------

FAMILIES: dict[str, Rule] = {"per_sample": per_sample, "pointwise": pointwise, "free": free,
                             "linear": linear}

# --- Elementwise: f per element, broadcast; the batch dim comes from the batched side ----
TABLE.add(UNARY_MATH, pointwise)  # f(x), f_(x): batch dim unchanged
TABLE.add(ACTIVATIONS, pointwise)  # act(x): functional, ATen and module
TABLE.add(DROPOUTS, per_sample)  # x * mask (its random mask is the one inexact op)
TABLE.add(BINARY, pointwise)  # f(a, b), f(a, b, c): batch dim from the batched side
TABLE.add(OPERATORS, pointwise)  # a == b, a ** b, ~a, a // b: as above
TABLE.add(spellings("one_hot"), pointwise)  # (B, ...) ids -> (B, ..., classes)
# --- Linear arithmetic: a reduction may be added to, or scaled by, batch-free values -----
TABLE.add(ADDS, _linear_arith("add"))  # a + b: linear in both
TABLE.add(SUBS, _linear_arith("sub"))  # a - b: linear in both
TABLE.add(MULS, _linear_arith("mul"))  # a * b: linear if one side is batch-free
TABLE.add(DIVS, _linear_arith("div"))  # a / b: b batch-free, or a count (sum / count)
TABLE.add(NEGS, linear)  # -x, +x: reductions pass through
TABLE.add(spellings("real", "imag", "view_as_real", "view_as_complex"), linear)  # complex parts
# --- Casts and copies: same values, new dtype/device/memory; reductions pass through -----
TABLE.add(CASTS, detach_rule, keeps_positions=True)  # x.float(), x.to(dev), x.clone()
TABLE.add(DETACHES, detach_rule, keeps_positions=True)  # same values, no autograd history
TABLE.add([ops.TensorHook], detach_rule, keeps_positions=True)  # h with a gradient hook: same
TABLE.add([ops.fsdp_unit_enter, ops.fsdp_unit_exit], unit_marker)  # FSDP units: identities
TABLE.add(EXPORT_CHECKS, drop_rule)  # export's asserts: no value, batch-free
# --- Reshapes and dim moves: values untouched; the shapes locate the batch dim -----------
TABLE.add(RESHAPES, reshape_rule, keeps_positions=True)  # (B, T, C) -> (B*T, C) batch-major
TABLE.add(DIM_MOVES, per_sample, keeps_positions=True)  # permute, expand, select: dims move
TABLE.add(SQUEEZES, squeeze_rule, keeps_positions=True)  # the size-1 dims of the full batch
TABLE.add(REPEATS, repeat_rule, keeps_positions=True)  # copies along the batch interleave
TABLE.add(REPEAT_INTERLEAVES, per_sample, keeps_positions=True)  # r copies of each sample, in order
# --- Order along a dim matters: fine unless that dim is the batch ------------------------
TABLE.add(FLIPS, flip_rule)  # x[..., ::-1] along a non-batch dim
TABLE.add([torch.fliplr, "fliplr"], along(lambda c: [1], "reverses the order"))  # flips dim 1
TABLE.add([torch.flipud, "flipud"], along(lambda c: [0], "reverses the order"))  # flips dim 0
TABLE.add(ROLLS, roll_rule)  # circular shift along a non-batch dim
TABLE.add(TRIANGLES, triangle_rule)  # tril/triu mask (T, T) positions, never the batch
TABLE.add(DIAGONALS, along(_diagonal_dims, "takes a diagonal"))  # x[i, i] pairs positions
TABLE.add(spellings("diag_embed"), along(_last(1), "builds diagonals"))  # (B, n) -> (B, n, n)
TABLE.add(UNFOLDS, along(_unfold_dims, "makes sliding windows"))  # x.unfold(dim, size, step)
# --- Splits and joins: along a non-batch dim every piece keeps the batch -----------------
TABLE.add(SPLITS, chunk_rule, keeps_positions=True)  # pieces along a non-batch dim
TABLE.add(JOINS, cat_rule, keeps_positions=True)  # join along a feature dim
# --- Python-level access: tuple items, shapes, attributes, values ------------------------
TABLE.add([operator.getitem], getitem_rule)  # x[..., :k] keeps the batch; tuples pick
TABLE.add([getattr], getattr_rule)  # x.shape, x.dtype, result.values
TABLE.add(SIZES, size_rule)  # x.size(0): ints that are multiples of the batch size, or free
TABLE.add(NUMBERS, size_rule)  # Python numbers computed from sizes (fx, export's SymInt math)
TABLE.add(VALUE_READS, read_value_rule)  # x.item(), x.tolist(): data into Python, rejected
# --- Indexing with tensors: per-sample ids, or arange(B) on the batch dim ----------------
TABLE.add(aten("index", "_unsafe_index"), aten_index_rule)  # x[i0, i1, ...]
TABLE.add(INDEX_SELECTS, index_select_rule)  # x.index_select(dim, idx)
TABLE.add(GATHERS, gather_rule)  # out[i][j] = x[i][idx[i][j]] along a non-batch dim
TABLE.add(INDEX_PUTS, index_put_rule)  # x[mask] = v: per-sample masks only
# --- Functional writes (functionalization's forms of x[...] = y): per sample into its rows ---
TABLE.add(aten("copy"), copy_rule)  # copy(x, y): y broadcast into x's shape; batch from y
TABLE.add(aten("slice_scatter"), slice_scatter_rule)  # x[:, a:b] = y; batch rows only whole
TABLE.add(aten("select_scatter"), select_scatter_rule)  # x[:, i] = y; never a batch row
TABLE.add(aten("diagonal_scatter"), diagonal_scatter_rule)  # diagonal of two non-batch dims
TABLE.add(spellings("masked_scatter"), masked_scatter_rule)  # consumes y in order: batched mixes
TABLE.add(SEARCHES, along(_last(1), "searches a sorted row"))  # per row of sorted (B, K)
# --- Creation: shaped by the batch at most (B from x.size(0)); values batch-free ---------
TABLE.add(CREATIONS, size_like_rule)  # zeros(B, D), ones_like(x), ...
TABLE.add(NEW_CREATIONS, new_like_rule)  # x.new_ones(B, D): shaped by the sizes; x gives dtype
TABLE.add(FULLS, _value_arg(1, "fill_value"))  # full(size, v), x.fill_(v): v not a batch size
TABLE.add(spellings("new_full", torch_ns=False), new_full_rule)  # x.new_full(size, v): as above
TABLE.add(TENSORS, _value_arg(0, "data"))  # tensor(data): data not a batch size
TABLE.add(["new_tensor"], new_tensor_rule)  # x.new_tensor(data): data alone, x gives dtype
TABLE.add(spellings("arange", method=False) + aten("range"), arange_rule)  # arange(B): positions
# --- Contractions: the batch dim must not be contracted ----------------------------------
TABLE.add(MATMULS, matmul_rule)  # (B, n, k) @ (k, m)
TABLE.add(PRODUCTS, per_sample)  # the shapes show whether the batch survives (einsum's letter)
TABLE.add(LINEARS, linear_layer_rule)  # (B, ..., in) -> (B, ..., out)
TABLE.add(BILINEARS, bilinear_rule)  # x1 A x2 per sample
# --- Embeddings: rows of a batch-free table picked by per-sample ids ---------------------
TABLE.add([nn.Embedding, F.embedding], embedding_rule(1))  # (B, T) ids -> (B, T, D)
TABLE.add(aten("embedding"), embedding_rule(0))  # aten.embedding(weight, ids)
TABLE.add(EMBEDDING_BAGS, embedding_bag_rule)  # (B, L) ids -> (B, D): one bag per sample
# --- Convolution, pooling, resampling, padding: (N, C, ...) per sample n -----------------
TABLE.add(CONVS_AND_POOLS, channels_first(None, "convolves, pools or resamples"))  # (N, C, *S)
TABLE.add(CONVOLUTIONS, channels_first(None, "convolves"))  # aten.convolution(x, w, ...)
TABLE.add(RESAMPLES, channels_first(None, "resamples or rearranges"))  # (N, C, *S) per n
TABLE.add(GRID_SAMPLES, channels_first(None, "samples a grid", extra=((1, "grid"),)))  # per n
TABLE.add(PADS, pad_rule)  # F.pad(x, pad): dims padded by (0, 0) may include the batch
# --- Norms: statistics per sample over feature dims; BatchNorm only in eval --------------
TABLE.add(LAYER_NORMS, along(_normalized_dims, "normalises"))  # over the last k dims
TABLE.add(GROUP_NORMS, channels_first(0, "normalises"))  # (N, C, ...) per sample n
TABLE.add(BATCH_NORMS, batch_norm_rule)  # eval: running stats (per sample); training: mixes
TABLE.add(INSTANCE_NORMS, instance_norm_rule)  # per (sample, channel)
TABLE.add(LOCAL_NORMS, channels_first(0, "normalises across channels"))  # (N, C, ...) per n
TABLE.add([F.normalize], along(_dim_arg(2, "dim", 1), "normalises"))  # x / ||x|| along dim
# --- Along-a-dim ops: normalise, sort, scan, compare; fine unless the dim is the batch ---
TABLE.add(SOFTMAXES, softmax_rule)  # softmax(x, d) along a non-batch dim
TABLE.add([nn.Softmax, nn.LogSoftmax, nn.Softmin], along(_softmax_dims, "normalises"))  # .dim
TABLE.add([nn.Softmax2d], channels_first(2, "normalises across channels"))  # over C
TABLE.add([F.gumbel_softmax], along(_dim_arg(4, "dim", -1), "normalises"))  # RNG + softmax
TABLE.add(SCANS, scan_rule)  # cumsum(x, d) along a non-batch dim
TABLE.add(SORTS, sort_rule)  # sort(x, d) along a non-batch dim
TABLE.add(RANKS, rank_rule)  # topk(x, k, d) along a non-batch dim
TABLE.add(spellings("glu"), along(_dim_arg(1, "dim", -1), "pairs halves"))  # glu(x, d)
TABLE.add([nn.GLU], along(_module_dim, "pairs halves"))  # nn.GLU(d)
TABLE.add(spellings("diff"), along(_dim_arg(2, "dim", -1), "differences"))  # x[i+1] - x[i]
TABLE.add(VECTOR_PAIRS, along(_compared_dims, "compares vectors", inputs=_PAIR))  # per row
TABLE.add(PDISTS, along(_every_dim, "compares every pair of rows"))  # row pairs: batched mixes
# --- Attention and sequence layers: per sample along their batch dim ---------------------
TABLE.add(ATTENTIONS, sdpa_rule)  # (B, H, L, E) per sample
TABLE.add([nn.MultiheadAttention], multihead_attention_rule)  # (B, L, E) or (L, B, E)
TABLE.add(TRANSFORMERS, transformer_layer_rule)  # ditto, batch_first of the layer
TABLE.add(RNNS, rnn_rule)  # sequences per sample; states (layers, B, H)
TABLE.add(RNN_CELLS, along(_last(1), "contracts features"))  # (B, in) -> (B, hidden)
# --- Reductions: sum/mean over the batch become partial sums; max/var over it mix --------
TABLE.add(spellings("sum", "nansum"), reduction("sum"))  # Σ over the batch: a partial sum
TABLE.add(spellings("mean"), reduction("mean", partials.mean_partial))  # (Σ, count)
TABLE.add(NONLINEAR_REDUCTIONS, reduction(nonlinear=True))  # max, var, ... over the batch: mix
TABLE.add(VECTOR_NORMS, reduction(nonlinear="norm", dims=_dim_arg(2, "dim")))  # norm(x, p, d)
TABLE.add(MATRIX_NORMS, matrix_norm_rule)  # over the last two dims by default
TABLE.add(DATA_SHAPED, along(_every_dim, "counts or selects values"))  # sized by values: mixes
# --- Losses (partials.LOSSES): reduction 'none' per sample, 'sum' Σ, 'mean' (Σ, count) ---
TABLE.add(LOSS_SPELLINGS, loss_rule)  # batch at dim 0 of (N, C, ...) kinds, anywhere if elementwise
