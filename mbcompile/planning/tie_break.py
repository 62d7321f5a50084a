"""``mbs="auto"`` with ``measure=True``: a flat modelled curve's tie broken by the clock.

The cost model prices a CPU host's step to within about 10% (``benchmarks/
bench_auto_time.py``); where several MBS values are modelled that close to the fastest,
the model cannot tell them apart, and timing them can. Each candidate's step is then
the modelled one with its microbatch loop measured (``HostTimer``: real forward and
backward at each microbatch size), so the terms no timing covers (the join, the
optimizer) stay the model's.

>>> measured_tie(selector, fitting=[2, 3, 4], best=selector.evaluate(4)).mbs
3
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mbcompile.planning.exploration import Candidate

__all__ = ["AUTO_TIE_TOLERANCE", "measured_tie"]

#: With ``measure=True``, ``"auto"`` times every fitting MBS whose modelled step is
#: within this fraction of the fastest and takes the fastest measured.
AUTO_TIE_TOLERANCE = 0.10


def measured_tie(selector: Any, fitting: Sequence[int], best: Candidate) -> Candidate | None:
    """The fastest measured of the ``fitting`` MBS values whose modelled step is within
    ``AUTO_TIE_TOLERANCE`` of ``best``'s; None without a timer (no ``measure=True``), on
    ranks (each would time its own, and their plans must agree), or when only one value
    is that close. ``selector`` is the search's ``Selector`` (its ``timer`` and
    ``evaluate``)."""
    if selector.timer is None or _on_ranks():
        return None
    near = [c for c in (selector.evaluate(m) for m in fitting)
            if c.step_s <= best.step_s * (1 + AUTO_TIE_TOLERANCE)]
    if len(near) < 2:
        return None
    return min(near, key=lambda c: (c.step_s - c.loop_s + (c.measured_loop_s or 0.0), c.mbs))


def _on_ranks() -> bool:
    """A process group of more than one rank is initialised (every rank plans alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
