"""Ranks that train one model are checked at compile, as DDP's construction makes them one.

A hunt on ranks found, silent: a model built after a per-rank seed trained each rank's
own replica for ever (parameters 0.94 relative apart after 3 steps, every rank printing
the same global loss), where DDP broadcasts rank 0's at construction; ranks compiled for
gbs 8 and 10 ran. A model of another layout on one rank aborted the process inside gloo,
with no Python error. mbcompile never changes the user's model, so compile() checks and
refuses each by name on every rank (``execution/replicas.py``), with the model as it was;
a compile that fails on one rank stops the others with an error naming it. A compile that
runs nothing (``compile_only``) exchanges nothing, so one rank may plan alone.
"""

from __future__ import annotations

import tempfile

import pytest
import replica_workers
import torch
from test_distributed import _run

CASES = {
    "same": ("stepped", "stepped"),
    "seeded_per_rank": ("hold different values of 'blocks.0.weight'",) * 2,
    "other_gbs": ("rank 1 compiled gbs=10, this rank (0) gbs=8",
                  "rank 0 compiled gbs=8, this rank (1) gbs=10"),
    "other_model": ("rank 1 compiled a model whose 'blocks.1.bias' is (4,) float64",
                    "rank 0 compiled a model whose 'blocks.1.bias' is missing"),
    "fails_on_one": ("compile() failed on rank(s) [1]", "capture must be one of"),
    "plan_on_one": ("compiled", "skipped"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ranks_compile_one_model_or_are_refused_by_name(case: str) -> None:
    with tempfile.TemporaryDirectory() as out:
        _run(replica_workers.compile_as_told, 2, out, case)
        got = [torch.load(f"{out}/rank{r}.pt") for r in range(2)]
    for rank, (want, seen) in enumerate(zip(CASES[case], got)):
        assert want in seen["result"], (rank, seen["result"])
        if seen["result"] not in ("stepped", "skipped"):
            assert seen["unchanged"], rank  # refused: the model as it was
