"""A graph module's attribute paths read without ``__getattr__`` (``passes/attr_shortcuts.py``).

Oracles: a count of ``nn.Module.__getattr__`` calls on the graph module's own containers,
the same outputs before and after, the user's modules' instance dicts left as they were,
and eager on a model whose parameters and layers are replaced between steps.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, step_errors

import mbcompile
from mbcompile.passes.attr_shortcuts import shortcut_attrs

DTYPE = torch.float64


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, dtype=DTYPE))  # read directly: get_attr
        self.lin = nn.Linear(3, 3).to(DTYPE)  # called: call_module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Inner(), Inner()])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block.lin(x @ block.w) @ block.w.T)
        return F.mse_loss(x, y)


@contextmanager
def getattr_calls(owners: set[int]) -> Iterator[collections.Counter[str]]:
    """Names looked up through ``nn.Module.__getattr__`` on the modules ``owners`` names."""
    calls: collections.Counter[str] = collections.Counter()
    plain = nn.Module.__getattr__

    def counted(self: nn.Module, name: str) -> object:
        if id(self) in owners:
            calls[name] += 1
        return plain(self, name)

    nn.Module.__getattr__ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        nn.Module.__getattr__ = plain  # type: ignore[method-assign]


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g, dtype=DTYPE), torch.randn(6, 4, generator=g, dtype=DTYPE)


def test_paths_are_read_from_instance_dicts_and_the_users_modules_are_untouched() -> None:
    torch.manual_seed(0)
    model = Net()
    gm = fx.symbolic_trace(model)
    x, y = _data()
    want = gm(x, y)
    users = {id(m) for m in model.modules()}
    before = {id(m): set(vars(m)) for m in model.modules()}
    code = gm.code
    own = {id(m) for m in gm.modules()} - users
    with getattr_calls(own) as calls:
        gm(x, y)
    assert calls["blocks"] and calls["w"], "the test reads nothing through __getattr__"
    assert shortcut_attrs(gm, users) is gm
    with getattr_calls(own) as calls:
        got = gm(x, y)
    assert not calls, f"still read through nn.Module.__getattr__: {dict(calls)}"
    assert torch.equal(got, want)
    assert gm.code == code
    assert {id(m): set(vars(m)) for m in model.modules()} == before, "a user's module written"


def test_a_slot_set_again_is_read_again_and_tensors_can_stay_out() -> None:
    """``Module.__setattr__`` drops the shortcut of the name it sets: never a stale read."""
    torch.manual_seed(0)
    model = Net()
    gm = fx.symbolic_trace(model)
    container = gm.get_submodule("blocks.0")
    assert type(container) is nn.Module and not any(
        container is m for m in model.modules()), "fx no longer copies the path's containers"
    shortcut_attrs(gm, {id(m) for m in model.modules()})
    x, y = _data()
    fresh = nn.Parameter(torch.randn(4, 3, dtype=DTYPE))
    container.w = fresh  # what a stale shortcut would hide
    model.blocks[0].w = fresh
    assert torch.equal(gm(x, y), model(x, y))

    gm = fx.symbolic_trace(Net())
    shortcut_attrs(gm, set(), tensors=False)
    container = gm.get_submodule("blocks.0")
    assert "lin" in vars(container) and "w" not in vars(container)


@pytest.mark.parametrize("replace", ["parameter", "layer", "load_state_dict", "to"])
def test_the_compiled_step_follows_what_the_user_replaces_between_steps(replace: str) -> None:
    """Steps cached with shortcuts, then a nested parameter or layer replaced (or loaded,
    or converted): the next step is eager's on the new model, gradients on the new tensors."""
    torch.manual_seed(0)
    model = Net()
    x, y = _data()
    cm = mbcompile.compile(model, gbs=6, num_csx=2, mbs=2, example_inputs=(x, y),
                           cost_model=False)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        cm(x, y).backward()
    torch.manual_seed(5)
    if replace == "parameter":
        model.blocks[1].w = nn.Parameter(torch.randn(4, 3, dtype=DTYPE))
    elif replace == "layer":
        model.blocks[0].lin = nn.Linear(3, 3).to(DTYPE)
    elif replace == "load_state_dict":
        model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()},
                              assign=True)
    else:
        model.to(torch.float32).to(DTYPE)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
    assert_close_errors(step_errors(model, cm, (x, y)), TOL)  # grads: the model's tensors now
