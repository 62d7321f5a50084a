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
    """

    def __init__(self, decay: float = 0.9, unit: str = "samples or tokens") -> None:
        self.noise = NoiseScale(decay=decay)
        self.unit = unit

    def setup(self, trainer: Any) -> None:
        trainer.compile_options["measure_noise_scale"] = self.noise

    def on_train_step_end(self, trainer: Any, row: dict[str, Any]) -> None:
        row["b_simple"] = self.noise.b_simple if self.noise.steps else None

    def on_fit_end(self, trainer: Any) -> None:
        trainer._print("noise scale: " + advice(self.noise, self.unit))
