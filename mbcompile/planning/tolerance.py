"""When two probes' figures count as equal: the one tolerance of the fit and the blocks.

An affine fit (``fit.py``) and a stack of repeated blocks (``block_probe.py``) are kept
only when they reproduce an exact probe to ``FIT_TOLERANCE``, relative to the larger
figure (at least 1, so zero-byte figures compare absolutely).
"""

from __future__ import annotations

import numpy as np

__all__ = ["FIT_TOLERANCE", "close"]

FIT_TOLERANCE = 1e-6


def close(x: float | np.ndarray, y: float | np.ndarray) -> bool:
    """Equal to ``FIT_TOLERANCE``, relative to the larger (at least 1)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    scale = np.maximum(np.maximum(np.abs(x), np.abs(y)), 1.0)
    return bool(np.all(np.abs(x - y) <= FIT_TOLERANCE * scale))
