"""The capture's stack of each node (``passes/trace_stacks.py``) is the text fx's own
recording gives after ``user_stack``: every node, on models whose stacks hold a tensor
hook, a random draw, a recursive helper (fx prints a frame repeated more than three
times in a row three times), only torch's frames (``nn.Sequential``: fx's full text is
kept) and a layer traced into for its hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import tiny_gpt

from mbcompile.passes import fx_tracer
from mbcompile.passes.capture import capture
from mbcompile.passes.trace_stacks import FX_STACK


def _deep(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 0 else _deep(torch.tanh(x), n - 1)  # the same frame five times in a row


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fc.register_forward_pre_hook(lambda m, a: (a[0] * 2,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _deep(self.fc(x), 5)
        h.register_hook(lambda g: g * 0.5)
        noise = torch.randn(4)
        return F.mse_loss(h + noise, torch.zeros_like(h))


def _stacks(model: nn.Module, args: dict[str, object] | None = None
            ) -> tuple[dict[str, str | None], str]:
    gm = capture(model, args).graph_module
    return {n.name: n.stack_trace for n in gm.graph.nodes}, gm.code


@pytest.mark.parametrize("make", [lambda: tiny_gpt(2)[0], lambda: Hooked(),
                                  lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU())],
                         ids=["gpt", "hooks-recursion-draw", "torch-only"])
def test_each_node_has_the_stack_fx_records(make, monkeypatch) -> None:
    model = make()
    got = _stacks(model)
    with monkeypatch.context() as m:  # every node recorded by fx itself, as before
        m.setattr(fx_tracer, "traced_stack", lambda frame: FX_STACK)
        want = _stacks(model)
    assert got == want
    assert any(s for s in got[0].values())
