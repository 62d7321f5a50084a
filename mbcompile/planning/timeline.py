"""A probe's storage timeline: every storage it made, when, and what its ops added to.

The live bytes after each op of a probe (``probe.py``) follow from the storages the probe
made: each one's bytes, the op that made it and the op it was freed before. Kept beside
the probe's per-op figures, the timeline answers for any subset of the storages: the
probe's own live bytes leave out the parameters' gradients (static memory); the probe of
a graph cut to one block, derived from the one cut to two (``block_probe.first_block``),
also leaves out what the second block's forward made.

>>> t = Timeline(n=3, sizes=np.array([4.0, 8.0]), born=np.array([0, 1]),
...              died=np.array([2, 3]), saved=np.array([False, True]),
...              gradient=np.array([False, False]), added=np.array([1]),
...              added_bytes=np.array([2.0]), added_tags=np.array([0]), casts={})
>>> t.live(~t.gradient).tolist()   # op 0 made 4 bytes, op 1 eight more; the 4 die at op 2
[4.0, 12.0, 8.0]
>>> t.grads(np.array([True])).tolist()   # 2 bytes of gradients added from op 1 on
[0.0, 2.0, 2.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Timeline"]


@dataclass(frozen=True)
class Timeline:
    """The storages one probe made (per storage) and the gradients it added (per addition)."""

    n: int  # ops in the probe
    sizes: np.ndarray  # bytes
    born: np.ndarray  # the op that made it
    died: np.ndarray  # the op it was freed before (``n``: alive to the end)
    saved: np.ndarray  # bool: saved for backward
    gradient: np.ndarray  # bool: a parameter's gradient (static memory, not activations)
    added: np.ndarray  # per gradient added into ``.grad``: the op from which it counts
    added_bytes: np.ndarray
    added_tags: np.ndarray  # the repeated block whose parameter it is (-1: none)
    casts: dict[int, float]  # bytes of autocast's weight copies, by the block that made them

    def live(self, keep: np.ndarray) -> np.ndarray:
        """Live bytes after each op, of the storages ``keep`` (a bool per storage) selects."""
        delta = np.zeros(self.n + 1)
        np.add.at(delta, self.born[keep], self.sizes[keep])
        np.add.at(delta, self.died[keep], -self.sizes[keep])
        return np.cumsum(delta)[:self.n]

    def saved_bytes(self, keep: np.ndarray | None = None) -> float:
        """Bytes saved for backward, of the storages ``keep`` selects (None: all)."""
        saved = self.saved if keep is None else self.saved & keep
        return float(self.sizes[saved].sum())

    def grads(self, keep: np.ndarray) -> np.ndarray:
        """Per op: bytes of the gradients ``keep`` selects, accumulated up to it."""
        delta = np.zeros(self.n + 1)
        np.add.at(delta, self.added[keep], self.added_bytes[keep])
        return np.cumsum(delta)[:self.n]
