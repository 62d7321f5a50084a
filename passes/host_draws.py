"""Draws from Python's and numpy's global random generators, found around a block.

A forward that calls ``random.random()`` or ``np.random.rand()`` would draw once, at
compile time, where eager draws on every call: ``code_reach.reached_code`` refuses it.
These generators live outside torch, so the trace cannot see the call; their states can
be compared::

    refused: list[str] = []
    with draws_refused(refused):
        forward(x)        # random.random() inside
    refused               # ["draws from Python's random module"], the state put back
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["draws_refused"]


def _generators() -> list[tuple[str, Callable[[Any], Any], Any]]:
    """Python's and numpy's global generators: (name, how to set the state, the state)."""
    found: list[tuple[str, Callable[[Any], Any], Any]] = [
        ("Python's random module", random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        found.append(("numpy's random generator", numpy.random.set_state,
                      numpy.random.get_state()))
    return found


def _same_state(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)  # Python's state: a tuple of numbers, compared in C
    except ValueError:  # numpy's holds an array: an array of answers
        return len(a) == len(b) and all(
            bool((x == y).all()) if hasattr(x, "all") else x == y for x, y in zip(a, b))


@contextlib.contextmanager
def draws_refused(refused: list[str]) -> Iterator[None]:
    """After the block, however it ended: a generator drawn from has its state put back,
    and is named in ``refused``."""
    states = _generators()
    try:
        yield
    finally:
        for (name, setter, before), (_, _, now) in zip(states, _generators()):
            if not _same_state(before, now):
                setter(before)
                refused.append(f"draws from {name}")
