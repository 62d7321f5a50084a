"""Grouped matmuls: ``grouped_mm(x', W, offs)`` runs each group's run of sorted rows through
that group's weights, so row j meets ``W[group of j]``, a function of its own key alone
(see ``tokens``).

A grouped matmul is a table line keyed by its qualified name (a library registers its op
when it loads, after the table is filled): ``grouped_matmul(input, weight, offsets)`` is
its rule, each argument a name (at positions 0, 1, 2) or a ``(position, name)`` pair.
``GROUPED_MATMULS`` shows those lines as a mapping, name -> places; declare a kernel of
your own there, or register its rule::

    GROUPED_MATMULS["mylib::grouped_mm"] = ((0, "x"), (1, "w"), (2, "offs"))
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, MutableMapping

from ..facts import Fact, Free
from .context import Rule, RuleContext
from .table import TABLE
from .token_rules import dispatching
from .tokens import (
    DispatchFact,
    GroupCounts,
    Permuted,
    Sort,
    fact_of,
    flat_args,
    info_of,
    sort_name,
)

__all__ = ["GROUPED_MATMULS", "GroupedMatmuls", "Places", "grouped_matmul"]

#: Where a grouped matmul's input, weights and offsets are: (position, keyword) each.
Places = tuple[tuple[int, str], tuple[int, str], tuple[int, str]]


def grouped_matmul(input: tuple[int, str] | str, weight: tuple[int, str] | str,
                   offsets: tuple[int, str] | str) -> Rule:
    """The rule of a grouped matmul with its input, weights and offsets at these places."""
    places = [(i, p) if isinstance(p, str) else p for i, p in enumerate((input, weight, offsets))]
    return _rule(tuple((int(i), str(n)) for i, n in places))  # type: ignore[arg-type]


@functools.cache
def _rule(places: Places) -> Rule:
    """One rule object per places, so a declaration made again is the same table entry."""

    def special(ctx: RuleContext, name: str, sort: Sort | None) -> Fact | DispatchFact:
        return _grouped_mm(ctx, places)

    rule = dispatching(special)(None)
    rule.grouped_matmul = places  # type: ignore[attr-defined]
    return rule


class GroupedMatmuls(MutableMapping[str, Places]):
    """The table's grouped-matmul lines as a mapping: qualified name -> places."""

    def __getitem__(self, name: str) -> Places:
        places = getattr(TABLE.rules.get(name), "grouped_matmul", None)
        if places is None:
            raise KeyError(name)
        return places

    def __setitem__(self, name: str, places: Places) -> None:
        TABLE.rules[name] = grouped_matmul(*places)

    def __delitem__(self, name: str) -> None:
        self[name]  # noqa: B018 (a KeyError unless it is a grouped matmul's line)
        del TABLE.rules[name]

    def __iter__(self) -> Iterator[str]:
        return iter([k for k, rule in TABLE.rules.items() if hasattr(rule, "grouped_matmul")])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"GROUPED_MATMULS({dict(self)!r})"


GROUPED_MATMULS = GroupedMatmuls()


def _grouped_mm(ctx: RuleContext, places: Places) -> Fact | DispatchFact:
    """grouped_mm(x', W, offs): the runs of the sorted rows meet their own group's weight."""
    x, w, offs = (ctx.arg(index, name) for index, name in places)
    xf, wf, of = fact_of(ctx, x), fact_of(ctx, w), fact_of(ctx, offs)
    others = [f for a in flat_args(ctx) if a not in (x, offs)
              for f in [fact_of(ctx, a)] if f != Free()]
    xinfo = info_of(ctx, x)
    if not (isinstance(xf, Permuted) and xf.dim == 0 and xinfo is not None
            and xinfo.ndim == 2) or wf != Free() or others:
        ctx.mix("it runs a grouped matmul whose rows are not the sorted per-token rows of "
                f"one sort ({xf}), or whose weights depend on the batch ({wf})",
                "gather the tokens in the sort's order and keep the expert weights batch-free")
    if not (isinstance(of, GroupCounts) and of.offsets and of.key is xf.sort.key):
        ctx.mix(f"its group offsets ({of}) are not the cumulative counts of the key that "
                f"{sort_name(xf.sort)} sorted the rows by, so a row's group is decided by "
                "its place in the batch, not by its own key",
                "count the same key the rows were sorted by: "
                "cumsum(histc(sorted_ids, bins=E, min=0, max=E - 1))")
    if xf.sort.descending:
        ctx.mix(f"{sort_name(xf.sort)} sorts descending while the group offsets count the "
                "groups in ascending order, so each run of rows meets another group's "
                "weights, decided by the counts of the whole batch",
                "sort the expert ids ascending")
    return Permuted(xf.sort, 0)
