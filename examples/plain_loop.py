"""Your own training loop with a compiled model: the README's quick start, checked.

    python examples/plain_loop.py

The loop is the one you have; only the call goes through the compiled module, which
runs the global batch as microbatches and hands back the full batch's gradient:

    cm = mbcompile.compile(model, gbs=64, num_csx=2, example_inputs=(x, y))
    for x, y in batches:
        opt.zero_grad(); cm(x, y).backward(); opt.step()

The script trains the README's ``Net`` for three AdamW steps of gbs 64 over 2 systems
(mbs 8) in float64, and the same steps on the plain model, and compares the parameters.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

GBS, NUM_CSX, MBS, STEPS = 64, 2, 8, 3


class Net(nn.Module):  # the README's model, unchanged
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.body(x), y)  # the loss inside: one microbatch's memory


def loop(model: nn.Module, call: nn.Module) -> None:
    """Three optimizer steps on ``model``'s parameters, each through ``call``."""
    generator = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEPS):
        x = torch.randn(GBS, 16, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (GBS,), generator=generator)
        opt.zero_grad()
        call(x, y).backward()  # .grad is one full-batch step's
        opt.step()


def max_difference() -> float:
    torch.manual_seed(0)
    model = Net().double()
    plain = copy.deepcopy(model)
    loop(plain, plain)
    x, y = torch.randn(GBS, 16, dtype=torch.float64), torch.randint(0, 4, (GBS,))
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y))
    loop(model, cm)
    with torch.no_grad():
        return max(float((a - b).abs().max())
                   for a, b in zip(plain.parameters(), model.parameters()))


if __name__ == "__main__":
    difference = max_difference()
    print(f"your loop + mbcompile vs plain full-batch steps: max parameter difference "
          f"{difference:.2e}")
    sys.exit(0 if difference <= 1e-10 else 1)
