"""Gradient buckets: how the step's gradient all-reduce is cut, for the run and the plan.

The runtime (``execution/distributed.py``'s ``OverlappedReduce``) launches each bucket
as soon as the last backward makes its gradients final; only the last one, the first
parameters' (the embedding's), waits for the backward to end. The cost model
(``planning/cost.py``) prices that last bucket as the part of the all-reduce the
backward does not hide. Both read the sizes from here, when they run, so a plan made
after a change agrees with the run::

    >>> from mbcompile.planning import buckets
    >>> buckets.bucket_cap(14 * 2**20)       # 14 MiB of gradients: 8 buckets of 1.75 MiB
    1835008
    >>> buckets.BUCKET_BYTES = 4 * 2**20     # before compile(): the plan and the run follow

Users reach it as ``mbcompile.buckets``.
"""

from __future__ import annotations

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "MIN_BUCKETS", "bucket_cap"]

#: Gradient bucket size, DDP's default: big enough to amortise each call's latency.
BUCKET_BYTES = 25 * 1024 * 1024
#: The first bucket launched (the last parameters' gradients), DDP's default: small, so
#: that the wire is busy early in the last backward.
FIRST_BUCKET_BYTES = 1024 * 1024
#: Overlapped buckets are smaller than ``BUCKET_BYTES`` where the gradient is small (but
#: at least ``FIRST_BUCKET_BYTES``): at least this many, so that only the last one (the
#: embedding's, final when the backward ends) is sent after it, not most of the model.
MIN_BUCKETS = 8


def bucket_cap(total_bytes: float) -> int:
    """The size of the overlapped buckets for a gradient of ``total_bytes``: at least
    ``MIN_BUCKETS`` of them, each at least ``FIRST_BUCKET_BYTES``, at most
    ``BUCKET_BYTES``."""
    return int(min(BUCKET_BYTES, max(FIRST_BUCKET_BYTES, -(-total_bytes // MIN_BUCKETS))))
