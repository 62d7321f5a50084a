"""Hugging Face Accelerate on two processes with a compiled model.

    python examples/accelerate_ranks.py                                # starts 2 gloo ranks
    accelerate launch --cpu --num_processes 2 examples/accelerate_ranks.py

(Not ``accelerate.py``: run as a script, a file of that name is first on ``sys.path`` and
shadows the package it imports.)

Each process is one system of the plan: create the ``Accelerator`` first (it joins or
starts the process group), compile with ``backend="torch.distributed"``, and prepare with
``mbcompile.integrations.accelerate.prepare``, which is ``accelerator.prepare`` without the
DistributedDataParallel wrapper (the compiled module all-reduces its own gradients, once a
step; DDP would do it a second time):

    accelerator = Accelerator()
    cm = mbcompile.compile(model, gbs, accelerator.num_processes, mbs, example_inputs=batch,
                           backend="torch.distributed")
    loader = DataLoader(ds, batch_size=gbs // accelerator.num_processes)  # a rank's share
    cm, opt, loader = prepare(accelerator, cm, opt, loader)
    loss = cm(x, y)[0]; accelerator.backward(loss); opt.step(); opt.zero_grad()

Accelerate hands process ``r`` the ``r``-th of each ``num_processes`` consecutive batches,
which is the plan's share ``r`` of the global batch when ``gbs`` divides evenly; ``prepare``
refuses a loader that does not (and says how to shard uneven shares instead).

The script trains the tiny GPT for three optimizer steps of gbs 6 (3 samples a process,
mbs 2; padded targets, so the loss is a mean over real tokens) in float64, and checks each
process's parameters against three plain full-batch steps in one process.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import mbcompile
from mbcompile.execution import launcher
from mbcompile.integrations.accelerate import prepare
from mbcompile.models import make_tiny_gpt, token_batch

GBS, WORLD, MBS, STEPS, LR = 6, 2, 2, 3, 0.1


def dataset() -> TensorDataset:
    """Three global batches of token ids and next-token targets (-100 on padding)."""
    return TensorDataset(*token_batch(GBS * STEPS, seed=11))


def initial_model() -> torch.nn.Module:
    """The same weights in every process (one seed)."""
    return make_tiny_gpt(GBS, dtype=torch.float64)[0]


def train_with_accelerate(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """Trains ``model`` on this process's shares; returns what ``prepare`` made of it."""
    data = dataset()
    cm = mbcompile.compile(model, GBS, accelerator.num_processes, MBS,
                           example_inputs=data[:GBS], backend="torch.distributed")
    opt = torch.optim.SGD(cm.parameters(), lr=LR, momentum=0.9)
    loader = DataLoader(data, batch_size=GBS // accelerator.num_processes)
    cm, opt, loader = prepare(accelerator, cm, opt, loader)
    for x, y in loader:
        loss = cm(x, y)[0]
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    return cm


def train_plain(model: torch.nn.Module) -> torch.nn.Module:
    """The reference: three full-batch steps in one process, no mbcompile."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in DataLoader(dataset(), batch_size=GBS):
        model(x, y)[0].backward()
        opt.step()
        opt.zero_grad()
    return model


def max_difference(trained: torch.nn.Module, plain: torch.nn.Module) -> float:
    with torch.no_grad():
        return max(float((a - b).abs().max())
                   for a, b in zip(plain.parameters(), trained.parameters()))


def check_this_process(accelerator: Accelerator) -> float:
    """Trains here and returns the largest parameter difference from the plain steps."""
    model = initial_model()
    plain = train_plain(copy.deepcopy(model))
    prepared = train_with_accelerate(accelerator, model)
    assert prepared.module is model, "prepare wrapped the compiled module"
    difference = max_difference(model, plain)
    print(f"process {accelerator.process_index}: Accelerate + mbcompile vs plain full-batch "
          f"steps: max parameter difference {difference:.2e}", flush=True)
    return difference


def _spawned_rank(rank: int, world: int) -> None:
    """One of the ranks ``launcher.launch`` starts (its process group is up)."""
    if check_this_process(Accelerator(cpu=True)) > 1e-10:
        raise SystemExit(f"rank {rank}: not the plain full-batch result")


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by accelerate launch (or torchrun)
        sys.exit(0 if check_this_process(Accelerator(cpu=True)) <= 1e-10 else 1)
    launcher.launch(_spawned_rank, WORLD)
