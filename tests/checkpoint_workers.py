"""A model and data for tests/test_checkpoint.py, referenced from YAML as
``checkpoint_workers:<name>`` (the test puts this folder on ``PYTHONPATH``).

Both draw from every global RNG a resume must restore: the model's dropout from
torch's, the data's shuffle (a DataLoader without a generator, one draw per pass)
from torch's, and its noise from Python's and numpy's. Environment variables make
a run stop at a chosen place, so that a test can kill or signal it there:

- ``MBC_PAUSE_AT=N`` with ``MBC_PAUSE_DIR``: when rank ``MBC_PAUSE_RANK`` (default
  0) is about to hand out training batch N (counted from 1 over passes, which is
  the step it is for), it writes ``paused-N`` in that folder and waits until
  ``release-N`` appears there;
- ``MBC_SIGNAL_AT=N`` with ``MBC_SIGNAL`` (``SIGINT`` or ``SIGTERM``): the process
  sends itself that signal when it hands out training batch N;
- ``MBC_KILL_AT=N`` with ``MBC_KILL_RANK`` (default 1) and ``MBC_FORWARDS_PER_STEP``
  (that rank's microbatches per step): that rank SIGKILLs itself in the first
  microbatch forward of training step N, in the middle of the step.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

FEATURES, OUT = 4, 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class DropoutMLP(nn.Module):
    """A regression MLP with dropout (so the torch RNG matters); see ``MBC_KILL_AT``."""

    def __init__(self, hidden: int = 16, p: float = 0.25, double: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(FEATURES, hidden)
        self.drop = nn.Dropout(p)
        self.l2 = nn.Linear(hidden, OUT)
        if double:  # float64: runs on other numbers of systems agree to 1e-10
            self.double()
        self._forwards = 0
        kill_at = os.environ.get("MBC_KILL_AT")
        if kill_at and _rank() == int(os.environ.get("MBC_KILL_RANK", "1")):
            self._kill_at = int(kill_at)
            self.l2.register_forward_pre_hook(mbcompile.per_microbatch(self._maybe_die))

    def _maybe_die(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if type(args[0]) is not torch.Tensor or not torch.is_grad_enabled():
            return  # compiling (fake tensors) or validating
        self._forwards += 1
        per_step = int(os.environ.get("MBC_FORWARDS_PER_STEP", "1"))
        if self._forwards == (self._kill_at - 1) * per_step + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pred = self.l2(self.drop(torch.tanh(self.l1(x))))
        return F.mse_loss(pred, y), pred


class _Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g).to(dtype)
        self.y = torch.randn(n, OUT, generator=g).to(dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.01 * random.gauss(0, 1) + 0.01 * float(np.random.randn())
        return self.x[i] + noise, self.y[i]


class PausingLoader:
    """A shuffling DataLoader (global RNG) whose training batches can pause the run."""

    def __init__(self, loader: torch.utils.data.DataLoader, split: str) -> None:
        self.loader, self.split, self.handed = loader, split, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.handed += 1
            if self.split == "train":
                self._maybe_pause(self.handed)
            yield batch

    @staticmethod
    def _maybe_pause(n: int) -> None:
        if os.environ.get("MBC_SIGNAL_AT") == str(n):
            os.kill(os.getpid(), getattr(signal, os.environ["MBC_SIGNAL"]))
        at = os.environ.get("MBC_PAUSE_AT")
        if not at or int(at) != n or _rank() != int(os.environ.get("MBC_PAUSE_RANK", "0")):
            return
        folder = Path(os.environ["MBC_PAUSE_DIR"])
        (folder / f"paused-{n}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 120
        while not (folder / f"release-{n}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


def shuffled(batch_size: int, split: str = "train", samples: int = 40,
             seed: int = 0, double: bool = False) -> PausingLoader:
    """``samples`` noisy regression samples in shuffled batches (a pass is
    ``samples // batch_size`` batches), float64 if ``double``. Seeds Python's and numpy's
    RNGs, which a new process starts from entropy, so that two runs draw the same noise."""
    random.seed(seed)
    np.random.seed(seed)
    data = _Noisy(samples, seed + (0 if split == "train" else 1000),
                  torch.float64 if double else torch.float32)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=split == "train",
                                         drop_last=True)
    return PausingLoader(loader, split)


def shuffles_alike(rank: int, world: int) -> None:
    """A rank of tests/test_elastic_resume.py: ranks whose torch RNGs drifted apart (rank r
    drew r numbers, as dropout over shares of other sizes does) read a shuffled DataLoader
    through DataCursors synced by ``broadcast_rng_state``: every pass's order is the same."""
    import torch.distributed as dist

    from mbcompile.training.data_cursor import DataCursor
    from mbcompile.training.rng import broadcast_rng_state

    torch.manual_seed(0)
    torch.rand(rank)
    loader = torch.utils.data.DataLoader(torch.arange(12), batch_size=4, shuffle=True)
    cursor = DataCursor(loader, 6, "training",
                        sync=lambda: broadcast_rng_state(dist.group.WORLD))
    order = [batch.tolist() for batch in cursor]
    orders: list[list] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(orders, order)
    assert all(o == orders[0] for o in orders), orders
    assert sorted(sum(orders[0][:3], [])) == list(range(12))  # a pass is a permutation
