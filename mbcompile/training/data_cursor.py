"""The Trainer's position in its data: batches cycled up to a limit, and seeking back.

A checkpoint stores the cursor's position (the pass over the data and the batches
read in it) and the RNG states the pass began with; a resumed run seeks a fresh
cursor there and reads on exactly as the interrupted run would have. The position
counts global batches (on ranks every rank reads the whole batch and takes its
share), so it carries over to another number of systems or ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from mbcompile.training.batches import TrainerError
from mbcompile.training.checkpoint import CheckpointError
from mbcompile.training.rng import rng_state, set_rng_state

__all__ = ["DataCursor", "batches", "length"]


def batches(data: Iterable[Any], limit: int | None, what: str) -> Iterator[Any]:
    """Batches of ``data``; a re-iterable (a list, a DataLoader) is cycled up to ``limit``."""
    return iter(DataCursor(data, limit, what, track_rng=False))


class DataCursor:
    """The training batches: ``data`` cycled up to ``limit``, and where in it we are.

    The position is the pass (each ``iter(data)`` starts one) and the batches read in
    it. ``seek`` puts a fresh cursor where a checkpoint's was: earlier passes are
    read through and dropped, and the current one is started from the RNG states it
    began with (a DataLoader draws its shuffle there), then read up to the position.
    ``sync`` (on ranks: ``rng.broadcast_rng_state``) runs before each pass starts, so
    that every rank draws the same shuffle.
    """

    def __init__(self, data: Iterable[Any], limit: int | None, what: str,
                 track_rng: bool = True, sync: Callable[[], None] | None = None) -> None:
        self.data, self.limit, self.what, self.track_rng = data, limit, what, track_rng
        self.sync = sync
        self.batches = 0  # handed out in this fit
        self.passes = 0  # passes started
        self.in_pass = 0  # batches read in the current pass
        self.pass_rng: dict[str, Any] | None = None  # RNG states when the pass began
        self._it: Iterator[Any] | None = None
        self._one_pass = False  # an iterator cannot be restarted

    def position(self) -> dict[str, int]:
        return {"batches": self.batches, "passes": self.passes, "in_pass": self.in_pass}

    def _start_pass(self) -> None:
        if self.sync is not None:
            self.sync()
        if self.track_rng:
            self.pass_rng = rng_state()
        it = iter(self.data)
        self._one_pass = it is self.data
        self._it, self.passes, self.in_pass = it, self.passes + 1, 0

    def __iter__(self) -> DataCursor:
        return self

    def __next__(self) -> Any:
        if self.limit is not None and self.batches >= self.limit:
            raise StopIteration
        while True:
            if self._it is None:
                if self.passes and (self.limit is None or self._one_pass):
                    raise StopIteration
                self._start_pass()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                if self.in_pass == 0:  # an empty pass: nothing (more) to read
                    if self.batches == 0:
                        raise TrainerError(f"the {self.what} data yielded no batches") from None
                    raise
                continue
            self.in_pass += 1
            self.batches += 1
            return batch

    def seek(self, position: Mapping[str, int], pass_rng: Mapping[str, Any] | None) -> None:
        passes, in_pass = position["passes"], position["in_pass"]
        short = CheckpointError(
            f"the {self.what} data has fewer batches than when the checkpoint was written "
            f"(pass {passes}, batch {in_pass}); an exact resume needs the same data")
        for _ in range(passes - 1):
            self._start_pass()
            if self._one_pass:
                raise CheckpointError(
                    f"the checkpoint is in pass {passes} over the {self.what} data, but the "
                    "data is an iterator, which has one pass; pass a list or a DataLoader")
            for _ in self._it:
                self.in_pass += 1
                self.batches += 1
        if pass_rng is not None:
            set_rng_state(pass_rng)
        self._start_pass()
        for _ in range(in_pass):
            try:
                next(self._it)
            except StopIteration:
                raise short from None
            self.in_pass += 1
            self.batches += 1
        if self.batches != position["batches"]:
            raise short


def length(data: Any, limit: int | None) -> int | None:
    """The batches a phase reads: ``limit``, else ``len(data)``, else None (unknown)."""
    if limit is not None:
        return limit
    try:
        return len(data)
    except TypeError:
        return None
