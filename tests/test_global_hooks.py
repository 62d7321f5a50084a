"""Global module hooks (``register_module_forward_hook`` and its kin), exact or refused
(issue 35). torch calls one on every module's call: compile's probes on made-up data,
mbcompile's own modules and each microbatch's call of a layer would all reach it. Now no
probe calls one, mbcompile's modules are hidden from it, the compiled module's own call is
the model's (the hook sees the model, the whole batch's inputs and output), a call on a
module forward traces through is traced (its writes replayed once per step), and a call on
a torch layer the graph calls as one node, once per microbatch, is watched as a layer's own
hook: refused at its first write (or changed result) unless marked
``mbcompile.per_microbatch``. A global backward hook is refused at compile and at a call,
and so is a module's own backward hook where fx traces through the module. Plan: 7 rows
over 2 systems, MBS 2, float64, against eager on a copy."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import rel_err
from torch.nn.modules import module as module_globals

import mbcompile
from mbcompile.errors import UncheckedHookError


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.b = _Block(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(self.block(x)), y)


@pytest.fixture
def net() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return _Net().double(), tuple(torch.randn(7, 4, generator=g, dtype=torch.float64)
                                  for _ in range(2))


@pytest.fixture(autouse=True)
def no_global_hooks_left() -> Iterator[None]:
    yield
    for table in (module_globals._global_forward_pre_hooks, module_globals._global_forward_hooks,
                  module_globals._global_backward_pre_hooks, module_globals._global_backward_hooks):
        assert not table, "a test left a global module hook registered"


def _compile(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    return mbcompile.compile(model, 7, 2, 2, example_inputs=batch)


def test_a_marked_global_hook_runs_per_microbatch_on_the_users_layers_only(net):
    """Marked: never called at compile (no made-up data) nor on mbcompile's own modules;
    in a step each torch layer's call per microbatch (2, 2, 2, 1 rows), the module forward
    traces through once with the whole batch, and the model itself once, as eager calls it
    (the compiled module's own call is the model's); the step is eager's."""
    model, batch = net
    ref = copy.deepcopy(model)
    names = {m: n or "<model>" for n, m in model.named_modules()}
    seen: list[tuple[str, int]] = []

    def record(module: nn.Module, args: tuple, out: Any) -> None:
        seen.append((names.get(module, type(module).__name__), args[0].shape[0]))

    handle = torch.nn.modules.module.register_module_forward_hook(mbcompile.per_microbatch(record))
    try:
        cm = _compile(model, batch)
        assert seen == []
        loss = cm(*batch)
        loss.backward()
    finally:
        handle.remove()
    rows = [2, 2, 2, 1]
    assert sorted(seen) == sorted([("block.a", r) for r in rows] + [("b", r) for r in rows]
                                  + [("block", 7), ("<model>", 7)])
    assert seen[-1] == ("<model>", 7)
    expected = ref(*batch)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12


@pytest.mark.parametrize("when", ["before compile", "after compile"])
def test_an_unmarked_global_hook_that_records_per_layer_is_refused_with_nothing_changed(
        net, when):
    """It would record each microbatch's call of each torch layer: refused at its first such
    call, naming the layer and both fixes, with what it wrote put back (also its record of
    the traced module), no gradient, the parameters as they were; compile recorded nothing."""
    model, batch = net
    params = [p.detach().clone() for p in model.parameters()]
    seen: list[str] = []

    def record(module: nn.Module, args: tuple, out: Any) -> None:
        seen.append(type(module).__name__)

    register = torch.nn.modules.module.register_module_forward_hook
    handle = register(record) if when == "before compile" else None
    try:
        cm = _compile(model, batch)
        assert seen == []
        if handle is None:
            handle = register(record)
        with pytest.raises(UncheckedHookError, match="per_microbatch") as refusal:
            cm(*batch)
    finally:
        handle.remove()
    assert "the global module hook" in str(refusal.value) and "Linear" in str(refusal.value)
    assert seen == []
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_global_hooks_that_read_or_record_a_traced_module_are_exact(net):
    """A hook that only reads on the layers (checks a value, returns None), and one that
    records the output of a module forward traces through (traced: replayed once per step,
    with the whole batch's value): three steps equal to eager's, records too."""
    model, batch = net
    ref = copy.deepcopy(model)
    logs: dict[str, list[torch.Tensor]] = {"compiled": [], "eager": []}
    current = ["compiled"]

    def check(module: nn.Module, args: tuple, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dtype.is_complex:
            raise ValueError("complex")

    def record(module: nn.Module, args: tuple, out: Any) -> None:
        if isinstance(module, _Block):
            logs[current[0]].append(out.detach().sum())

    register = torch.nn.modules.module.register_module_forward_hook
    handles = [register(check), register(record)]
    try:
        cm = _compile(model, batch)
        assert logs["compiled"] == []
        for step in range(3):
            x, y = (t * (1 + step) for t in batch)
            for net_, name in ((cm, "compiled"), (ref, "eager")):
                current[0] = name
                for p in net_.parameters():
                    p.grad = None
                net_(x, y).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                assert rel_err(p.grad, q.grad, 1e-3) < 1e-12
    finally:
        for handle in handles:
            handle.remove()
    assert len(logs["compiled"]) == len(logs["eager"]) == 3
    for a, b in zip(logs["compiled"], logs["eager"]):
        assert rel_err(a, b, 1e-3) < 1e-12


def test_an_unmarked_global_hook_that_changes_a_layers_output_is_refused(net):
    """Global hooks are not called on made-up data, so one that returns a new output for a
    torch layer cannot be told per-sample: refused at its first call in a step, with the
    fix; nothing changed."""
    model, batch = net
    cm = _compile(model, batch)

    def doubled(module: nn.Module, args: tuple, out: Any) -> Any:
        return out * 2 if isinstance(module, nn.Linear) else None

    handle = torch.nn.modules.module.register_module_forward_hook(doubled)
    try:
        with pytest.raises(UncheckedHookError, match="changes what the layer returns"):
            cm(*batch)
    finally:
        handle.remove()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("marked", [False, True])
def test_a_global_backward_hook_is_refused_at_compile_and_at_a_call(net, marked):
    """It would run in each microbatch's backward of each torch layer, and never on the
    modules forward traces through (``_Block``): refused before anything, at compile, or at
    a call when registered after it, marked or not, naming the fix; nothing ran."""
    model, batch = net
    grads: list[str] = []

    def record(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        grads.append(type(module).__name__)

    hook = mbcompile.per_microbatch(record) if marked else record
    register = torch.nn.modules.module.register_module_full_backward_hook
    handle = register(hook)
    try:
        with pytest.raises(UncheckedHookError, match="Nothing was compiled"):
            _compile(model, batch)
        handle.remove()
        cm = _compile(model, batch)
        handle = register(hook)
        with pytest.raises(UncheckedHookError, match="layers themselves"):
            cm(*batch)
    finally:
        handle.remove()
    assert grads == [] and all(p.grad is None for p in model.parameters())


def test_torch_export_refuses_a_global_forward_hook(net):
    """Export calls a global hook on fake tensors, twice per module and on its own wrapper:
    refused at compile, naming ``capture='fx'``, with nothing recorded."""
    model, batch = net
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__))
    try:
        with pytest.raises(mbcompile.CaptureError, match="capture='fx'"):
            mbcompile.compile(model, 7, 2, 2, example_inputs=batch, capture="export")
    finally:
        handle.remove()
    assert seen == []


def test_a_backward_hook_of_a_module_fx_traces_through_is_refused(net):
    """Like a global backward hook on the modules forward traces through, a module's own
    backward hook there has no place in the traced step (it never ran): refused at
    compile, and at a call when registered after it, naming the module; nothing ran."""
    model, batch = net
    rows: list[int] = []
    hook = mbcompile.per_microbatch(lambda m, gi, go: rows.append(go[0].shape[0]))
    handle = model.block.register_full_backward_hook(hook)
    with pytest.raises(mbcompile.CaptureError, match="'block'"):
        _compile(model, batch)
    handle.remove()
    cm = _compile(model, batch)
    handle = model.block.register_full_backward_hook(hook)
    try:
        with pytest.raises(mbcompile.CaptureError, match="'block'"):
            cm(*batch)
    finally:
        handle.remove()
    assert rows == [] and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_flop_counter_modes_hooks_name_who_installed_them(net, capture):
    """FlopCounterMode installs torch's ModuleTracker as global hooks (Lightning's
    ModelSummary with example_input_array does, at max_depth other than 1): the refusal
    named fixes that do not apply (the user registered no hook); it now names the mode and
    the Lightning settings that avoid it. Under fx it comes at the call, where the layers
    run the tracker's hooks per microbatch; under export at compile, where export would
    call them on fake tensors (at a call, export's graph runs no layer: the call runs)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, batch = net
    params = [p.detach().clone() for p in model.parameters()]
    fixes = r"ModuleTracker's, which FlopCounterMode installs.*ModelSummary\(max_depth=1\)"
    if capture == "fx":
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch, capture="fx")
        with pytest.raises(UncheckedHookError, match=fixes), FlopCounterMode(display=False):
            cm(*batch)
    else:
        with pytest.raises(mbcompile.CaptureError, match=fixes), FlopCounterMode(display=False):
            mbcompile.compile(model, 7, 2, 2, example_inputs=batch, capture="export")
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
