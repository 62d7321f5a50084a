"""Several compiled graphs per train/eval mode, each valid while its guards hold.

Like dynamo's cache of 8 entries per frame: a call runs the newest entry whose guards
(``passes/guards.py``: the Python values its capture read) all hold, so going back to
an earlier value (``model.beta = 1.0`` after a run at 0.5) costs no compile. A module
attribute holding a number whose guard failed twice (a temperature annealed every
step) is named by ``changing()``: the next capture reads it as a graph input
(``guards.numbers_as_inputs``), fed from its current value on every call, so the
schedule costs at most three compiles, not one per step.

>>> cache = GuardCache()
>>> cache.put(("train",), compiled)        # compiled.guards: beta == 1.0
>>> cache.find(("train",))                 # (compiled, None) while beta is 1.0
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from mbcompile.passes.guard_code import fast_check
from mbcompile.passes.guards import Guard, failed_guard

__all__ = ["LIMIT", "GuardCache"]

LIMIT = 8  #: entries kept per mode key (dynamo's ``cache_size_limit``)
CHANGES = 2  #: failed guards on one number before it becomes a graph input


class _Guarded(Protocol):
    guards: tuple[Guard, ...]


class GuardCache(dict):  # type: ignore[type-arg]
    """Mode key -> its compiled entries, newest first (at most ``LIMIT``)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: Counter[tuple[int, Any]] = Counter()  # (id(module), name) -> count
        self.modules: dict[int, Any] = {}  # keeps the modules counted above alive
        # id(entry) -> (entry, its guards as one function: guard_code.py), for the entries kept
        self.checks: dict[int, tuple[Any, Callable[[], bool]]] = {}
        self.last: Any = None  # the key of the entry put last (what a recompile compares)

    def find(self, key: Any) -> tuple[Any, Guard | None]:
        """The newest entry for ``key`` whose guards hold, else ``(None, the newest entry's
        failed guard)`` (``(None, None)`` when there is no entry)."""
        entries = self.get(key, [])
        first = None
        for entry in entries:
            check = self.checks.get(id(entry))
            if check is None:
                check = self.checks[id(entry)] = (entry, fast_check(entry.guards))
            if check[1]():  # every guard holds: the common case, a few µs
                return entry, None
            failed = failed_guard(entry.guards)  # the guards' own answer, and which failed
            if failed is None:
                return entry, None
            first = first or failed
        if first is not None and not first.item:
            self.failures[(id(first.module), first.name)] += 1
            self.modules[id(first.module)] = first.module
        return None, first

    def put(self, key: Any, compiled: _Guarded) -> None:
        self.last, entries = key, self.setdefault(key, [])
        entries.insert(0, compiled)
        del entries[LIMIT:]
        self._prune()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._prune()

    def _prune(self) -> None:
        """Drop the checks of entries no longer kept (their guards hold the modules)."""
        kept = {id(e) for entries in self.values() for e in entries}
        self.checks = {k: c for k, c in self.checks.items() if k in kept}

    def changing(self) -> frozenset[tuple[int, Any]]:
        """``(id(module), name)`` of the attributes whose guards failed ``CHANGES`` times."""
        return frozenset(k for k, n in self.failures.items() if n >= CHANGES)
