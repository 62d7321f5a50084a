"""The batch in samples and in tokens: per global batch, per system, per microbatch."""

from __future__ import annotations

import torch

import mbcompile
from mbcompile.models import make_mlp, make_tiny_gpt


def test_plan_gives_tokens_for_sequence_inputs():
    model, batch = make_tiny_gpt(10)  # (10, 16) token ids
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=batch)
    assert cm.plan.tokens_per_sample == 16
    tokens = cm.plan.to_dict()["tokens"]
    assert tokens["global"] == 160
    assert tokens["per_system"] == [64, 48, 48]
    assert tokens["per_microbatch"] == [[32, 32], [32, 16], [32, 16]]
    assert "tokens (16 per sample): global 160" in str(cm.plan)


def test_non_padding_tokens_of_the_last_step():
    model, (ids, labels) = make_tiny_gpt(10)
    cm = mbcompile.compile(model, 10, 3, 2, example_inputs=(ids, labels))
    assert cm.token_counts() is None  # nothing ran yet
    cm(ids, labels)
    counts = cm.token_counts()
    valid = labels != -100
    assert counts["global"] == valid.sum().item()
    want = [[valid[a:b].sum().item() for a, b in system] for system in cm.plan.microbatch_slices]
    assert counts["per_microbatch"] == want
    assert counts["per_system"] == [sum(s) for s in want]


def test_no_tokens_for_non_sequence_inputs():
    model, batch = make_mlp(8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch)
    assert cm.plan.tokens_per_sample is None and "tokens" not in cm.plan.to_dict()
    with torch.no_grad():
        cm(*batch)
    assert cm.token_counts()["global"] == batch[1].numel()  # an MSE mean counts elements
