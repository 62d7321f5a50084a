"""The Trainer's rows: one per step, to ``metrics.csv`` and ``metrics.jsonl``.

A row holds the step, the loss, the plan the step ran with (MBS, microbatches),
its time and throughput, the learning rate and the user's metrics; a resumed run
keeps the rows its checkpoint counted and appends after them.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["COLUMNS", "Metric", "MetricsLog", "make_row"]

#: Columns of every logged row, in file order; user metrics follow.
COLUMNS = ("phase", "step", "global_step", "loss", "mbs", "num_microbatches", "samples",
           "time_s", "samples_per_s", "lr")

Metric = Callable[[Any, Any], Any]  # (model output, batch) -> number


def make_row(phase: str, step: int, global_step: int, plan: Any, loss: torch.Tensor,
             seconds: float, lr: Any, metrics: Mapping[str, Metric], output: Any,
             batch: Any) -> dict[str, Any]:
    """One step's row: ``COLUMNS`` (from the step's ``MicrobatchPlan``), then ``metrics``."""
    row: dict[str, Any] = {
        "phase": phase, "step": step, "global_step": global_step,
        "loss": float(loss.detach()), "mbs": plan.mbs,
        "num_microbatches": plan.num_microbatches, "samples": plan.gbs,
        "time_s": round(seconds, 6),
        "samples_per_s": round(plan.gbs / seconds, 3) if seconds > 0 else None,
        "lr": float(lr) if isinstance(lr, (int, float)) else None,
    }
    for name, fn in metrics.items():
        value = fn(output, batch)
        row[name] = float(value.detach()) if isinstance(value, torch.Tensor) else value
    return row


class MetricsLog:
    """Rows to ``metrics.csv`` and ``metrics.jsonl`` under ``folder``, flushed per row."""

    def __init__(self, folder: Path, columns: Sequence[str]) -> None:
        self.folder = folder
        self.columns = list(columns)
        self.csv_path = folder / "metrics.csv"
        self.json_path = folder / "metrics.jsonl"
        self._started = False
        self.rows = 0  # rows in the files

    def resume(self, rows: int) -> list[dict[str, Any]]:
        """Keep the first ``rows`` rows of both files (a checkpoint's count) and append after
        them: what a killed run logged after its checkpoint is redone, never duplicated.
        Returns the rows kept."""
        lines = self.json_path.read_text().splitlines() if self.json_path.exists() else []
        records = []
        if self.csv_path.exists():
            with open(self.csv_path, newline="") as f:
                records = list(csv.reader(f))
        kept = lines[:rows]
        if rows and (len(kept) < rows or len(records) < rows + 1):
            print(f"resume: {self.json_path} and {self.csv_path} hold fewer than the "
                  f"{rows} rows of the checkpoint; the rows after them are appended",
                  file=sys.stderr, flush=True)
        header = records[0] if records else list(self.columns)
        self._replace(self.json_path, "".join(line + "\n" for line in kept))
        with open(self.csv_path.with_name(self.csv_path.name + ".tmp"), "w", newline="") as f:
            # under this run's columns, by name: a Trainer whose metrics come in another
            # order wrote its values under the first run's headers
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(dict(zip(header, r)) for r in records[1:rows + 1])
        os.replace(self.csv_path.with_name(self.csv_path.name + ".tmp"), self.csv_path)
        self._started, self.rows = True, len(kept)
        return [json.loads(line) for line in kept]

    @staticmethod
    def _replace(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def write(self, row: Mapping[str, Any]) -> None:
        mode = "a" if self._started else "w"
        if not self._started:
            self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.csv_path, mode, newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if not self._started:
                writer.writeheader()
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in self.columns})
        with open(self.json_path, mode) as f:
            f.write(json.dumps(dict(row), default=str) + "\n")
        self._started = True
        self.rows += 1
