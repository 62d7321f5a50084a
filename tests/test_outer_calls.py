"""A compiled module called inside ``torch.utils.checkpoint`` or a ``torch.func`` transform
(``execution/outer_calls.py``): its training step is refused there by name, and a call
that trains nothing runs as eager's. (A review found the first version refusing every call
inside either: a frozen encoder under ``no_grad`` in a checkpointed block, a frozen
teacher, ``vmap`` and ``jacrev`` of a forward, all exact before.)"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from models import TOL, rel_err
from torch.utils.checkpoint import checkpoint

import mbcompile

GBS = 4


def _encoder() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double()
    return enc, nn.Linear(6, 1).double(), torch.randn(GBS, 6, dtype=torch.float64)


def _compiled(enc: nn.Module, x: torch.Tensor) -> mbcompile.CompiledModule:
    return mbcompile.compile(enc, GBS, 1, 2, example_inputs=(x,), cost_model=False)


@pytest.mark.parametrize("reentrant", [False, True], ids=["plain", "reentrant"])
@pytest.mark.parametrize("frozen", ["no_grad", "requires_grad_false"])
def test_a_call_that_trains_nothing_inside_a_checkpoint_runs_as_eagers(reentrant, frozen):
    enc, head, x = _encoder()
    if frozen == "requires_grad_false":
        enc.requires_grad_(False)
    cm = _compiled(enc, x)
    x = x.requires_grad_()  # the block's input: the checkpoint has a graph to recompute
    grads = []
    for call, h in ((cm, head), (enc, copy.deepcopy(head))):
        def block(inp: torch.Tensor, call=call, h=h) -> torch.Tensor:
            if frozen == "no_grad":
                with torch.no_grad():
                    feats = call(inp)
            else:
                feats = call(inp)
            return h(feats * inp).sum()

        x.grad = None
        checkpoint(block, x, use_reentrant=reentrant).backward()
        grads.append((x.grad.clone(), h.weight.grad.clone()))
    assert all(rel_err(a, b) <= TOL for a, b in zip(*grads))
    assert all(p.grad is None for p in enc.parameters())


def test_vmap_and_jacrev_of_a_forward_run_as_eagers():
    enc, _, x = _encoder()
    cm = _compiled(enc, x)
    batches = torch.randn(3, GBS, 6, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(torch.vmap(cm)(batches), torch.vmap(enc)(batches)) <= TOL
    cm.eval()
    enc.eval()
    assert rel_err(torch.func.jacrev(cm)(x), torch.func.jacrev(enc)(x)) <= TOL


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_torch_compile_around_the_compiled_module_runs_its_step(capture: str) -> None:
    """``torch.compile(cm)`` (``Trainer(torch_compile=True)``): dynamo leaves the step's
    Python alone (a graph break) and the step is exact, as uncompiled."""
    enc, head, x = _encoder()
    y = torch.randn(GBS, 1, dtype=torch.float64)
    model = nn.Sequential(enc, head)
    eager = copy.deepcopy(model)

    class Loss(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(x), y)

    cm = mbcompile.compile(Loss(model), GBS, 1, 2, example_inputs=(x, y), cost_model=False,
                           capture=capture)
    wrapped = torch.compile(cm, backend="eager")
    for _ in range(2):
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        got, want = wrapped(x, y), Loss(eager)(x, y)
        got.backward()
        want.backward()
        assert rel_err(got, want) <= TOL
        for p, q in zip(model.parameters(), eager.parameters()):
            assert rel_err(p.grad, q.grad) <= TOL
