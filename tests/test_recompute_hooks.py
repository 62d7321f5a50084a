"""``recompute`` under the user's ``torch.autograd.graph.saved_tensors_hooks``.

Activation checkpointing saves a block's tensors through its own hooks, past the user's:
a lossy pack (compress to float16) that eager applies to every saved tensor never saw the
blocks' activations, and the gradients differed from eager's by 3e-4 relative. Under
the user's hooks the blocks now run without checkpointing, saving through them, with a
``RecomputeBypassedWarning``; without hooks they are checkpointed as before.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.check import relative_error
from mbcompile.passes.recompute import RecomputeBypassedWarning, checkpoint_keeping_hooks

GBS, NUM_CSX, MBS = 7, 2, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(h)) + h


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(5, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.unused = nn.Linear(2, 2)  # its .grad stays None, in eager and here

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.out(h), y)


def compress() -> torch.autograd.graph.saved_tensors_hooks:
    """Activation compression: every saved float tensor kept as float16 (lossy)."""
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.to(torch.float16) if t.is_floating_point() else t,
        lambda t: t.to(torch.float64) if t.is_floating_point() else t)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(GBS, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (GBS,), generator=g))


def _steps(model: nn.Module, call, hooks) -> list[tuple]:
    """Two steps under ``hooks``: (loss, every .grad) per step, then the parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    for step in range(2):
        opt.zero_grad()
        with hooks():
            loss = call(*_batch(step))
            loss.backward()
        seen.append((loss.detach(), [None if p.grad is None else p.grad.clone()
                                     for p in model.parameters()]))
        opt.step()
    return seen + [[p.detach().clone() for p in model.parameters()]]


def _compare(got: list, want: list, tol: float = 1e-12) -> None:
    for (loss, grads), (want_loss, want_grads) in zip(got[:-1], want[:-1]):
        assert relative_error(loss, want_loss) <= tol
        for g, w in zip(grads, want_grads):
            assert (g is None) == (w is None)
            assert w is None or relative_error(g, w) <= tol
    for p, w in zip(got[-1], want[-1]):
        assert relative_error(p, w) <= tol


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("hooks", [compress, torch.autograd.graph.save_on_cpu],
                         ids=["compress", "save_on_cpu"])
def test_recompute_under_users_saved_tensor_hooks_equals_eager(capture, hooks):
    torch.manual_seed(0)
    model = Net().double()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0), capture=capture,
                           recompute=True, cost_model=False)
    assert sum(isinstance(n.target, checkpoint_keeping_hooks)
               for n in cm.graph_module.body.graph.nodes) == 4
    with pytest.warns(RecomputeBypassedWarning, match="recompute=False"):
        got = _steps(model, cm, hooks)
    _compare(got, _steps(eager, eager, hooks))


def _counted(monkeypatch) -> list[int]:
    """Calls of torch.utils.checkpoint.checkpoint from now on (the blocks' op looks it up
    at each call)."""
    calls: list[int] = []
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    return calls


def test_without_hooks_the_blocks_are_checkpointed(monkeypatch):
    """No hooks of the user's: every block of every microbatch is checkpointed, no
    warning, and exact."""
    torch.manual_seed(0)
    model = Net().double()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0), recompute=True,
                           cost_model=False)
    calls = _counted(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecomputeBypassedWarning)
        got = _steps(model, cm, contextlib.nullcontext)
    assert len(calls) == 2 * 4 * 4  # steps x microbatches x blocks
    _compare(got, _steps(eager, eager, contextlib.nullcontext))


def test_under_hooks_the_blocks_are_not_checkpointed(monkeypatch):
    torch.manual_seed(0)
    model = Net().double()
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_batch(0), recompute=True,
                           cost_model=False)
    calls = _counted(monkeypatch)
    with pytest.warns(RecomputeBypassedWarning):
        _steps(model, cm, compress)
    assert calls == []
