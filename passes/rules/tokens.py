"""Token dispatch: sorting the batch's tokens, working per row and unsorting is per-sample.

A mixture-of-experts layer routes each token to its experts by sorting the
flattened tokens of the whole batch by expert id, running every expert on its
contiguous run of rows (one grouped matmul, with the runs' boundaries counted
from the sorted ids) and putting the rows back in token order. The sort looks
like mixing (it orders rows over the batch dim), but each token's output depends
only on its own hidden state and the shared weights: a microbatch sorts its own
tokens, runs them through the same experts and gets the same rows back.

This module holds the four facts such a region has beside ``Batched``, and the one step
every rule gets for free (``apply_rule`` takes it): an op with no meaning of its own on
them sees each sorted row as a sample (``per_row``). The ops that do have one (the sort,
the gathers and writes by token index, the counts, the grouped matmul) keep their table
line and add that meaning in one line each of ``registry``'s token-dispatch section:
``token_rules`` (sort, counts, index arithmetic), ``token_moves`` (gathers and writes by
token index) and ``grouped_matmuls``.

=========================  ===================================================
fact                       the value
=========================  ===================================================
``Permuted(sort, dim)``    per-token rows in the order of ``sort`` (a sort of a
                           per-token key over the batch-major token axis):
                           row j belongs to the token the sort put at j.
                           ``key``: the sorted key itself, which counts may read.
``TokenIndex(sort, f)``    for each sorted row, the index of its token in a
                           batch-major axis of ``f`` rows per sample (the sort's
                           indices, ``perm // top_k``); ``bijective``: the
                           permutation itself. Constant along every dim but 0.
``Unsort(sort)``           the inverse permutation (``inv[perm] = arange(N)``,
                           ``perm.argsort()``).
``GroupCounts(key)``       rows per group of an integer key over the batch
                           (``histc``); ``offsets``: their cumulative sum, the
                           boundaries a grouped matmul takes.
=========================  ===================================================

The algebra, one rule a line (``x`` per-sample rows in token order, ``x'``
``Permuted`` rows, ``p`` the sort's ``TokenIndex``, ``q = p // k``):

- ``sort(key)``, ``argsort(key)`` of a 1-d batch-major per-token key -> ``key'``, ``p``;
- ``x[p]``, ``x.index_select(0, p)``, ``x.gather(0, p[:, None].expand(...))`` -> ``x'``;
- ``p // c`` -> a ``TokenIndex`` into an axis of ``f / c`` rows per sample (``c`` divides
  ``f``, so every row stays inside its sample); ``p % c`` -> per-row data;
- an op the rule table keeps per-sample when each sorted row is a sample -> ``x'``
  (elementwise, ``linear`` on features, ``chunk`` along features, casts, ...);
- ``offs = cumsum(histc(key', E, 0, E - 1))`` of the ascending sorted key, and
  ``grouped_mm(x', W, offs)``: row j meets ``W[group of j]``, a function of its own key
  alone, because the sorted key's runs are its groups whatever the other rows are (the
  key must be indices, so >= 0, and the bins start at or below 0: no row sorts before
  the first group). Grouped matmuls are named in ``GROUPED_MATMULS``; add a kernel of
  your own there (its qualified name and where its input, weights and offsets are);
- ``inv[p] = arange(N)`` (``index_put``), ``scatter(_, 0, p, arange)``, ``argsort(p)``
  -> ``Unsort``; ``x'[inv]`` -> per-sample rows in token order again;
- ``zeros.index_add(0, q, x')``, ``index_put(_, [q], x', accumulate=True)``,
  ``scatter_add(0, q[:, None].expand(...), x')``: every sorted row is added to its own
  token -> per-sample again (plain writes need the permutation itself: no duplicates).

Anything else that reads these values mixes tokens of different samples, and is
rejected with the reason: a scan or a sort over the sorted rows, rows in sorted
order met by rows in token order, the permutation used as a value, group counts
used other than as a grouped matmul's boundaries, a descending sort's groups,
sorted rows returned from the model.

Example (transformers' ``grouped_mm`` experts, B samples of T tokens, top-2, so
2T slots per sample), the facts in brackets::

    ids = topk_idx.reshape(-1)                  # [per-sample(dim 0, merged x2T)]
    ids_g, perm = torch.sort(ids)               # [permuted rows (key)], [token index x2T]
    rows = hidden[perm // 2]                    # [token index xT] -> [permuted rows]
    offs = torch.cumsum(torch.histc(ids_g.float(), 4, 0, 3), 0)   # [group offsets]
    out = grouped_mm(rows, w, offs)             # [permuted rows]
    inv = torch.empty_like(perm); inv[perm] = torch.arange(2 * T * B)   # [unsort]
    y = out[inv].view(T * B, 2, -1).sum(1)      # [per-sample(dim 0, merged xT)]
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..facts import Batched, Container, Fact, Free, ValueInfo
from ..sources import source_line
from .context import Rejected, RuleContext

__all__ = [
    "DispatchFact",
    "GroupCounts",
    "NoRule",
    "Permuted",
    "Sort",
    "TokenIndex",
    "Unsort",
    "carried",
    "is_dispatch_fact",
    "one_sort",
    "output_reason",
    "per_row",
]


# ---------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sort:
    """One sort of a per-token key over the batch: ``factor`` sorted rows per sample."""

    node: fx.Node = field(compare=True, repr=False)
    factor: int
    descending: bool
    key: fx.Node = field(compare=False, repr=False)  # the sorted values' source (token_rules)

    def __str__(self) -> str:
        return repr(self.node.name)


@dataclass(frozen=True)
class Permuted:
    """Per-token rows along ``dim`` in the order of ``sort`` (``key``: the sorted key)."""

    sort: Sort
    dim: int = 0
    key: bool = False

    def __str__(self) -> str:
        key = ", sorted key" if self.key else ""
        return f"permuted rows(dim {self.dim}, by sort {self.sort}{key})"


@dataclass(frozen=True)
class TokenIndex:
    """Per sorted row, its token's index in a batch-major axis of ``factor`` rows per sample."""

    sort: Sort
    factor: int
    bijective: bool = False

    def __str__(self) -> str:
        kind = "permutation" if self.bijective else "token index"
        return f"{kind}(by sort {self.sort}, into x{self.factor})"


@dataclass(frozen=True)
class Unsort:
    """The inverse of ``sort``'s permutation: indexing sorted rows with it restores token order."""

    sort: Sort

    def __str__(self) -> str:
        return f"unsort(of sort {self.sort})"


@dataclass(frozen=True)
class GroupCounts:
    """Rows per group of the integer key ``key`` over the batch; ``offsets``: cumulative."""

    key: fx.Node = field(repr=False)
    offsets: bool = False

    def __str__(self) -> str:
        return f"group {'offsets' if self.offsets else 'counts'}(of {self.key.name!r})"


DispatchFact = Permuted | TokenIndex | Unsort | GroupCounts
_DISPATCH = (Permuted, TokenIndex, Unsort, GroupCounts)


def is_dispatch_fact(fact: Any) -> bool:
    """Whether ``fact`` (or a piece of a ``Container``) is one of this module's facts."""
    if isinstance(fact, Container):
        return any(is_dispatch_fact(f) for _, f in fact.items)
    return isinstance(fact, _DISPATCH)


def output_reason(fact: Any) -> str | None:
    """Why a graph output with ``fact`` cannot be concatenated over microbatches (None: it can)."""
    if isinstance(fact, Permuted | TokenIndex | Unsort):
        return (f"it returns values in the order of the sort {fact.sort} over the whole "
                "batch's tokens, which no concatenation of microbatch outputs reproduces")
    if isinstance(fact, GroupCounts):
        return "it returns token counts per group over the whole batch"
    return None


class NoRule(Exception):
    """An op of a token-dispatch table line that has no rule of its own, met outside its
    token meaning (the analysis reports it as an op without a rule)."""


# ---------------------------------------------------------------------------
# Op names (``node_name``: ATen packets, methods and torch functions alike); ``groups``
# spells each set out for its table line in ``registry``
# ---------------------------------------------------------------------------

SORT_NAMES = frozenset({"sort", "argsort", "msort"})
FLOOR_DIV_NAMES = frozenset({"floor_divide", "floordiv", "__floordiv__", "floor_divide_"})
MOD_NAMES = frozenset({"remainder", "fmod", "mod", "__mod__"})
READ_NAMES = frozenset({"index", "_unsafe_index", "getitem", "index_select", "gather",
                        "take_along_dim"})
ADD_NAMES = frozenset({"index_add", "index_add_", "scatter_add", "scatter_add_",
                       "scatter_reduce", "scatter_reduce_"})
PUT_NAMES = frozenset({"index_put", "index_put_", "_unsafe_index_put", "_index_put_impl",
                       "_index_put_impl_"})
COPY_NAMES = frozenset({"index_copy", "index_copy_", "scatter", "scatter_"})
COUNT_NAMES = frozenset({"histc"})
CUMSUM_NAMES = frozenset({"cumsum"})
# Same values, another dtype, layout or autograd history.
CAST_NAMES = frozenset({"to", "_to_copy", "type", "type_as", "float", "double", "long", "int",
                        "contiguous", "clone", "detach", "alias", "lift_fresh_copy", "_to_dtype",
                        "lift_fresh"})
EXACT_DTYPES = frozenset({torch.int32, torch.int64, torch.float32, torch.float64})
# Shape-only views that may give a token index trailing broadcast dims.
BROADCAST_NAMES = frozenset({
    "unsqueeze", "expand", "expand_as", "broadcast_to", "view", "reshape", "_unsafe_view",
    "view_copy", "expand_copy", "unsqueeze_copy", "slice", "slice_copy", "permute", "transpose",
    "squeeze", "squeeze_copy"})
# Ops whose value comes from their argument's shape alone.
LIKE_NAMES = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})
# x.new_zeros(size): only the dtype and device come from x.
NEW_NAMES = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
SIZE_NAMES = frozenset({"size", "sym_size", "numel", "sym_numel", "dim", "stride", "sym_stride",
                        "__len__", "len", "ndimension", "nelement"})
# Multiset-preserving ops: histc of their output counts the same values as of their input.
SAME_VALUE_NAMES = CAST_NAMES | frozenset({"view", "reshape", "_unsafe_view", "flatten", "ravel",
                                           "view_copy", "permute", "transpose", "t"})
# Producers of non-negative integers (expert ids): the indices of these ops.
INDEX_PRODUCER_NAMES = frozenset({"topk", "sort", "kthvalue", "max", "min", "mode", "cummax",
                                  "cummin"})
INDEX_OP_NAMES = frozenset({"argmax", "argmin", "argsort"})


# ---------------------------------------------------------------------------
# Reading a node's arguments
# ---------------------------------------------------------------------------

def flat_args(ctx: RuleContext) -> list[fx.Node]:
    """Every node among the arguments (positional and keyword, flattened)."""
    nodes: list[fx.Node] = []
    fx.node.map_arg((ctx._args, ctx._kwargs), nodes.append)
    return nodes


def fact_of(ctx: RuleContext, value: Any) -> Any:
    """The fact of an argument node (``Container``s whole); constants are batch-free."""
    return ctx.facts[value] if isinstance(value, fx.Node) else Free()


def carried(ctx: RuleContext) -> bool:
    """Whether an argument holds a token-dispatch value (a piece of a tuple counts)."""
    return any(is_dispatch_fact(ctx.facts[n]) for n in flat_args(ctx))


def _pieces(fact: Any) -> Iterable[Any]:
    if isinstance(fact, Container):
        for _, f in fact.items:
            yield from _pieces(f)
    else:
        yield fact


def one_sort(ctx: RuleContext) -> Sort | None:
    """The one sort whose order the arguments' rows are in (None: none); rows in the orders
    of two sorts are rejected."""
    facts = [fact_of(ctx, a) for a in flat_args(ctx)]
    sorts = list(dict.fromkeys(f.sort for fact in facts for f in _pieces(fact)
                               if isinstance(f, Permuted | TokenIndex | Unsort)))
    if len(sorts) > 1:
        ctx.mix(f"it combines rows in the orders of two different sorts of the batch's "
                f"tokens ({' and '.join(sort_name(s) for s in sorts)}), so row j of one "
                "is not the token of row j of the other",
                "undo each permutation (index with its inverse) before combining the rows")
    return sorts[0] if sorts else None


def sort_name(sort: Sort | None) -> str:
    """``the sort at node 'sort' (model.py:12: ...)`` for the reasons."""
    if sort is None:
        return "a sort"
    line = source_line(sort.node)
    return f"the sort at node {sort.node.name!r}" + (f" ({line})" if line else "")


def info_of(ctx: RuleContext, value: Any) -> ValueInfo | None:
    """The shapes of a tensor argument (None: not a tensor)."""
    info = ctx.info(value)
    return info if isinstance(info, ValueInfo) and info.is_tensor else None


def rows_of(ctx: RuleContext, value: Any) -> tuple[int, int] | None:
    """The sizes of dim 0 of ``value`` at the two batch sizes."""
    info = info_of(ctx, value)
    if info is None or not info.shape_a:
        return None
    return info.shape_a[0], info.shape_b[0]


def is_per_token(fact: Any, factor: int | None = None) -> bool:
    """Per-sample rows in token order along dim 0 (batch-major), ``factor`` rows per sample."""
    return (isinstance(fact, Batched) and fact.dim == 0 and fact.major and not fact.positions
            and (factor is None or fact.factor == factor))


def is_positions(fact: Any, factor: int) -> bool:
    """``arange(factor * B)``: each row's own index."""
    return isinstance(fact, Batched) and fact.positions and fact.dim == 0 and \
        fact.factor == factor


def int_arg(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------
# Per-row ops: a table rule, with every sorted row as a sample of its own
# ---------------------------------------------------------------------------

def per_row(ctx: RuleContext, run: Callable[[RuleContext], Fact]) -> Fact | DispatchFact:
    """An op with no meaning of its own on sorted rows (and batch-free values): ``run`` (its
    rule) decides, seeing each sorted row as a per-sample row; the result must keep the rows
    where they were."""
    sort = one_sort(ctx)
    for f in (p for a in flat_args(ctx) for p in _pieces(ctx.facts[a])):
        if isinstance(f, TokenIndex | Unsort):
            ctx.mix(f"it uses the {'permutation' if isinstance(f, TokenIndex) else 'inverse'} "
                    f"of {sort_name(f.sort)} as a value: these are positions of tokens in "
                    "the whole batch, which restart in every microbatch",
                    "use the sort's indices only to gather (x[perm // top_k]) and to write "
                    "back (index_add, scatter_add, out[inv])")
        if isinstance(f, GroupCounts):
            ctx.mix(f"it uses the number of tokens per group over the whole batch ({f}) for "
                    "something other than the group boundaries of a grouped matmul, so each "
                    "token's result depends on the other samples' routing",
                    "use the counts only as grouped_mm offsets; a load-balancing loss over "
                    "the batch needs the whole batch (mbs='none')")
        if isinstance(f, Batched):
            ctx.mix(f"it combines rows sorted by {sort_name(sort)} with per-sample rows in "
                    f"token order ({f}), so row j of one is not the token of row j of the other",
                    "undo the permutation first (x_sorted[inv]) or gather the other value in "
                    "the sort's order (y[perm // top_k])")
    assert sort is not None
    sub = {n: _as_rows(ctx.facts[n]) for n in flat_args(ctx) if is_dispatch_fact(ctx.facts[n])}
    view = dataclasses.replace(ctx, facts=ChainMap(sub, ctx.facts))  # type: ignore[arg-type]
    try:
        out = run(view)
    except Rejected as rejected:
        raise Rejected(f"{rejected.reason}; its rows are the batch's tokens in the order of "
                       f"{sort_name(sort)}, so this mixes tokens of different samples",
                       ("work on each sorted row alone (elementwise ops, per-row matmuls, "
                        "grouped_mm) until the permutation is undone", *rejected.fixes)
                       ) from None
    return _back(ctx, out, sort)


def _as_rows(fact: Any) -> Any:
    """Sorted rows seen as per-sample rows (each row a sample of its own, for the rule)."""
    if isinstance(fact, Container):
        return Container(tuple((k, _as_rows(f)) for k, f in fact.items))
    if isinstance(fact, Permuted):
        return Batched(fact.dim, fact.sort.factor)
    return fact


def _back(ctx: RuleContext, fact: Any, sort: Sort) -> Fact | DispatchFact:
    """A fact computed with sorted rows seen as samples, in terms of the sort again."""
    if isinstance(fact, Container):
        return Container(tuple((k, _back(ctx, f, sort)) for k, f in fact.items))
    if isinstance(fact, Batched):
        if fact.factor != sort.factor or fact.positions:
            ctx.mix(f"it regroups the rows sorted by {sort_name(sort)} (a reshape that "
                    f"merges or splits them: {sort.factor} rows per sample become "
                    f"{fact.factor}), putting tokens of different samples together",
                    "keep one token per row until the permutation is undone")
        return Permuted(sort, fact.dim)
    return fact  # Free, BatchSize, Reduced: a sum over all rows is a sum over the batch
