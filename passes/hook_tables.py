"""Hook tables (torch's dicts of hooks, by handle id) set aside and put back in place.

torch holds a module's, a tensor's and the global hook tables by identity, so they are
emptied and refilled in place, never replaced; what was registered while they were set
aside comes after what was there, as it would have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["emptied", "refill"]


def refill(table: dict[int, Any], before: dict[int, Any]) -> None:
    """``table`` holding ``before``'s hooks, in their order, then those added since."""
    added = dict(table)
    table.clear()
    table.update(before)
    table.update(added)


@contextlib.contextmanager
def emptied(tables: Iterable[dict[int, Any]]) -> Iterator[None]:
    """Each of ``tables`` empty in the block, refilled after it (``refill``)."""
    saved = [(table, dict(table)) for table in tables if table]
    for table, _ in saved:
        table.clear()
    try:
        yield
    finally:
        for table, before in saved:
            refill(table, before)
