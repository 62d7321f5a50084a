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
from operator import is_, ne
from typing import Any

from .python_state import DELETED, Snapshot

__all__ = ["Fingerprint", "definition", "definitions_unchanged", "unchanged"]


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


_SLOTS = ("_parameters", "_buffers", "_modules")


class Fingerprint:
    """``unchanged(snapshot)`` with its loops in C, for a snapshot compared on every call (a
    kept watch of a hook, twice per call): the keys and values of every dict it compares
    (each module's and plain object's ``__dict__``, fetched again each time, and each slot,
    hook table and recorded dict) and every recorded list's items, in one list compared by
    identity, after their lengths; one empty then is only asked whether it still is. The
    same answer as ``unchanged``: the dicts held here are values of the module dicts
    compared, so one replaced is seen there; a set is compared by ``==`` as there, a global
    by identity.

    >>> fingerprint = Fingerprint(Snapshot({"<the layer>": layer}))
    >>> fingerprint.unchanged()   # True; after ``layer.seen = 1``, False
    """

    __slots__ = ("empty", "filled", "flat", "lengths", "lists", "objects", "set_copies",
                 "sets", "slots", "sure")

    def __init__(self, snapshot: Snapshot) -> None:
        self.objects: list[Any] = []  # whose ``vars`` are compared, fetched on each call
        self.sets: list[Any] = []
        self.set_copies: list[Any] = []
        dicts: list[tuple[Any, Any]] = []  # (the dict or list, its copy)
        lists: list[tuple[Any, Any]] = []
        copies: list[dict[Any, Any]] = []  # of each object's vars
        self.sure = True  # False: a module's slots are not the dicts its ``__dict__`` holds
        for mod, _, own, slot_copies in snapshot.modules:
            self.objects.append(mod)
            copies.append(own)
            slots = (mod._parameters, mod._buffers, mod._modules)
            self.sure &= all(map(is_, slots, map(own.get, _SLOTS)))
            dicts.extend(zip(slots, slot_copies))
        dicts.extend(snapshot.hooks)
        for obj, _, copy in snapshot.saved.values():
            if isinstance(obj, dict):
                dicts.append((obj, copy))
            elif isinstance(obj, (list, collections.deque)):
                lists.append((obj, copy))
            elif isinstance(obj, set):
                self.sets.append(obj)
                self.set_copies.append(copy)
            elif not isinstance(obj, frozenset):
                self.objects.append(obj)
                copies.append(copy)
        # one empty stays empty while it is falsy: only the others are walked
        self.empty = [d for d, c in (*dicts, *lists) if not c]
        self.filled = [d for d, c in dicts if c]
        self.lists = [x for x, c in lists if c]
        copies += [c for _, c in dicts if c]
        self.lengths = [*map(len, copies), *(len(c) for _, c in lists if c)]
        self.flat = _items(copies, [c for _, c in lists if c])
        self.slots = [(owner, key, before) for owner, key, before, _ in snapshot.slots]

    def unchanged(self) -> bool:
        if not self.sure or any(self.empty):
            return False
        dicts = [*map(vars, self.objects), *self.filled]
        if [*map(len, dicts), *map(len, self.lists)] != self.lengths or \
                not all(map(is_, _items(dicts, self.lists), self.flat)):
            return False
        if self.sets and any(map(ne, self.sets, self.set_copies)):
            return False
        for owner, key, before in self.slots:
            if owner.get(key, DELETED) is not before:
                return False
        return True


def _items(dicts: list[Any], lists: list[Any]) -> list[Any]:
    """Each dict's keys and values (its own, as an ``OrderedDict`` orders them), then each
    list's items."""
    flat: list[Any] = []
    for d in dicts:
        flat += d
        flat += d.values()
    for items in lists:
        flat += items
    return flat


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
