"""Token dispatch: sorting the batch's tokens, working per row and unsorting is per-sample.

A mixture-of-experts layer routes each token to its experts by sorting the
flattened tokens of the whole batch by expert id, running every expert on its
contiguous run of rows (one grouped matmul, with the runs' boundaries counted
from the sorted ids) and putting the rows back in token order. The sort looks
like mixing (it orders rows over the batch dim), but each token's output depends
only on its own hidden state and the shared weights: a microbatch sorts its own
tokens, runs them through the same experts and gets the same rows back.

The batch analysis asks this module first about every node that touches such a
region (``dispatch_fact``). It follows four facts of its own, beside ``Batched``:

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .batch_rules import (
    Rule,
    RuleContext,
    _Rejected,
    apply_rule,
    getattr_rule,
    node_name,
    size_rule,
)
from .facts import SHAPES, Batched, Container, Fact, Free, ValueInfo

__all__ = [
    "GROUPED_MATMULS",
    "DispatchFact",
    "GroupCounts",
    "NoRule",
    "Permuted",
    "Sort",
    "TokenIndex",
    "Unsort",
    "dispatch_fact",
    "is_dispatch_fact",
    "output_reason",
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
    key: fx.Node = field(compare=False, repr=False)  # the sorted values' source, see _key_root

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
    """A per-row op on sorted rows has no rule in the table (the caller reports it)."""


# ---------------------------------------------------------------------------
# Op names (``node_name``: ATen packets, methods and torch functions alike)
# ---------------------------------------------------------------------------

_SORTS = frozenset({"sort", "argsort", "msort"})
_FLOOR_DIVS = frozenset({"floor_divide", "floordiv", "__floordiv__", "floor_divide_"})
_MODS = frozenset({"remainder", "fmod", "mod", "__mod__"})
_READS = frozenset({"index", "_unsafe_index", "getitem", "index_select", "gather",
                    "take_along_dim"})
_ADDS = frozenset({"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
                   "scatter_reduce_"})
_PUTS = frozenset({"index_put", "index_put_", "_unsafe_index_put", "_index_put_impl",
                   "_index_put_impl_"})
_COPIES = frozenset({"index_copy", "index_copy_", "scatter", "scatter_"})
_COUNTS = frozenset({"histc"})
_CUMSUMS = frozenset({"cumsum"})
# Same values, another dtype, layout or autograd history.
_CASTS = frozenset({"to", "_to_copy", "type", "type_as", "float", "double", "long", "int",
                    "contiguous", "clone", "detach", "alias", "lift_fresh_copy", "_to_dtype",
                    "lift_fresh"})
_EXACT_DTYPES = frozenset({torch.int32, torch.int64, torch.float32, torch.float64})
# Shape-only views that may give a token index trailing broadcast dims.
_BROADCASTS = frozenset({"unsqueeze", "expand", "expand_as", "broadcast_to", "view", "reshape",
                         "_unsafe_view", "view_copy", "expand_copy", "unsqueeze_copy", "slice",
                         "slice_copy", "permute", "transpose", "squeeze", "squeeze_copy"})
# Ops whose value comes from their argument's shape alone.
_CREATIONS = frozenset({"empty_like", "zeros_like", "ones_like", "full_like"})
# x.new_zeros(size): only the dtype and device come from x.
_NEWS = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
_SIZES = frozenset({"size", "sym_size", "numel", "sym_numel", "dim", "stride", "sym_stride",
                    "__len__", "len", "ndimension", "nelement"})
# Multiset-preserving ops: histc of their output counts the same values as of their input.
_SAME_VALUES = _CASTS | frozenset({"view", "reshape", "_unsafe_view", "flatten", "ravel",
                                   "view_copy", "permute", "transpose", "t"})
# Producers of non-negative integers (expert ids): the indices of these ops.
_INDEX_PRODUCERS = frozenset({"topk", "sort", "kthvalue", "max", "min", "mode", "cummax",
                              "cummin"})
_INDEX_OPS = frozenset({"argmax", "argmin", "argsort"})

#: Grouped matmuls: op -> (input, weight, offsets) argument positions and names. The
#: rows of the 2-d input are cut into runs at the offsets; run g meets weight[g].
GROUPED_MATMULS: dict[str, tuple[tuple[int, str], tuple[int, str], tuple[int, str]]] = {
    "aten::_grouped_mm": ((0, "self"), (1, "mat2"), (2, "offs")),
    "torch._grouped_mm": ((0, "self"), (1, "mat2"), (2, "offs")),
    "torch.nn.functional.grouped_mm": ((0, "mat_a"), (1, "mat_b"), (2, "offs")),
    "transformers::grouped_mm_fallback": ((0, "input"), (1, "weight"), (2, "offs")),
}


def _grouped_matmul(node: fx.Node) -> tuple[tuple[int, str], ...] | None:
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return GROUPED_MATMULS.get(schema.name)
    if callable(target):
        name = f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', '')}"
        return GROUPED_MATMULS.get(name.replace("torch._C._VariableFunctions", "torch"))
    return None


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def dispatch_fact(ctx: RuleContext, rule: Rule | None,
                  where: Callable[[fx.Node], str] = lambda n: "") -> Fact | DispatchFact | None:
    """The fact of ``ctx.node`` if it starts, continues or ends a token dispatch, else None.

    ``rule`` is the table's rule for the node (None: it has none), used for per-row ops on
    sorted rows; ``where`` gives a node's source line for the reasons. Raises ``_Rejected``
    when the node mixes tokens of different samples, ``NoRule`` for a per-row op with no
    rule.
    """
    node = ctx.node
    name = node_name(node) if node.op != "call_module" else ""
    facts = [_fact(ctx, a) for a in _flat_args(ctx)]
    if not any(is_dispatch_fact(f) for f in facts):
        if name in _SORTS:
            return _sort(ctx, name)
        if name in _COUNTS:
            return _counts_of_key(ctx)
        return None
    sort = _one_sort(ctx, facts, where)
    if name in ("getitem", "getattr") and isinstance(_fact(ctx, ctx.arg(0)), Container):
        return getattr_rule(ctx) if name == "getattr" else ctx.fact(ctx.arg(0)).get(ctx.arg(1))
    if name in _SIZES or (name == "getattr" and ctx.arg(1) in ("shape", "dtype", "device")):
        return size_rule(ctx)
    if name in _NEWS and isinstance(_fact(ctx, ctx.arg(0)), TokenIndex | Unsort | GroupCounts):
        if rule is None:
            raise NoRule(node)
        return apply_rule(rule, dataclasses.replace(
            ctx, facts=ChainMap({ctx.arg(0): Free()}, ctx.facts)))  # type: ignore[arg-type]
    special = _SPECIAL.get(name)
    if special is not None:
        fact = special(ctx, name, sort, where)
        if fact is not None:
            return fact
    if node.op == "call_function" and _grouped_matmul(node) is not None:
        return _grouped_mm(ctx, sort, where)
    return _per_row(ctx, rule, facts, sort, where)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------

def _flat_args(ctx: RuleContext) -> list[fx.Node]:
    nodes: list[fx.Node] = []
    fx.node.map_arg((ctx._args, ctx._kwargs), nodes.append)
    return nodes


def _fact(ctx: RuleContext, value: Any) -> Any:
    return ctx.facts[value] if isinstance(value, fx.Node) else Free()


def _pieces(fact: Any) -> Iterable[Any]:
    if isinstance(fact, Container):
        for _, f in fact.items:
            yield from _pieces(f)
    else:
        yield fact


def _one_sort(ctx: RuleContext, facts: Sequence[Any],
              where: Callable[[fx.Node], str]) -> Sort | None:
    sorts = list(dict.fromkeys(f.sort for fact in facts for f in _pieces(fact)
                               if isinstance(f, Permuted | TokenIndex | Unsort)))
    if len(sorts) > 1:
        ctx.mix(f"it combines rows in the orders of two different sorts of the batch's "
                f"tokens ({' and '.join(_named(s, where) for s in sorts)}), so row j of one "
                "is not the token of row j of the other",
                "undo each permutation (index with its inverse) before combining the rows")
    return sorts[0] if sorts else None


def _named(sort: Sort | None, where: Callable[[fx.Node], str]) -> str:
    if sort is None:
        return "a sort"
    line = where(sort.node)
    return f"the sort at node {sort.node.name!r}" + (f" ({line})" if line else "")


def _info(ctx: RuleContext, value: Any) -> ValueInfo | None:
    info = ctx.info(value)
    return info if isinstance(info, ValueInfo) and info.is_tensor else None


def _rows(ctx: RuleContext, value: Any) -> tuple[int, int] | None:
    """The sizes of dim 0 of ``value`` at the two batch sizes."""
    info = _info(ctx, value)
    if info is None or not info.shape_a:
        return None
    return info.shape_a[0], info.shape_b[0]


def _is_per_token(fact: Any, factor: int | None = None) -> bool:
    """Per-sample rows in token order along dim 0 (batch-major), ``factor`` rows per sample."""
    return (isinstance(fact, Batched) and fact.dim == 0 and fact.major and not fact.positions
            and (factor is None or fact.factor == factor))


def _positions(fact: Any, factor: int) -> bool:
    """``arange(factor * B)``: each row's own index."""
    return isinstance(fact, Batched) and fact.positions and fact.dim == 0 and \
        fact.factor == factor


def _int_arg(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _key_root(node: Any) -> Any:
    """The node whose values ``node`` holds, up to casts and reshapes (a multiset of values)."""
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") \
            and node_name(node) in _SAME_VALUES and node.args:
        if node_name(node) in _CASTS and not _exact_cast(node):
            break
        node = node.args[0]
    return node


def _exact_cast(node: fx.Node) -> bool:
    """A cast whose result keeps integers of up to 2^24 exact (not float16, int8 or bool)."""
    info = node.meta.get(SHAPES)
    return isinstance(info, ValueInfo) and info.is_tensor and info.dtype in _EXACT_DTYPES


def _non_negative(node: Any) -> bool:
    """``node`` holds indices (of topk, sort, argmax, ...): integers >= 0."""
    root = _key_root(node)
    if not isinstance(root, fx.Node):
        return False
    name = node_name(root)
    if name in _INDEX_OPS:
        return True
    producer = root.args[0] if name in ("getitem", "getattr") else None
    if isinstance(producer, fx.Node) and isinstance(producer.meta.get(SHAPES), tuple):
        return node_name(producer) in _INDEX_PRODUCERS and root.args[1] in (1, "indices")
    return False


def _arg(ctx: RuleContext, spec: tuple[int, str]) -> Any:
    return ctx.arg(spec[0], spec[1])


# ---------------------------------------------------------------------------
# Starting a dispatch: the sort, and counts of its key
# ---------------------------------------------------------------------------

def _sort(ctx: RuleContext, name: str) -> Fact | DispatchFact | None:
    """sort/argsort of a 1-d batch-major per-token key along its only dim."""
    key = ctx.arg(0, "input")
    fact = _fact(ctx, key)
    info = _info(ctx, key)
    if not _is_per_token(fact) or info is None or info.ndim != 1:
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


def _counts_of_key(ctx: RuleContext) -> Fact | DispatchFact | None:
    """histc of a per-token key in token order: the counts of its sorted runs."""
    key = ctx.arg(0, "input")
    info = _info(ctx, key)
    if not _is_per_token(_fact(ctx, key)) or info is None or not _non_negative(key):
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

Special = Callable[[RuleContext, str, "Sort | None", Callable[[fx.Node], str]],
                   "Fact | DispatchFact | None"]


def _cast(ctx: RuleContext, name: str, sort: Sort | None,
          where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """Casts to exact dtypes keep counts, offsets, the sorted key and token indices."""
    fact = _fact(ctx, ctx.arg(0, "input"))
    if not _exact_cast(ctx.node):
        return None  # sorted rows go on as per-row data; the rest is rejected as a value
    if isinstance(fact, GroupCounts | TokenIndex | Unsort):
        return fact
    if isinstance(fact, Permuted) and fact.key:
        return fact
    return None


def _creation(ctx: RuleContext, name: str, sort: Sort | None,
              where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """``empty_like(p)``, ``zeros_like(inv)``: no values, the rows of their argument's order."""
    fact = _fact(ctx, ctx.arg(0, "input"))
    if isinstance(fact, TokenIndex):
        return Permuted(fact.sort, 0)
    if isinstance(fact, Unsort):
        return Batched(0, fact.sort.factor)
    return None


def _broadcast(ctx: RuleContext, name: str, sort: Sort | None,
               where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """``p[:, None].expand(-1, H)``: a token index with trailing broadcast dims.

    Token indices are constant along every dim but 0, so any view or expansion that keeps
    dim 0 as it is (row j of the output is made of row j of the input) keeps them one.
    """
    x = ctx.arg(0, "input")
    fact = _fact(ctx, x)
    if isinstance(fact, TokenIndex | Unsort) and _rows(ctx, x) is not None \
            and _rows(ctx, x) == _rows(ctx, ctx.node):
        return fact
    return None


def _floor_div(ctx: RuleContext, name: str, sort: Sort | None,
               where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """``p // c``: the token of each sorted slot, when ``c`` divides the rows per sample."""
    x, c = ctx.arg(0, "input"), ctx.arg(1, "other")
    fact = _fact(ctx, x)
    if name == "div":
        mode = ctx.arg(2, "rounding_mode")
        if mode not in ("floor", "trunc"):  # indices are >= 0: trunc is floor
            return None
    if not isinstance(fact, TokenIndex):
        return None
    c = _int_arg(c)
    if c is None or c <= 0 or fact.factor % c:
        ctx.mix(f"it divides the token permutation of {_named(fact.sort, where)} by "
                f"{ctx.arg(1, 'other')!r}, which does not divide the {fact.factor} sorted rows "
                "per sample, so the result can point into another sample's rows",
                "map sorted slots to tokens with perm // top_k, top_k dividing the slots per "
                "sample")
    return TokenIndex(fact.sort, fact.factor // c)


def _mod(ctx: RuleContext, name: str, sort: Sort | None,
         where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """``p % c``: each slot's place within its token (per-row data) when ``c`` divides it."""
    fact = _fact(ctx, ctx.arg(0, "input"))
    c = _int_arg(ctx.arg(1, "other"))
    if isinstance(fact, TokenIndex) and c is not None and c > 0 and fact.factor % c == 0:
        return Permuted(fact.sort, 0)
    return None


def _div(ctx: RuleContext, name: str, sort: Sort | None,
         where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    if isinstance(_fact(ctx, ctx.arg(0, "input")), TokenIndex):
        return _floor_div(ctx, name, sort, where)
    return None


def _read(ctx: RuleContext, name: str, sort: Sort | None,
          where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """Gathers along dim 0 with a token index (sorting rows) or with the unsort (undoing it)."""
    source = ctx.arg(0, "input")
    if name == "getitem":
        index = ctx.arg(1)
        entries = list(index) if isinstance(index, (tuple, list)) else [index]
        dim0, rest = (entries[0] if entries else None), entries[1:]
        if isinstance(_fact(ctx, source), TokenIndex | Unsort) and all(
                e is None or e is Ellipsis or e == slice(None) for e in entries):
            return _broadcast(ctx, name, sort, where)
    elif name in ("index", "_unsafe_index"):
        entries = list(ctx.arg(1, "indices") or [])
        dim0, rest = (entries[0] if entries else None), entries[1:]
    elif name == "take_along_dim":
        dim0, rest = ctx.arg(1, "indices"), []
        if ctx.arg(2, "dim") != 0:
            return None
    else:  # index_select(x, dim, idx), gather(x, dim, idx)
        dim0, rest = ctx.arg(2, "index"), []
        d = ctx.arg(1, "dim")
        info = _info(ctx, source)
        if not isinstance(d, int) or info is None or d % max(info.ndim, 1) != 0:
            return None
    ifact, sfact = _fact(ctx, dim0), _fact(ctx, source)
    if isinstance(ifact, TokenIndex):
        if not _is_per_token(sfact, ifact.factor):
            ctx.mix(f"it gathers rows with the token index of {_named(ifact.sort, where)}, "
                    f"which points into an axis of {ifact.factor} rows per sample, from a "
                    f"value that is not per-sample rows in token order of that size ({sfact})",
                    "gather the flattened per-token values (x.reshape(-1, H)) with the "
                    "sort's indices divided by top_k")
        _rest_per_row(ctx, rest, ifact.sort, allow_permuted=True, where=where)
        return Permuted(ifact.sort, 0)
    if isinstance(ifact, Unsort):
        if not (isinstance(sfact, Permuted) and sfact.sort == ifact.sort and sfact.dim == 0):
            ctx.mix(f"it indexes with the inverse permutation of {_named(ifact.sort, where)} "
                    f"a value whose rows are not in that sort's order ({sfact})",
                    "index only the sorted rows with the inverse permutation")
        _rest_per_row(ctx, rest, ifact.sort, allow_permuted=False, where=where)
        return Batched(0, ifact.sort.factor)
    return None


def _rest_per_row(ctx: RuleContext, rest: Sequence[Any], sort: Sort, *, allow_permuted: bool,
                  where: Callable[[fx.Node], str]) -> None:
    """Index entries after dim 0: slices, None, batch-free tensors or (when gathering) per-row
    data of the same sort, which pair up with the rows."""
    for entry in rest:
        f = _fact(ctx, entry)
        if entry is None or isinstance(entry, (slice, type(Ellipsis), int)) or f == Free():
            continue
        if allow_permuted and isinstance(f, Permuted) and f.sort == sort:
            continue
        ctx.mix(f"it indexes rows moved by {_named(sort, where)} with a per-sample index "
                f"({f}) in another order", "index the other dims with batch-free values")


def _write(ctx: RuleContext, name: str, sort: Sort | None,
           where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """Writes along dim 0 with a token index: sorted rows back to their tokens."""
    base = ctx.arg(0, "input")
    accumulate = name in _ADDS
    if name in _PUTS:
        indices = list(ctx.arg(1, "indices") or [])
        index, src = (indices[0] if indices else None), ctx.arg(2, "values")
        if len(indices) != 1:
            return None
        accumulate = bool(ctx.arg(3, "accumulate", False))
    else:  # index_add(x, dim, idx, src), scatter(x, dim, idx, src), index_copy(...)
        d, index, src = ctx.arg(1, "dim"), ctx.arg(2, "index"), ctx.arg(3, "source")
        if name.startswith("scatter"):
            src = ctx.arg(3, "src", ctx._kwargs.get("value"))
        info = _info(ctx, base)
        if not isinstance(d, int) or info is None or d % max(info.ndim, 1) != 0:
            return None
    ifact, bfact, sfact = _fact(ctx, index), _fact(ctx, base), _fact(ctx, src)
    if not isinstance(ifact, TokenIndex):
        return None
    sort = ifact.sort
    if _positions(sfact, sort.factor) and ifact.bijective and not accumulate:
        _no_later_reads(ctx, base, Unsort(sort), bfact, where)
        return Unsort(sort)  # inv[perm] = arange(N)
    if not (isinstance(sfact, Permuted) and sfact.sort == sort and sfact.dim == 0) and \
            sfact != Free():
        ctx.mix(f"it writes rows to the tokens chosen by {_named(sort, where)}, but the rows "
                f"written are not in that sort's order ({sfact})",
                "write the sorted rows back with the indices of the same sort")
    if not accumulate and not ifact.bijective:
        ctx.mix(f"it writes several sorted rows of {_named(sort, where)} to the same token "
                "without adding them up, so which row survives depends on the whole batch's "
                "order", "add the rows up: index_add / scatter_add / index_put(accumulate=True)")
    full = not accumulate and (name in _PUTS or name.startswith("index_copy") or
                               _same_shape(ctx, index, base))
    if not full and not _is_per_token(bfact, ifact.factor):
        ctx.mix(f"it adds the rows sorted by {_named(sort, where)} into a tensor that is not "
                f"per-sample rows in token order of {ifact.factor} rows per sample ({bfact})",
                "add them into zeros shaped like the flattened tokens: "
                "torch.zeros_like(x).index_add(0, perm // top_k, rows)")
    out = Batched(0, ifact.factor)
    _no_later_reads(ctx, base, out, bfact, where)
    return out


def _no_later_reads(ctx: RuleContext, base: Any, out: Any, before: Any,
                    where: Callable[[fx.Node], str]) -> None:
    """An in-place write whose target is read again later: those reads see the new values,
    so the target's fact must not change."""
    node = ctx.node
    if not (node_name(node).endswith("_") and isinstance(base, fx.Node)) or out == before:
        return
    later = set()
    n = node.next
    while n.op != "root":
        later.add(n)
        n = n.next
    if any(u in later for u in base.users):
        ctx.mix(f"it writes in place into {base.name!r}, which is read again afterwards as "
                f"{before} though it now holds {out}",
                "use the out-of-place form and its result")


def _same_shape(ctx: RuleContext, a: Any, b: Any) -> bool:
    ia, ib = _info(ctx, a), _info(ctx, b)
    return ia is not None and ib is not None and ia.shape_a == ib.shape_a and \
        ia.shape_b == ib.shape_b


def _count(ctx: RuleContext, name: str, sort: Sort | None,
           where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """histc of the sorted key: the sizes of its runs."""
    key = ctx.arg(0, "input")
    fact = _fact(ctx, key)
    if isinstance(fact, Permuted) and fact.key:
        return _histc(ctx, fact.sort.key)
    return None


def _cumsum(ctx: RuleContext, name: str, sort: Sort | None,
            where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    fact = _fact(ctx, ctx.arg(0, "input"))
    if isinstance(fact, GroupCounts) and not fact.offsets and ctx.arg(1, "dim") in (0, -1):
        return GroupCounts(fact.key, offsets=True)
    return None


def _sort_again(ctx: RuleContext, name: str, sort: Sort | None,
                where: Callable[[fx.Node], str]) -> Fact | DispatchFact | None:
    """argsort of the permutation is its inverse."""
    fact = _fact(ctx, ctx.arg(0, "input"))
    info = _info(ctx, ctx.arg(0, "input"))
    if not (isinstance(fact, TokenIndex) and fact.bijective and info is not None
            and info.ndim == 1 and not ctx.arg(2, "descending", False)):
        return None
    inverse = Unsort(fact.sort)
    if name == "argsort":
        return inverse
    if name == "sort":  # the values are 0..N-1 in order: each row's own position
        return Container(((0, Batched(0, fact.factor, positions=True)), (1, inverse)))
    return None


_SPECIAL: dict[str, Special] = {
    **{n: _cast for n in _CASTS},
    **{n: _creation for n in _CREATIONS},
    **{n: _broadcast for n in _BROADCASTS},
    **{n: _floor_div for n in _FLOOR_DIVS},
    **{n: _mod for n in _MODS},
    "div": _div,
    **{n: _read for n in _READS},
    **{n: _write for n in _ADDS | _PUTS | _COPIES},
    **{n: _count for n in _COUNTS},
    **{n: _cumsum for n in _CUMSUMS},
    **{n: _sort_again for n in _SORTS},
}


# ---------------------------------------------------------------------------
# The grouped matmul
# ---------------------------------------------------------------------------

def _grouped_mm(ctx: RuleContext, sort: Sort | None,
                where: Callable[[fx.Node], str]) -> Fact | DispatchFact:
    """grouped_mm(x', W, offs): the runs of the sorted rows meet their own group's weight."""
    spec = _grouped_matmul(ctx.node)
    assert spec is not None
    x, w, offs = (_arg(ctx, s) for s in spec)
    xf, wf, of = _fact(ctx, x), _fact(ctx, w), _fact(ctx, offs)
    others = [f for a in _flat_args(ctx) if a not in (x, offs)
              for f in [_fact(ctx, a)] if f != Free()]
    xinfo = _info(ctx, x)
    if not (isinstance(xf, Permuted) and xf.dim == 0 and xinfo is not None
            and xinfo.ndim == 2) or wf != Free() or others:
        ctx.mix("it runs a grouped matmul whose rows are not the sorted per-token rows of "
                f"one sort ({xf}), or whose weights depend on the batch ({wf})",
                "gather the tokens in the sort's order and keep the expert weights batch-free")
    if not (isinstance(of, GroupCounts) and of.offsets and of.key is xf.sort.key):
        ctx.mix(f"its group offsets ({of}) are not the cumulative counts of the key that "
                f"{_named(xf.sort, where)} sorted the rows by, so a row's group is decided by "
                "its place in the batch, not by its own key",
                "count the same key the rows were sorted by: "
                "cumsum(histc(sorted_ids, bins=E, min=0, max=E - 1))")
    if xf.sort.descending:
        ctx.mix(f"{_named(xf.sort, where)} sorts descending while the group offsets count the "
                "groups in ascending order, so each run of rows meets another group's "
                "weights, decided by the counts of the whole batch",
                "sort the expert ids ascending")
    return Permuted(xf.sort, 0)


# ---------------------------------------------------------------------------
# Per-row ops: the rule table, with every sorted row as a sample of its own
# ---------------------------------------------------------------------------

def _per_row(ctx: RuleContext, rule: Rule | None, facts: Sequence[Any], sort: Sort | None,
             where: Callable[[fx.Node], str]) -> Fact | DispatchFact:
    """An op on sorted rows (and batch-free values): the table's rule decides, seeing each
    sorted row as a per-sample row; the result must keep the rows where they were."""
    for f in (p for fact in facts for p in _pieces(fact)):
        if isinstance(f, TokenIndex | Unsort):
            ctx.mix(f"it uses the {'permutation' if isinstance(f, TokenIndex) else 'inverse'} "
                    f"of {_named(f.sort, where)} as a value: these are positions of tokens in "
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
            ctx.mix(f"it combines rows sorted by {_named(sort, where)} with per-sample rows in "
                    f"token order ({f}), so row j of one is not the token of row j of the other",
                    "undo the permutation first (x_sorted[inv]) or gather the other value in "
                    "the sort's order (y[perm // top_k])")
    assert sort is not None
    if rule is None:
        raise NoRule(ctx.node)
    sub = {n: _as_rows(ctx.facts[n]) for n in _flat_args(ctx) if is_dispatch_fact(ctx.facts[n])}
    view = dataclasses.replace(ctx, facts=ChainMap(sub, ctx.facts))  # type: ignore[arg-type]
    try:
        out = apply_rule(rule, view)
    except _Rejected as rejected:
        raise _Rejected(f"{rejected.reason}; its rows are the batch's tokens in the order of "
                        f"{_named(sort, where)}, so this mixes tokens of different samples",
                        ("work on each sorted row alone (elementwise ops, per-row matmuls, "
                         "grouped_mm) until the permutation is undone", *rejected.fixes)
                        ) from None
    return _back(ctx, out, sort, where)


def _as_rows(fact: Any) -> Any:
    """Sorted rows seen as per-sample rows (each row a sample of its own, for the rule)."""
    if isinstance(fact, Container):
        return Container(tuple((k, _as_rows(f)) for k, f in fact.items))
    if isinstance(fact, Permuted):
        return Batched(fact.dim, fact.sort.factor)
    return fact


def _back(ctx: RuleContext, fact: Any, sort: Sort,
          where: Callable[[fx.Node], str]) -> Fact | DispatchFact:
    """A fact computed with sorted rows seen as samples, in terms of the sort again."""
    if isinstance(fact, Container):
        return Container(tuple((k, _back(ctx, f, sort, where)) for k, f in fact.items))
    if isinstance(fact, Batched):
        if fact.factor != sort.factor or fact.positions:
            ctx.mix(f"it regroups the rows sorted by {_named(sort, where)} (a reshape that "
                    f"merges or splits them: {sort.factor} rows per sample become "
                    f"{fact.factor}), putting tokens of different samples together",
                    "keep one token per row until the permutation is undone")
        return Permuted(sort, fact.dim)
    return fact  # Free, BatchSize, Reduced: a sum over all rows is a sum over the batch

