"""The Trainer's record of its steps: each row kept (``history``), written to the
metrics files, and shown on the terminal: one live progress bar per phase (validation
nested inside a fit shares it) and a line every ``log_every`` steps above it.

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

from mbcompile.training.metrics import MetricsLog

__all__ = ["ProgressMixin"]


class ProgressMixin:
    """The rows, progress bars and printed lines of a Trainer (``progress=False``: no bars
    and no step lines)."""

    progress: bool
    console: Console
    _live: Progress | None
    history: list[dict[str, Any]]
    log: MetricsLog | None
    log_every: int
    metrics: dict[str, Any]

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

    def _record(self, row: dict[str, Any], task: Any, total: int | None) -> None:
        self.history.append(row)
        if self.log is not None:
            self.log.write(row)
        if task is not None:
            self._live.update(task, advance=1, loss=f"{row['loss']:.4f}")
            if row["step"] % self.log_every == 0 or row["step"] == total:
                extra = "".join(f" {k} {row[k]:.4g}" if isinstance(row[k], float) else
                                f" {k} {row[k]}" for k in self.metrics)
                of = f"/{total}" if total else ""
                self._print(f"{row['phase']} step {row['step']}{of}: loss {row['loss']:.4f}"
                            f"{extra}  mbs {row['mbs']}  {row['samples_per_s'] or 0:.0f} "
                            "samples/s")
