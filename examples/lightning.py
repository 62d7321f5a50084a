"""PyTorch Lightning with a compiled model: three lines change, nothing else.

    python examples/lightning.py

(It imports ``pytorch_lightning``, which this file's name does not shadow; a script that
imports the unified ``lightning`` package must be named otherwise.)

The recipe (the LightningModule holds the compiled module; Lightning's own gradient
accumulation stays off, since the compiled module already runs the global batch as
microbatches and hands back the full batch's gradient):

    self.model = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch)
    loss = self.model(x, y)[0]                       # in training_step
    pl.Trainer(accumulate_grad_batches=1, ...)       # the default: keep it 1

Validation stays on the compiled module (``validation_step`` below), with batches of any
size: a batch of another size than ``gbs`` is planned and compiled once, on first sight,
with one ``BatchSizeWarning`` per size (here the validation batches have 4 samples).

Keep ``accumulate_grad_batches=1``: with ``k`` Lightning adds up the gradients of ``k``
global batches, each loss scaled by ``1/k``, a step over ``k * gbs`` samples in which every
global batch weighs the same however many tokens it has. For a larger batch, compile with
a larger ``gbs``: one exact step, with one microbatch's memory.

The script trains the tiny GPT for three optimizer steps of gbs 6 over 2 systems (mbs 2),
in float64, and checks the parameters against three plain full-batch steps with the same
optimizer, and the validation loss against the plain model's on the same batch.
"""

from __future__ import annotations

import copy
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

import mbcompile
from mbcompile.models import make_tiny_gpt

GBS, NUM_CSX, MBS, STEPS, LR, VAL_BATCH = 6, 2, 2, 3, 0.1, 4


class Compiled(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.model = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch)

    def training_step(self, batch: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
        return self.model(*batch)[0]  # the loss of the whole global batch

    def validation_step(self, batch: tuple[torch.Tensor, ...], index: int) -> None:
        self.log("val_loss", self.model(*batch)[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_tiny_gpt(GBS, seed=seed + 10 * (i + 1))[1] for i in range(STEPS)]


def validation_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Of another size than gbs: the compiled module plans it on first sight."""
    return make_tiny_gpt(VAL_BATCH, seed=99)[1]


def train_with_lightning(model: torch.nn.Module) -> float:
    """Trains ``model`` through Lightning; returns the last validation loss."""
    data = batches()
    module = Compiled(model, data[0])
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=1)
    # batch_size=None: each item already is one global batch of gbs samples
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None),
                val_dataloaders=DataLoader([validation_batch()], batch_size=None))
    return float(trainer.callback_metrics["val_loss"])  # after the last step


def train_plain(model: torch.nn.Module) -> torch.nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for batch in batches():
        opt.zero_grad()
        model(*batch)[0].backward()
        opt.step()
    return model


def max_difference() -> float:
    """The largest difference of a parameter or of the validation loss from plain steps."""
    model, _ = make_tiny_gpt(GBS, dtype=torch.float64)
    plain = train_plain(copy.deepcopy(model))
    val_loss = train_with_lightning(model)
    with torch.no_grad():
        plain_val_loss = float(plain.eval()(*validation_batch())[0])
        return max([abs(val_loss - plain_val_loss)]
                   + [float((a - b).abs().max())
                      for a, b in zip(plain.parameters(), model.parameters())])


if __name__ == "__main__":
    difference = max_difference()
    print(f"Lightning + mbcompile vs plain full-batch steps: max difference of the parameters "
          f"and the validation loss {difference:.2e}")
    sys.exit(0 if difference <= 1e-10 else 1)
