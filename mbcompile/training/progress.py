"""The Trainer's terminal display: one live progress bar per phase (validation nested
inside a fit shares it) and the lines printed above it.

>>> trainer = Trainer(model, opt, gbs=16, num_csx=4)   # progress=True: a bar per phase
>>> trainer.fit(data, max_steps=10)      # "train", a bar, "10/10", "loss 2.3012", the time
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["ProgressMixin"]


class ProgressMixin:
    """The progress bars and printed lines of a Trainer (``progress=False``: lines only)."""

    progress: bool
    console: Console
    _live: Progress | None

    @contextmanager
    def _task(self, description: str, total: int | None, completed: int = 0
              ) -> Iterator[Any]:
        if not self.progress:
            yield None
            return
        outer = self._live is None
        if outer:  # one live display for nested phases (validation inside fit)
            self._live = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                                  TimeElapsedColumn(), console=self.console)
            self._live.start()
        live = self._live
        task = live.add_task(description, total=total, completed=completed, loss="-")
        try:
            yield task
        finally:
            if outer:
                live.stop()
                self._live = None
            else:
                live.remove_task(task)

    def _print(self, message: str) -> None:
        console = self._live.console if self._live is not None else self.console
        console.print(message, markup=False, highlight=False)
