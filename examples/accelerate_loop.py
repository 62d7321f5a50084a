"""Hugging Face Accelerate with a compiled model, in one process.

    python examples/accelerate_loop.py

(Not ``accelerate.py``: a script of that name would shadow the package it imports.)

``accelerator.prepare`` takes the compiled module like any model, and the training loop
stays the usual one. Accelerate's own gradient accumulation (``accumulate()``,
``gradient_accumulation_steps``) stays off: the compiled module already runs the global
batch as microbatches and hands back the full batch's gradient.

    cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch)
    cm, opt = accelerator.prepare(cm, opt)
    loss = cm(x, y)[0]; accelerator.backward(loss); opt.step(); opt.zero_grad()

(On several processes, compile with ``backend="torch.distributed"``, which reduces the
gradients itself, and prepare with ``mbcompile.integrations.accelerate.prepare``, which
keeps DistributedDataParallel from reducing them again: examples/accelerate_ranks.py.)

The script trains the tiny GPT for three optimizer steps of gbs 6 over 2 systems (mbs 2),
in float64, and checks the parameters against three plain full-batch steps.
"""

from __future__ import annotations

import copy
import sys

import torch
from accelerate import Accelerator

import mbcompile
from mbcompile.models import make_tiny_gpt

GBS, NUM_CSX, MBS, STEPS, LR = 6, 2, 2, 3, 0.1


def batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [make_tiny_gpt(GBS, seed=seed + 10 * (i + 1))[1] for i in range(STEPS)]


def train_with_accelerate(model: torch.nn.Module) -> torch.nn.Module:
    data = batches()
    accelerator = Accelerator(cpu=True)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=data[0])
    opt = torch.optim.SGD(cm.parameters(), lr=LR, momentum=0.9)
    cm, opt = accelerator.prepare(cm, opt)
    for batch in data:
        loss = cm(*batch)[0]
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return model


def train_plain(model: torch.nn.Module) -> torch.nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for batch in batches():
        model(*batch)[0].backward()
        opt.step()
        opt.zero_grad()
    return model


def max_difference() -> float:
    model, _ = make_tiny_gpt(GBS, dtype=torch.float64)
    plain = train_plain(copy.deepcopy(model))
    compiled = train_with_accelerate(model)
    with torch.no_grad():
        return max(float((a - b).abs().max())
                   for a, b in zip(plain.parameters(), compiled.parameters()))


if __name__ == "__main__":
    difference = max_difference()
    print(f"Accelerate + mbcompile vs plain full-batch steps: max parameter difference "
          f"{difference:.2e}")
    sys.exit(0 if difference <= 1e-10 else 1)
