"""Ranks agree: what each rank does alone is the full batch's step (2 gloo ranks, float64).

Found by a hunt on real ranks (F1, F2), both silent:

- Each rank seeded its microbatches' backwards from its own graph's history (a rank that
  recompiled alone for a new length, or chose its own split, guessed 1 where the other
  guessed the last ``dL/dS``), and the factor that corrects a seed was applied after the
  gradients were summed over ranks: contributions scaled 1/192 and 1 were mixed, and an
  MSE (a count the shapes fix) at different lengths per rank had gradients 170 times
  eager's, and ranks out of sync. Now every rank seeds alike (``seeding.Seed.ranks``).
- Draws that read no sample (``torch.rand(B, 1)``, ``torch.randn(h.shape, generator=g)``,
  ``torch.randperm(B)``) were drawn at the rank's share: rank 1 read rank 0's numbers, the
  model's generator advanced by the share, and a permutation of the whole batch in a
  two-phase step failed. Now each rank draws at the global batch and reads its rows.

Every case runs eager on the whole global batch in each rank and compares the loss, every
gradient (full tensors under FSDP2), the parameters after SGD steps and, for the draws,
torch's and the model's generators after the step; the parameters must be bit-identical
on the ranks. One spawn per backend, the cases grouped in it (``rank_agreement_workers``).
"""

from __future__ import annotations

import pytest
import rank_agreement_workers as workers
import torch

RANKS = pytest.mark.xdist_group("rank_agreement")  # one rank pair at a time


def _found(tmp_path, fn) -> list[list[str]]:
    from test_distributed import _run

    _run(fn, 2, str(tmp_path), timeout_s=120)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
def test_replicated_ranks_at_their_own_lengths_and_with_draws_are_the_full_batch_step(tmp_path):
    """MSE at different lengths per rank (int mbs, a token budget: each rank its own split;
    a count that follows the lengths), each rank recompiling alone at its first new length;
    draws from torch's generator, from the model's own, and a randperm in a two-phase step."""
    assert _found(tmp_path, workers.replicated) == [[], []]


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
def test_fsdp2_ranks_at_their_own_lengths_are_the_full_batch_step(tmp_path):
    assert _found(tmp_path, workers.sharded) == [[], []]
