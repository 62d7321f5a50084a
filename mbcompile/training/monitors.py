"""Trainer callbacks that watch the run: the gradient noise scale.

>>> trainer = Trainer(model, opt, gbs=64, num_csx=2, callbacks=[NoiseScaleMonitor()])
>>> trainer.fit(data, max_steps=200)     # each row gets b_simple; advice printed at the end
"""

from __future__ import annotations

from typing import Any

from mbcompile.execution.noise import NoiseScale, advice
from mbcompile.training.flags import Callback

__all__ = ["NoiseScaleMonitor"]


class NoiseScaleMonitor(Callback):
    """Measure the gradient noise scale every training step (``mbcompile.execution.noise``).

    Switches ``measure_noise_scale`` on for the trainer's compiles, adds the
    smoothed ``b_simple`` to every training row, and prints batch-size advice
    when ``fit`` ends. ``unit`` names what the loss averages over.

    ``b_simple`` is one of the trainer's metrics, so it is in the row when the row is
    written to ``metrics.jsonl`` and ``metrics.csv`` (``on_train_step_end`` comes after
    that): the rows a resumed run reads back from the log carry it as they did live.
    """

    COLUMN = "b_simple"

    def __init__(self, decay: float = 0.9, unit: str = "samples or tokens") -> None:
        self.noise = NoiseScale(decay=decay)
        self.unit = unit
        self._validating = 0  # nesting depth: validation inside fit is not a training row

    def setup(self, trainer: Any) -> None:
        trainer.compile_options["measure_noise_scale"] = self.noise
        trainer.metrics[self.COLUMN] = self._b_simple
        # the log's columns were fixed from the metrics before callbacks were set up
        if trainer.log is not None and self.COLUMN not in trainer.log.columns:
            trainer.log.columns.append(self.COLUMN)

    def _b_simple(self, output: Any, batch: Any) -> float | None:
        """The metric: the smoothed estimate after this step's update, on training rows."""
        if self._validating or not self.noise.steps:
            return None
        return self.noise.b_simple

    def on_validate_start(self, trainer: Any) -> None:
        self._validating += 1

    def on_validate_end(self, trainer: Any) -> None:
        self._validating -= 1

    def on_fit_end(self, trainer: Any) -> None:
        trainer._print("noise scale: " + advice(self.noise, self.unit))
