"""The clock, which forward cannot read: capture runs forward once, at compile time, so
the time it read would be a constant of every step (``code_reach.py`` refuses the call).

``time``'s functions are looked up by identity; ``datetime``'s ``now``, ``utcnow`` and
``today`` are class methods, bound anew at each access, so they are known by their class
and name. Code may reach the clock through a module or class it holds in a closure
(``import time`` inside the function that defines the model), not only a global chain:
``names_clock`` says whether the attribute names a code uses on such a value may read it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["CLOCK_FUNCTIONS", "clock_read", "names_clock"]

#: (not ``localtime``, ``gmtime``, ``ctime``, ``strftime``: given a time they read no clock,
#: and a profile's call event does not tell their arguments)
CLOCK_FUNCTIONS = (time.time, time.time_ns, time.perf_counter, time.perf_counter_ns,
                   time.monotonic, time.monotonic_ns, time.process_time, time.process_time_ns,
                   time.thread_time, time.thread_time_ns)
_DATETIME = frozenset({"now", "utcnow", "today"})
_OWNERS = {id(time): frozenset(f.__name__ for f in CLOCK_FUNCTIONS),
           **{id(c): _DATETIME for c in (datetime, datetime.datetime, datetime.date)}}


def clock_read(value: Any) -> str | None:
    """What calling ``value`` does when it is one of datetime's clock reads (None: not)."""
    owner = getattr(value, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, datetime.date) and \
            getattr(value, "__name__", "") in _DATETIME:
        return f"reads the clock ({owner.__name__}.{value.__name__})"
    return None


def names_clock(value: Any, attributes: Iterable[str]) -> bool:
    """Whether code that uses ``attributes`` on ``value`` (a module or class) may read the
    clock through it (then the trace is watched for the call itself)."""
    return not _OWNERS.get(id(value), frozenset()).isdisjoint(attributes)
