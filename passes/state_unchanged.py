"""Whether everything a ``python_state.Snapshot`` recorded is still as it was, cheaply.

``Snapshot.changes`` lists each difference with its place, comparing key by key in Python
(tens of microseconds for one layer). A sandboxed hook call almost always changes nothing,
so ``unchanged`` answers that first, by identity and in C (``map(operator.is_, ...)``): each
module's ``__dict__``, parameter, buffer and submodule slots and hook tables, each recorded
container and object, each global and closure slot. It may answer False where ``changes``
finds nothing (a key deleted and set again to the same value, a torch cache rebuilt): the
caller then asks ``changes``, which decides. It never answers True where something differs.

Example::

    snapshot = Snapshot({"<the layer>": layer})
    unchanged(snapshot)        # True
    layer.seen = 1
    unchanged(snapshot)        # False; snapshot.changes() names ``seen``
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from operator import is_
from typing import Any

from .python_state import DELETED, Snapshot

__all__ = ["definition", "definitions_unchanged", "unchanged"]


def _same(now: dict[Any, Any], before: dict[Any, Any]) -> bool:
    """The same keys and values, by identity, in the same order."""
    return len(now) == len(before) and (not now or all(map(is_, now, before)) and
                                        all(map(is_, now.values(), before.values())))


def unchanged(snapshot: Snapshot) -> bool:
    """Whether every object ``snapshot`` recorded holds what it held then (see above)."""
    for mod, _, own, slot_copies in snapshot.modules:
        if not _same(mod.__dict__, own):
            return False
        for slots, before in zip((mod._parameters, mod._buffers, mod._modules), slot_copies):
            if not _same(slots, before):
                return False
    for table, before in snapshot.hooks:  # most are empty: no call for those
        if (table or before) and not _same(table, before):
            return False
    for owner, key, before, _ in snapshot.slots:
        if owner.get(key, DELETED) is not before:
            return False
    for obj, _, copy in snapshot.saved.values():
        if isinstance(obj, dict):
            if not _same(obj, copy):
                return False
        elif isinstance(obj, (list, collections.deque)):
            if len(obj) != len(copy) or not all(map(is_, obj, copy)):
                return False
        elif isinstance(obj, set):
            if obj != copy:
                return False
        elif not isinstance(obj, frozenset) and not _same(vars(obj), copy):
            return False
    return True


def definition(obj: Any) -> Any:
    """What a walk of the user's code read of a function or class it entered: the
    function's code and defaults, or a copy of the class's namespace (its methods)."""
    if isinstance(obj, type):
        return dict(vars(obj))
    return obj.__code__, obj.__defaults__, obj.__kwdefaults__


def definitions_unchanged(defs: Iterable[tuple[Any, Any]]) -> bool:
    """Whether each function and class of ``defs`` (``(obj, definition(obj))``) is defined
    as it was, by identity: a method or ``__code__`` swapped leads a walk elsewhere."""
    for obj, before in defs:
        if isinstance(obj, type):
            if not _same(vars(obj), before):  # type: ignore[arg-type]
                return False
        elif not all(map(is_, definition(obj), before)):
            return False
    return True
