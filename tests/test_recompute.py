"""Activation checkpointing per block (``passes/recompute.py``): exact, chosen by the
plan when no MBS fits without it, and modelled to within 20% of the allocator."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from models import allocator_peak

import mbcompile
from mbcompile.check import relative_error
from mbcompile.models import TinyGPT, make_mlp, make_tiny_gpt, token_batch
from mbcompile.passes.recompute import checkpoint_blocks, checkpoint_keeping_hooks
from mbcompile.planning.systems import get_system
from mbcompile.reports.exploration import plot, table

GBS = 14


def _checkpoints(gm: torch.fx.GraphModule) -> int:
    return sum(isinstance(n.target, checkpoint_keeping_hooks) for n in gm.graph.nodes)


def test_each_block_of_the_body_is_checkpointed():
    model, batch = make_tiny_gpt(GBS, depth=3)
    cm = mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, recompute=True)
    assert cm.plan.recompute and "activation checkpointing" in cm.plan.reason
    assert _checkpoints(cm.graph_module.body) == 3
    # a graph without repeated blocks has nothing to checkpoint
    lone = torch.fx.symbolic_trace(nn.Linear(3, 3))
    assert checkpoint_blocks(lone) is None


@pytest.mark.parametrize("num_csx,mbs", [(1, 1), (2, 4), (3, 2)])
def test_the_step_is_exact(num_csx, mbs):
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, num_csx, mbs, example_inputs=batch, recompute=True)
    loss, logits = cm(*batch)
    loss.backward()
    want, want_logits = ref(*batch)
    want.backward()
    assert relative_error(loss, want) <= 1e-12
    assert relative_error(logits, want_logits) <= 1e-12
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-10


class Dropped(nn.Module):
    """Blocks with dropout: recomputation must draw the same masks as the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh())
                                    for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return (self.head(x).squeeze(-1) - y).pow(2).mean()


def test_recomputation_replays_dropout():
    torch.manual_seed(0)
    model = Dropped().double()
    twin = copy.deepcopy(model)
    batch = (torch.randn(GBS, 8, dtype=torch.float64), torch.randn(GBS, dtype=torch.float64))
    grads = []
    for m, recompute in ((model, True), (twin, False)):
        cm = mbcompile.compile(m, GBS, 2, 3, example_inputs=batch, recompute=recompute)
        torch.manual_seed(5)
        cm(*batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("backend,refused", [("eager", True), ("aot_eager", False)])
def test_recomputed_dropout_under_torch_compiles_eager_backend_is_refused(backend, refused):
    """torch.compile's "eager" backend ignores checkpointing's RNG replay (torch's own,
    pytorch#160773: a hunt measured gradients 2.1 relative off the forward's masks), so
    that combination is refused; aot_eager replays as uncompiled recompute does."""
    torch.manual_seed(0)
    model = Dropped().double()
    twin = copy.deepcopy(model)
    batch = (torch.randn(GBS, 8, dtype=torch.float64), torch.randn(GBS, dtype=torch.float64))
    options = {"example_inputs": batch, "recompute": True, "torch_compile": {"backend": backend}}
    if refused:
        with pytest.raises(mbcompile.InputError, match="aot_eager"):
            mbcompile.compile(model, GBS, 2, 3, **options)
        return
    grads = []
    for m, extra in ((model, options), (twin, {"example_inputs": batch, "recompute": True})):
        cm = mbcompile.compile(m, GBS, 2, 3, **extra)
        torch.manual_seed(5)
        cm(*batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert relative_error(grads[0], grads[1]) <= 1e-12


@pytest.mark.slow
def test_auto_checkpoints_only_when_nothing_fits_without():
    model, batch = make_tiny_gpt(GBS, dtype=torch.float64, depth=4, seq=32)
    ref = copy.deepcopy(model)
    plain = mbcompile.compile(model, GBS, 1, 1, example_inputs=batch, compile_only=True,
                              recompute=False).estimate.memory.peak
    saved = mbcompile.compile(model, GBS, 1, 1, example_inputs=batch, compile_only=True,
                              recompute=True).estimate.memory.peak
    assert saved < plain
    # roomy: auto does not recompute
    assert not mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch,
                                 compile_only=True).plan.recompute
    tight = replace(get_system("host"), name="tight", memory_bytes=(plain + saved) / 2)
    with pytest.raises(mbcompile.DoesNotFitError):
        mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=tight,
                          recompute=False)
    cm = mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=tight)
    assert cm.plan.recompute and "without it even mbs 1 needs" in cm.plan.reason
    loss, _ = cm(*batch)
    loss.backward()
    want, _ = ref(*batch)
    want.backward()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert relative_error(a.grad, b.grad) <= 1e-10


def test_bad_recompute_is_refused():
    model, batch = make_mlp(GBS)
    with pytest.raises(mbcompile.InputError, match="recompute must be"):
        mbcompile.compile(model, GBS, 2, 4, example_inputs=batch, recompute="yes")


def _tight_between_full_batches(model, batch):
    """A system where the whole per-system batch fits only with checkpointing."""
    full = {rc: mbcompile.compile(model, 16, 1, 16, example_inputs=batch, compile_only=True,
                                  recompute=rc).estimate.memory.peak for rc in (False, True)}
    assert full[True] < full[False]
    return replace(get_system("host"), name="tight", memory_bytes=(full[False] + full[True]) / 2)


@pytest.mark.slow
def test_auto_and_explore_choose_mbs_and_recompute_jointly(tmp_path):
    model, batch = make_tiny_gpt(16, dtype=torch.float64, depth=4, seq=32)
    tight = _tight_between_full_batches(model, batch)
    explored = mbcompile.compile(model, 16, 1, "explore", example_inputs=batch, system=tight,
                                 compile_only=True)
    x = explored.exploration
    assert x.joint and {c.recompute for c in x.candidates} == {False, True}
    assert not x.candidate(16).fits and x.candidate(16, recompute=True).fits
    best = min((c for c in x.candidates if c.fits), key=lambda c: c.step_s)
    assert (x.best, x.best_recompute) == (best.mbs, best.recompute)
    assert explored.plan.recompute == best.recompute
    assert f"recompute={best.recompute}" in explored.plan.reason
    text = table(x)
    assert "recompute" in text.splitlines()[0] and text.count(" *") == 1
    assert plot(x, tmp_path / "joint.png").stat().st_size > 0
    auto = mbcompile.compile(model, 16, 1, "auto", example_inputs=batch, system=tight)
    assert (auto.plan.mbs, auto.plan.recompute) == (best.mbs, best.recompute)
    # where everything fits without it, auto never recomputes
    assert not mbcompile.compile(model, 16, 1, "auto", example_inputs=batch,
                                 compile_only=True).plan.recompute


def test_modelled_memory_with_checkpointing_matches_the_allocator():
    """Within 20% of the allocator's count (the issue's bound; 1.5% on this model)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=128, width=64, depth=4, heads=4, seq=64)
    batch = token_batch(16, 64, 128)
    cm = mbcompile.compile(model, 16, 1, 4, example_inputs=batch, recompute=True)
    assert cm.plan.recompute
    assert cm.estimate.memory.peak == pytest.approx(allocator_peak(cm, model, batch), rel=0.20)
