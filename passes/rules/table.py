"""The rule table: op -> rule, with scoped registration; a node's one lookup; running a rule.

``TABLE`` is the one ``RuleTable``; ``registry`` fills it, a line per op group. Keys are:

- a module class (``nn.Linear``) for ``call_module`` nodes (most derived class first),
- a function (``torch.relu``, ``F.linear``, ``operator.add``) for ``call_function``
  nodes of ``torch.fx.symbolic_trace`` graphs,
- an ATen overload packet (``torch.ops.aten.linear``) for the ``call_function`` nodes of
  ``torch.export`` graphs (any overload maps to its packet),
- a method name string (``"view"``) for ``call_method`` nodes,
- a qualified name (``"transformers::grouped_mm_fallback"``, ``"torch._grouped_mm"``) for an
  op a library may register after the table is filled; a target without a rule of its own
  is looked up by its name.

``apply_rule`` is the one place a rule runs. Around every rule it holds two policies that
no rule has to repeat: sorted rows of a token dispatch are shown to the rule as samples
(``tokens.per_row``), and ``arange(B)`` positions used as values are rejected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..facts import Batched, Container, Fact
from .context import Rule, RuleContext, batched_facts
from .spellings import qualified_name, rule_key
from .tokens import carried, per_row

__all__ = [
    "BATCH_RULES",
    "POSITION_PRESERVING",
    "TABLE",
    "TRUSTED_MODULES",
    "RuleTable",
    "TableState",
    "apply_rule",
    "lookup_rule",
    "scoped",
]


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

    def layer(self, ops: Iterable[Any], wrap: Callable[[Rule | None], Rule]) -> None:
        """One table line over the lines above: each op's rule becomes ``wrap(its rule)``
        (``None`` where it has none), a rule that gives the op a second meaning (in a token
        dispatch) and leaves the rest to the rule it wraps (``.wrapped``; ``.rewrap(rule)``
        is the same wrap around another rule, which ``register_batch_rule`` uses)."""
        for key in dict.fromkeys(rule_key(op) for op in ops if op is not None):
            self.rules[key] = wrap(self.rules.get(key))

    def lookup(self, node: fx.Node, module: nn.Module | None) -> Rule | None:
        """The rule for ``node``: by module class (most derived first), function, method
        name or, for a function without a rule of its own, its qualified name."""
        if node.op == "call_module":
            cls = self.layer_class(module)
            return None if cls is None else self.rules[cls]
        try:
            rule = self.rules.get(rule_key(node.target))
        except TypeError:  # an unhashable target
            return None
        if rule is None and node.op == "call_function":
            name = qualified_name(node.target)
            rule = self.rules.get(name) if name is not None else None
        return rule

    def layer_class(self, module: nn.Module) -> type | None:
        """The class whose rule is ``module``'s: its own or the nearest base's, where its
        class runs that base's ``forward`` (None: no rule). A torch subclass that runs
        another forward does more than its base: ``torch.ao.nn.qat.Linear`` fake-quantizes
        its weight and moves the observer's averages, once per call; with ``nn.Linear``'s
        rule it ran per microbatch, the averages moved 4 times a step (found by a hunt)."""
        for cls in type(module).__mro__:
            if cls in self.rules:
                return cls if getattr(type(module), "forward", None) is getattr(
                    cls, "forward", None) or cls is type(module) else None
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


#: The one table (filled by ``registry``, a line per op group).
TABLE = RuleTable()
BATCH_RULES = TABLE.rules
#: Ops that only move or copy elements: ``arange(B)`` positions stay positions through them.
POSITION_PRESERVING = TABLE.position_preserving
#: Module classes the capture pass keeps as leaves (``trust_module``).
TRUSTED_MODULES = TABLE.trusted


def scoped() -> contextlib.AbstractContextManager[RuleTable]:
    """``with scoped(): register_batch_rule(...)``: the registration lasts for the block."""
    return TABLE.scope()


def lookup_rule(node: fx.Node, module: nn.Module | None) -> Rule | None:
    """The rule for ``node`` (``RuleTable.lookup``); None: the op has no rule."""
    return TABLE.lookup(node, module)


def apply_rule(rule: Rule, ctx: RuleContext) -> Fact:
    """Run ``rule`` on ``ctx.node``: sorted rows of a token dispatch are shown to it as
    samples (unless it ``handles_tokens``); then police ``arange(B)`` positions (see the
    package docstring)."""
    if not getattr(rule, "handles_tokens", False) and carried(ctx):
        return per_row(ctx, lambda view: apply_rule(rule, view))
    fact = rule(ctx)
    positions = [f for f in batched_facts(ctx.arg_facts()) if f.positions]
    if not positions or getattr(rule, "handles_positions", False):
        return fact
    # a layer by its class's MRO, as ``lookup`` finds its rule (the rules run on a layer
    # whose class is a recording subclass: ``layer_settings.py``)
    keys = type(ctx.module).__mro__ if ctx.module is not None else (rule_key(ctx.node.target),)
    others = [f for f in batched_facts(ctx.arg_facts()) if not f.positions]
    keeps = any(key in TABLE.position_preserving for key in keys)
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
