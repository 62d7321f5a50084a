"""Bisection over integers: where a monotone yes/no answer changes, in O(log n) calls.

>>> first_true(lambda n: n * n >= 50, 0, 100)
8

The planners ask it of memory and time, which grow (or fall) with a size: the fewest
systems whose per-system batch fits (``fixes.py``), an MBS's longest fitting length
(``length_split.py``), the smallest MBS within the time tolerance (``search.py``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["first_true"]


def first_true(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest ``n`` in ``(low, high]`` where ``holds(n)``, for ``holds`` false at
    ``low``, true at ``high`` and monotone between (false, then true). ``low`` and
    ``high`` are the caller's knowledge and are not asked again; each call asks
    ``holds`` at the midpoints only, so the caller's probes (and what they record) are
    those of a plain bisection.

    >>> first_true(lambda n: n >= 3, 0, 10)
    3
    >>> first_true(lambda n: n >= 3, 2, 3)  # adjacent already: nothing is asked
    3
    """
    while high - low > 1:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid
    return high
