"""A tensor hook forward registers that writes Python state (Grad-CAM's recorded
gradient, a call counter) is refused, changing nothing, unless marked
``mbcompile.per_microbatch``.

Such a hook ran on each microbatch's gradient (4 calls of 2, 2, 2 and 1 rows, where eager
makes one call of 7) and, at compile, on made-up gradients (6 entries in the user's list
before any step): the check called it unsandboxed. Now it is called sandboxed
(``passes/hook_sandbox.py``), and what it would write refuses it, as a layer's hook is.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.errors import UncheckedHookError

DTYPE = torch.float64
GBS = 7
SEEN: list[tuple[int, ...]] = []


class Recorded(nn.Module):
    def __init__(self, marked: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.calls = nn.Linear(4, 6), nn.Linear(6, 3), 0
        self.marked = marked

    def record(self, grad: torch.Tensor) -> None:
        self.calls += 1
        SEEN.append(tuple(grad.shape))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h.register_hook(mbcompile.per_microbatch(self.record) if self.marked else self.record)
        return F.mse_loss(self.b(h), y)


def _compile(model: nn.Module) -> Any:
    x, y = torch.randn(GBS, 4, dtype=DTYPE), torch.randn(GBS, 3, dtype=DTYPE)
    return mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, y), cost_model=False,
                             capture="fx"), (x, y)


def test_a_tensor_hook_that_records_the_gradient_is_refused_changing_nothing():
    SEEN.clear()
    model = Recorded().to(DTYPE)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(mbcompile.CaptureError, match=r"writes Python state \(self\.calls, "
                       r"SEEN\).*per_microbatch"):
        _compile(model)
    assert SEEN == [] and model.calls == 0  # the check's calls were put back
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_tensor_hook_marked_per_microbatch_runs_on_each_microbatch_as_written():
    SEEN.clear()
    model = Recorded(marked=True).to(DTYPE)
    cm, batch = _compile(model)
    assert SEEN == [] and model.calls == 0  # compile wrote nothing
    cm(*batch).backward()
    assert sorted(SEEN) == [(1, 6), (2, 6), (2, 6), (2, 6)] and model.calls == 4


def _halve_its_gradient(module: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.register_hook(lambda g: g * 0.5)


class LayerRegistersAHook(nn.Module):
    """Captum's way: a forward hook of a layer registers a tensor hook on its output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.a.register_forward_hook(_halve_its_gradient)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


def test_a_layer_hook_that_registers_a_tensor_hook_is_refused_by_name():
    """It crashed compile: 'compiling ... failed in mbcompile itself: RuntimeError: cannot
    register a hook on a tensor that doesn't require gradient' (the layer's check ran it
    without grad). Now it compiles, and the step refuses it as any layer hook that
    registers one (``UncheckedHookError``), before it changes anything."""
    torch.manual_seed(0)
    model = LayerRegistersAHook().to(DTYPE)
    state = copy.deepcopy(model.state_dict())
    cm, batch = _compile(model)
    with pytest.raises(UncheckedHookError, match="tensor hook it registers"):
        cm(*batch)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
