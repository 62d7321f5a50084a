"""Worker functions for tests/test_replicas.py (spawned ranks import them by name)."""

from __future__ import annotations

import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

GBS = 8


class Net(nn.Module):
    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(layers)))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.blocks(x))), y)


def compile_as_told(rank: int, world: int, out: str, case: str) -> None:
    """Compile on every rank, rank 1 differing as ``case`` says; record what happened."""
    torch.manual_seed(1234 + rank if case == "seeded_per_rank" else 0)
    model = Net(2 if case == "other_model" and rank == 1 else 1).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GBS // world, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (GBS // world,), generator=g)
    options = {"example_inputs": (x, y)}
    gbs = 10 if case == "other_gbs" and rank == 1 else GBS
    if case == "fails_on_one" and rank == 1:
        options = {"example_inputs": (x, y), "capture": "no-such-capture"}
    if case == "plan_on_one":
        if rank == 1:
            torch.save({"result": "skipped"}, f"{out}/rank{rank}.pt")
            return
        options["compile_only"] = True
    try:
        cm = mbcompile.compile(model, gbs, world, 2, **options)
        result = "compiled"
        if not cm.compile_only:
            cm(x, y).backward()
            result = "stepped"
    except Exception as exc:  # the test reads the type and message
        result = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.save({"result": result, "unchanged": unchanged}, f"{out}/rank{rank}.pt")
