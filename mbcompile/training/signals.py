"""SIGINT and SIGTERM during a fit: finish the step, agree on ranks, then stop.

``StopSignals`` turns the first signal into a request that every rank honours after
the same step (the Trainer writes a checkpoint, then raises ``TrainingInterrupted``);
a second signal stops the run at once.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["REPEAT_WINDOW_S", "StopSignals", "TrainingInterrupted", "describe_signal"]

#: A second SIGINT/SIGTERM within this many seconds of the first is the same request
#: delivered twice (the terminal sends Ctrl-C to every rank and the launcher forwards it).
REPEAT_WINDOW_S = 2.0


class TrainingInterrupted(KeyboardInterrupt):
    """A fit stopped by SIGINT or SIGTERM after a whole step (a ``KeyboardInterrupt``
    also for SIGTERM, so that ``except Exception`` does not swallow it).

    ``signum`` is the signal, ``step`` the last finished step and ``checkpoint`` the
    folder written for it (None when the trainer has no checkpoint folder, or when a
    second signal stopped the run at once).
    """

    def __init__(self, signum: int, step: int | None = None,
                 checkpoint: Path | None = None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        if step is None:
            text = f"stopped at once by a second {name}; no checkpoint of the current step"
        elif checkpoint is None:
            text = f"stopped by {name} after step {step}; no checkpoint folder was configured"
        else:
            text = (f"stopped by {name} after step {step}; checkpoint {checkpoint}: resume "
                    "with fit(..., resume=True)")
        super().__init__(text)

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process this signal ended: 130 (SIGINT), 143 (SIGTERM)."""
        return 128 + self.signum


class StopSignals:
    """SIGINT and SIGTERM while a fit runs: the first asks it to stop after the current
    step; a second one (later than ``REPEAT_WINDOW_S``) stops it at once.

    On ranks (``group`` given) the request is agreed on: each step's end starts an
    all-reduce of the local request on the CPU group, and the next step's end reads
    it, so every rank stops after the same step (one step after the signal) and no
    step waits on the agreement. ``agreed(final=True)`` settles it at once.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}
        self._work: Any = None
        self._sent: torch.Tensor | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        self._work = None  # on an error path, never wait on ranks that may be gone

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
        elif now - self._first_at > REPEAT_WINDOW_S:
            raise TrainingInterrupted(signum)

    def agreed(self, *, final: bool = False) -> int:
        """The signal every rank stops for now (0: go on)."""
        if self.group is None:
            return self.signum
        import torch.distributed as dist

        decided = 0
        if self._work is not None:
            self._work.wait()
            decided = int(self._sent[0])
            self._work = None
        if decided:
            return decided
        flag = torch.tensor([self.signum], dtype=torch.int64)
        if final:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            return int(flag[0])
        self._sent = flag
        self._work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)
        return 0


def describe_signal(signum: int) -> str:
    return signal.Signals(signum).name
