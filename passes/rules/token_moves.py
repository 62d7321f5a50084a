"""Token-dispatch rules of the moves: gathers by a token index (rows into the sort's order),
the unsort (rows back into token order) and writes back by token index (see ``tokens``).

``read`` and ``write`` are ``special``s of ``token_rules.dispatching``: ``x[p]``,
``x.index_select(0, p)`` and ``x.gather(0, p[:, None].expand(...))`` give sorted rows;
``x'[inv]`` gives per-sample rows in token order; ``inv[p] = arange(N)`` gives the unsort;
``zeros.index_add(0, p // k, x')`` (or ``scatter_add``, ``index_put(accumulate=True)``)
adds every sorted row to its own token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from ..facts import Batched, Container, Fact, Free
from .context import RuleContext
from .spellings import node_name
from .token_rules import broadcast
from .tokens import (
    ADD_NAMES,
    PUT_NAMES,
    DispatchFact,
    Permuted,
    Sort,
    TokenIndex,
    Unsort,
    fact_of,
    info_of,
    is_per_token,
    is_positions,
    sort_name,
)

__all__ = ["read", "write"]


def read(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """Gathers along dim 0 with a token index (sorting rows) or with the unsort (undoing it);
    an item of a tuple that holds dispatch values (``torch.sort``'s (values, indices))."""
    source = ctx.arg(0, "input")
    if name == "getitem" and isinstance(fact_of(ctx, source), Container):  # (ids', p)[1]
        return ctx.fact(source).get(ctx.arg(1))
    if name == "getitem":
        index = ctx.arg(1)
        entries = list(index) if isinstance(index, (tuple, list)) else [index]
        dim0, rest = (entries[0] if entries else None), entries[1:]
        if isinstance(fact_of(ctx, source), TokenIndex | Unsort) and all(
                e is None or e is Ellipsis or e == slice(None) for e in entries):
            return broadcast(ctx, name, sort)
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
        info = info_of(ctx, source)
        if not isinstance(d, int) or info is None or d % max(info.ndim, 1) != 0:
            return None
    ifact, sfact = fact_of(ctx, dim0), fact_of(ctx, source)
    if isinstance(ifact, TokenIndex):
        if not is_per_token(sfact, ifact.factor):
            ctx.mix(f"it gathers rows with the token index of {sort_name(ifact.sort)}, "
                    f"which points into an axis of {ifact.factor} rows per sample, from a "
                    f"value that is not per-sample rows in token order of that size ({sfact})",
                    "gather the flattened per-token values (x.reshape(-1, H)) with the "
                    "sort's indices divided by top_k")
        _rest_per_row(ctx, rest, ifact.sort, allow_permuted=True)
        return Permuted(ifact.sort, 0)
    if isinstance(ifact, Unsort):
        if not (isinstance(sfact, Permuted) and sfact.sort == ifact.sort and sfact.dim == 0):
            ctx.mix(f"it indexes with the inverse permutation of {sort_name(ifact.sort)} "
                    f"a value whose rows are not in that sort's order ({sfact})",
                    "index only the sorted rows with the inverse permutation")
        _rest_per_row(ctx, rest, ifact.sort, allow_permuted=False)
        return Batched(0, ifact.sort.factor)
    return None


def _rest_per_row(ctx: RuleContext, rest: Sequence[Any], sort: Sort, *,
                  allow_permuted: bool) -> None:
    """Index entries after dim 0: slices, None, batch-free tensors or (when gathering) per-row
    data of the same sort, which pair up with the rows."""
    for entry in rest:
        f = fact_of(ctx, entry)
        if entry is None or isinstance(entry, (slice, type(Ellipsis), int)) or f == Free():
            continue
        if allow_permuted and isinstance(f, Permuted) and f.sort == sort:
            continue
        ctx.mix(f"it indexes rows moved by {sort_name(sort)} with a per-sample index "
                f"({f}) in another order", "index the other dims with batch-free values")


def write(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact | None:
    """Writes along dim 0 with a token index: sorted rows back to their tokens."""
    base = ctx.arg(0, "input")
    accumulate = name in ADD_NAMES
    if name in PUT_NAMES:
        indices = list(ctx.arg(1, "indices") or [])
        index, src = (indices[0] if indices else None), ctx.arg(2, "values")
        if len(indices) != 1:
            return None
        accumulate = bool(ctx.arg(3, "accumulate", False))
    else:  # index_add(x, dim, idx, src), scatter(x, dim, idx, src), index_copy(...)
        d, index, src = ctx.arg(1, "dim"), ctx.arg(2, "index"), ctx.arg(3, "source")
        if name.startswith("scatter"):
            src = ctx.arg(3, "src", ctx._kwargs.get("value"))
        info = info_of(ctx, base)
        if not isinstance(d, int) or info is None or d % max(info.ndim, 1) != 0:
            return None
    ifact, bfact, sfact = fact_of(ctx, index), fact_of(ctx, base), fact_of(ctx, src)
    if not isinstance(ifact, TokenIndex):
        return None
    sort = ifact.sort
    if is_positions(sfact, sort.factor) and ifact.bijective and not accumulate:
        _no_later_reads(ctx, base, Unsort(sort), bfact)
        return Unsort(sort)  # inv[perm] = arange(N)
    if not (isinstance(sfact, Permuted) and sfact.sort == sort and sfact.dim == 0) and \
            sfact != Free():
        ctx.mix(f"it writes rows to the tokens chosen by {sort_name(sort)}, but the rows "
                f"written are not in that sort's order ({sfact})",
                "write the sorted rows back with the indices of the same sort")
    if not accumulate and not ifact.bijective:
        ctx.mix(f"it writes several sorted rows of {sort_name(sort)} to the same token "
                "without adding them up, so which row survives depends on the whole batch's "
                "order", "add the rows up: index_add / scatter_add / index_put(accumulate=True)")
    full = not accumulate and (name in PUT_NAMES or name.startswith("index_copy") or
                               _same_shape(ctx, index, base))
    if not full and not is_per_token(bfact, ifact.factor):
        ctx.mix(f"it adds the rows sorted by {sort_name(sort)} into a tensor that is not "
                f"per-sample rows in token order of {ifact.factor} rows per sample ({bfact})",
                "add them into zeros shaped like the flattened tokens: "
                "torch.zeros_like(x).index_add(0, perm // top_k, rows)")
    out = Batched(0, ifact.factor)
    _no_later_reads(ctx, base, out, bfact)
    return out


def _no_later_reads(ctx: RuleContext, base: Any, out: Any, before: Any) -> None:
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
    ia, ib = info_of(ctx, a), info_of(ctx, b)
    return ia is not None and ib is not None and ia.shape_a == ib.shape_a and \
        ia.shape_b == ib.shape_b
