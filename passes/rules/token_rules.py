"""Token-dispatch rules of the sort, the counts and the index arithmetic (see ``tokens``).

Each is the meaning of an op on token-dispatch values, entered through the op's own table
line: ``registry``'s token-dispatch section wraps the op's rule with ``dispatching(special,
start=...)``. ``special(ctx, name, sort)`` gives the op's fact when an argument holds a
dispatch value, ``start(ctx, name)`` when none does (a sort or a count of a per-token key
starts a dispatch); either returns None where the op has no meaning of its own there, and
the wrapped rule decides (``apply_rule``: sorted rows seen as samples).
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from ..facts import SHAPES, Batched, Container, Fact, Free, ValueInfo
from .context import Rule, RuleContext, handles_positions, handles_tokens
from .layout import getattr_rule, size_rule
from .spellings import node_name
from .table import apply_rule
from .tokens import (
    CAST_NAMES,
    EXACT_DTYPES,
    INDEX_OP_NAMES,
    INDEX_PRODUCER_NAMES,
    SAME_VALUE_NAMES,
    DispatchFact,
    GroupCounts,
    NoRule,
    Permuted,
    Sort,
    TokenIndex,
    Unsort,
    carried,
    fact_of,
    info_of,
    int_arg,
    is_per_token,
    one_sort,
    rows_of,
    sort_name,
)

__all__ = [
    "attribute",
    "broadcast",
    "cast",
    "count_key",
    "count_sorted_key",
    "dispatching",
    "div",
    "floor_div",
    "like",
    "mod",
    "new_of_values",
    "offsets",
    "resort",
    "size",
    "start_sort",
]

Special = Callable[[RuleContext, str, "Sort | None"], "Fact | DispatchFact | None"]
Start = Callable[[RuleContext, str], "Fact | DispatchFact | None"]


def _no_rule(ctx: RuleContext) -> Fact:
    raise NoRule(ctx.node)


def dispatching(special: Special, start: Start | None = None) -> Callable[[Rule | None], Rule]:
    """The wrap of a token-dispatch table line: the op's fact is ``special``'s on dispatch
    values (``start``'s on none), else its own rule's (``base``; None: it has none)."""

    def wrap(base: Rule | None) -> Rule:
        @handles_tokens
        @handles_positions  # the wrapped rule's positions are policed by apply_rule below
        def rule(ctx: RuleContext) -> Fact:
            name = node_name(ctx.node)
            if carried(ctx):
                fact = special(ctx, name, one_sort(ctx))
            else:
                fact = start(ctx, name) if start is not None else None
            if fact is not None:
                return fact
            return apply_rule(base if base is not None else _no_rule, ctx)

        rule.__qualname__ = f"dispatching({special.__name__})({getattr(base, '__name__', base)})"
        rule.wrapped, rule.rewrap = base, wrap  # type: ignore[attr-defined]
        return rule

    return wrap


def new_of_values(base: Rule | None) -> Rule:
    """The wrap of ``p.new_zeros(size)`` and kin: a token index, an unsort or counts give the
    new tensor only its dtype and device, so the rule sees them as batch-free."""

    @handles_tokens
    @handles_positions
    def rule(ctx: RuleContext) -> Fact:
        rule_ = base if base is not None else _no_rule
        if carried(ctx):
            one_sort(ctx)
            if isinstance(fact_of(ctx, ctx.arg(0)), TokenIndex | Unsort | GroupCounts):
                view = dataclasses.replace(ctx, facts=ChainMap({ctx.arg(0): Free()}, ctx.facts))
                return apply_rule(rule_, view)  # type: ignore[arg-type]
        return apply_rule(rule_, ctx)

    rule.wrapped, rule.rewrap = base, new_of_values  # type: ignore[attr-defined]
    return rule


# ---------------------------------------------------------------------------
# The sorted key: which values a key holds, and whether they are indices
# ---------------------------------------------------------------------------

def _key_root(node: Any) -> Any:
    """The node whose values ``node`` holds, up to casts and reshapes (a multiset of values)."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") \
            and node_name(node) in SAME_VALUE_NAMES and node.args:
        if node_name(node) in CAST_NAMES and not _exact_cast(node):
            break
        node = node.args[0]
    return node


def _exact_cast(node: fx.Node) -> bool:
    """A cast whose result keeps integers of up to 2^24 exact (not float16, int8 or bool)."""
    info = node.meta.get(SHAPES)
    return isinstance(info, ValueInfo) and info.is_tensor and info.dtype in EXACT_DTYPES


def _non_negative(node: Any) -> bool:
    """``node`` holds indices (of topk, sort, argmax, ...): integers >= 0."""
    root = _key_root(node)
    if not isinstance(root, fx.Node):
        return False
    name = node_name(root)
    if name in INDEX_OP_NAMES:
        return True
    producer = root.args[0] if name in ("getitem", "getattr") else None
    if isinstance(producer, fx.Node) and isinstance(producer.meta.get(SHAPES), tuple):
        return node_name(producer) in INDEX_PRODUCER_NAMES and root.args[1] in (1, "indices")
    return False



# ---------------------------------------------------------------------------
# Starting a dispatch: the sort, and counts of its key
# ---------------------------------------------------------------------------

def start_sort(ctx: RuleContext, name: str) -> Fact | DispatchFact | None:
    """sort/argsort of a 1-d batch-major per-token key along its only dim."""
    key = ctx.arg(0, "input")
    fact = fact_of(ctx, key)
    info = info_of(ctx, key)
    if not is_per_token(fact) or info is None or info.ndim != 1:
        return None  # the rule table decides (a sort along a non-batch dim, or mixing)
    dim = 0 if name == "msort" else ctx.arg(1, "dim", -1)
    if not isinstance(dim, int) or dim not in (0, -1):
        return None
    descending = bool(ctx.arg(2, "descending", False))
    sort = Sort(ctx.node, fact.factor, descending, _key_root(key))
    values = Permuted(sort, 0, key=True)
    perm = TokenIndex(sort, fact.factor, bijective=True)
    if name == "argsort":
        return perm
    if name == "msort":
        return values
    return Container(((0, values), (1, perm)))


def count_key(ctx: RuleContext, name: str) -> Fact | DispatchFact | None:
    """histc of a per-token key in token order: the counts of its sorted runs."""
    key = ctx.arg(0, "input")
    info = info_of(ctx, key)
    if not is_per_token(fact_of(ctx, key)) or info is None or not _non_negative(key):
        return None
    return _histc(ctx, key)


def _histc(ctx: RuleContext, key: Any) -> GroupCounts:
    bins, low, high = ctx.arg(1, "bins", 100), ctx.arg(2, "min", 0), ctx.arg(3, "max", 0)
    if not all(isinstance(v, (int, float)) for v in (bins, low, high)) or high <= low:
        ctx.mix("it counts values in bins whose range is not a fixed one (min == max means "
                "the data's own minimum and maximum), which the whole batch decides",
                "give histc a fixed range: torch.histc(ids, bins=E, min=0, max=E - 1)")
    if low > 0:
        ctx.mix(f"its bins start at {low}, above the smallest key, so the rows counted for "
                "the first group are not the first rows of the sorted key and each row's "
                "group depends on how many smaller keys the batch holds",
                "count expert ids from 0: torch.histc(ids, bins=E, min=0, max=E - 1)")
    if not _non_negative(key):
        ctx.mix("it counts a sorted key that is not known to be >= 0 (the indices of topk, "
                "argmax or sort), so keys below the first bin may come first in the sort and "
                "each row's group would depend on how many of them the batch holds",
                "sort and count expert ids (the indices of torch.topk)")
    return GroupCounts(_key_root(key))



# ---------------------------------------------------------------------------
# Ops with a meaning of their own on dispatch values
# ---------------------------------------------------------------------------

def cast(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """Casts to exact dtypes keep counts, offsets, the sorted key and token indices."""
    fact = fact_of(ctx, ctx.arg(0, "input"))
    if not _exact_cast(ctx.node):
        return None  # sorted rows go on as per-row data; the rest is rejected as a value
    if isinstance(fact, GroupCounts | TokenIndex | Unsort):
        return fact
    if isinstance(fact, Permuted) and fact.key:
        return fact
    return None


def like(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``empty_like(p)``, ``zeros_like(inv)``: no values, the rows of their argument's order."""
    fact = fact_of(ctx, ctx.arg(0, "input"))
    if isinstance(fact, TokenIndex):
        return Permuted(fact.sort, 0)
    if isinstance(fact, Unsort):
        return Batched(0, fact.sort.factor)
    return None


def broadcast(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``p[:, None].expand(-1, H)``: a token index with trailing broadcast dims.

    Token indices are constant along every dim but 0, so any view or expansion that keeps
    dim 0 as it is (row j of the output is made of row j of the input) keeps them one.
    """
    x = ctx.arg(0, "input")
    fact = fact_of(ctx, x)
    if isinstance(fact, TokenIndex | Unsort) and rows_of(ctx, x) is not None \
            and rows_of(ctx, x) == rows_of(ctx, ctx.node):
        return fact
    return None


def floor_div(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``p // c``: the token of each sorted slot, when ``c`` divides the rows per sample."""
    x, c = ctx.arg(0, "input"), ctx.arg(1, "other")
    fact = fact_of(ctx, x)
    if name == "div":
        mode = ctx.arg(2, "rounding_mode")
        if mode not in ("floor", "trunc"):  # indices are >= 0: trunc is floor
            return None
    if not isinstance(fact, TokenIndex):
        return None
    c = int_arg(c)
    if c is None or c <= 0 or fact.factor % c:
        ctx.mix(f"it divides the token permutation of {sort_name(fact.sort)} by "
                f"{ctx.arg(1, 'other')!r}, which does not divide the {fact.factor} sorted rows "
                "per sample, so the result can point into another sample's rows",
                "map sorted slots to tokens with perm // top_k, top_k dividing the slots per "
                "sample")
    return TokenIndex(fact.sort, fact.factor // c)


def mod(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``p % c``: each slot's place within its token (per-row data) when ``c`` divides it."""
    fact = fact_of(ctx, ctx.arg(0, "input"))
    c = int_arg(ctx.arg(1, "other"))
    if isinstance(fact, TokenIndex) and c is not None and c > 0 and fact.factor % c == 0:
        return Permuted(fact.sort, 0)
    return None


def div(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    if isinstance(fact_of(ctx, ctx.arg(0, "input")), TokenIndex):
        return floor_div(ctx, name, sort)
    return None



def count_sorted_key(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """histc of the sorted key: the sizes of its runs."""
    key = ctx.arg(0, "input")
    fact = fact_of(ctx, key)
    if isinstance(fact, Permuted) and fact.key:
        return _histc(ctx, fact.sort.key)
    return None


def offsets(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    fact = fact_of(ctx, ctx.arg(0, "input"))
    if isinstance(fact, GroupCounts) and not fact.offsets and ctx.arg(1, "dim") in (0, -1):
        return GroupCounts(fact.key, offsets=True)
    return None


def resort(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """argsort of the permutation is its inverse."""
    fact = fact_of(ctx, ctx.arg(0, "input"))
    info = info_of(ctx, ctx.arg(0, "input"))
    if not (isinstance(fact, TokenIndex) and fact.bijective and info is not None
            and info.ndim == 1 and not ctx.arg(2, "descending", False)):
        return None
    inverse = Unsort(fact.sort)
    if name == "argsort":
        return inverse
    if name == "sort":  # the values are 0..N-1 in order: each row's own position
        return Container(((0, Batched(0, fact.factor, positions=True)), (1, inverse)))
    return None


def size(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``x'.size(0)``, ``len(p)``: numbers from the shape, as for any tensor."""
    return size_rule(ctx)


def attribute(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """``(ids', p).indices`` picks a fact; ``x'.shape``, ``.dtype``, ``.device`` are numbers."""
    if isinstance(fact_of(ctx, ctx.arg(0)), Container):
        return getattr_rule(ctx)
    if ctx.arg(1) in ("shape", "dtype", "device"):
        return size_rule(ctx)
    return None
