"""A layer hook that rewires its layer inside a step (issue 35): registers or removes a hook
(forward, forward pre, backward), or adds, rebinds or deletes a parameter or buffer, in
its own code or through a method of the user's it calls. In eager that happens once per
step; a hook of a layer the graph calls as one node runs once per microbatch, so, run
sandboxed, each is refused (``UncheckedHookError``, naming the hook, what it changed and
both fixes) with the model as it was: the very parameter and buffer objects in their
slots, in their order, the same hooks, no gradient. Marked ``per_microbatch`` it runs on
each microbatch as written, and compile's calls of it on made-up data change nothing.

``Snapshot.rewired`` says what a hook changed (the slots and hook tables ``changes``
leaves out), and ``restore`` puts it back in order."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import rel_err, tanh_pair

import mbcompile
from mbcompile.errors import UncheckedHookError
from mbcompile.passes.hook_sandbox import call_sandboxed
from mbcompile.passes.python_state import Snapshot

pytestmark = pytest.mark.filterwarnings("ignore")

#: handles of the no-op hooks each test registers on layer ``a`` before compile (a hook
#: that removes one reaches it here)
HANDLES: dict[str, Any] = {}


def _noop(m: nn.Module, *args: Any) -> None:
    return None


def _noop_backward(m: nn.Module, grad_in: Any, grad_out: Any) -> None:
    return None


# Each way of rewiring, as a hook (``(m, *args)``: forward, pre or backward) whose own code
# makes the write; ``_through_a_method`` makes it from a method of the user's instead.

def _registers_forward_hook(m: nn.Module, *args: Any) -> None:
    m.register_forward_hook(_noop)


def _removes_forward_hook(m: nn.Module, *args: Any) -> None:
    HANDLES["forward"].remove()


def _registers_pre_hook(m: nn.Module, *args: Any) -> None:
    m.register_forward_pre_hook(_noop)


def _removes_pre_hook(m: nn.Module, *args: Any) -> None:
    HANDLES["pre"].remove()


def _registers_backward_hook(m: nn.Module, *args: Any) -> None:
    m.register_full_backward_hook(_noop_backward)


def _removes_backward_hook(m: nn.Module, *args: Any) -> None:
    HANDLES["backward"].remove()


def _rebinds_parameter(m: nn.Module, *args: Any) -> None:
    m.weight = nn.Parameter(m.weight.detach().clone())


def _rebinds_parameter_by_setattr(m: nn.Module, *args: Any) -> None:
    setattr(m, "bias", nn.Parameter(m.bias.detach().clone()))  # noqa: B010


def _sets_parameter_to_none(m: nn.Module, *args: Any) -> None:
    m.bias = None


def _registers_parameter(m: nn.Module, *args: Any) -> None:
    m.register_parameter("extra", nn.Parameter(torch.zeros(1, dtype=torch.float64)))


def _deletes_parameter(m: nn.Module, *args: Any) -> None:
    del m.weight


def _rebinds_buffer(m: nn.Module, *args: Any) -> None:
    m.scale = torch.full((1,), 2.0, dtype=torch.float64)


def _registers_buffer(m: nn.Module, *args: Any) -> None:
    m.register_buffer("extra", torch.zeros(1, dtype=torch.float64), persistent=False)


def _deletes_buffer(m: nn.Module, *args: Any) -> None:
    del m.scale


#: way -> (its hook, what the refusal names)
WAYS: dict[str, tuple[Callable[..., None], str]] = {
    "registers a forward hook": (
        _registers_forward_hook, "._forward_hooks (registers the forward hook '_noop')"),
    "removes a forward hook": (
        _removes_forward_hook, "._forward_hooks (removes the forward hook '_noop')"),
    "registers a forward pre-hook": (
        _registers_pre_hook, "._forward_pre_hooks (registers the forward pre-hook '_noop')"),
    "removes a forward pre-hook": (
        _removes_pre_hook, "._forward_pre_hooks (removes the forward pre-hook '_noop')"),
    "registers a backward hook": (
        _registers_backward_hook,
        "._backward_hooks (registers the backward hook '_noop_backward')"),
    "removes a backward hook": (
        _removes_backward_hook, "._backward_hooks (removes the backward hook '_noop_backward')"),
    "rebinds a parameter": (_rebinds_parameter, ".weight (rebinds a parameter)"),
    "rebinds a parameter by setattr": (_rebinds_parameter_by_setattr,
                                       ".bias (rebinds a parameter)"),
    "sets a parameter to None": (_sets_parameter_to_none, ".bias (rebinds a parameter)"),
    "registers a parameter": (_registers_parameter, ".extra (adds a parameter)"),
    "deletes a parameter": (_deletes_parameter, ".weight (deletes a parameter)"),
    "rebinds a buffer": (_rebinds_buffer, ".scale (rebinds a buffer)"),
    "registers a non-persistent buffer": (_registers_buffer, ".extra (adds a buffer)"),
    "deletes a buffer": (_deletes_buffer, ".scale (deletes a buffer)"),
}


class _Rewirer:
    """A user's object whose method makes the write (the hook only calls it)."""

    def __init__(self, way: Callable[..., None]) -> None:
        self.way = way

    def rewire(self, m: nn.Module) -> None:
        self.way(m)


def _through_a_method(way: Callable[..., None]) -> Callable[..., None]:
    rewirer = _Rewirer(way)

    def hook(m: nn.Module, *args: Any) -> None:
        rewirer.rewire(m)

    return hook


def _model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """``tanh_pair`` with a buffer on layer ``a`` and a no-op forward, pre and backward
    hook on it (``HANDLES``), all there before compile."""
    model, batch = tanh_pair()
    model.a.register_buffer("scale", torch.ones(1, dtype=torch.float64))
    HANDLES.update(forward=model.a.register_forward_hook(_noop),
                   pre=model.a.register_forward_pre_hook(_noop),
                   backward=model.a.register_full_backward_hook(_noop_backward))
    return model, batch


def _wiring(model: nn.Module) -> list[tuple[str, Any]]:
    """Each module's slots and hook tables (its dicts of hooks and flags) as (key, object)
    lists in their order, its flag of full backward hooks and its non-persistent buffers;
    compared by identity (``_same``)."""
    found: list[tuple[str, Any]] = []
    for name, m in model.named_modules():
        tables = [k for k, v in vars(m).items() if "hook" in k and isinstance(v, dict)]
        for key in ("_parameters", "_buffers", "_modules", *tables):
            found.append((f"{name}.{key}", list(getattr(m, key).items())))
        found.append((f"{name} flags", (m._is_full_backward_hook,
                                        sorted(m._non_persistent_buffers_set))))
    return found


def _same(before: list[tuple[str, Any]], after: list[tuple[str, Any]]) -> list[str]:
    """Where ``after`` differs from ``before``: keys, order, objects (by identity)."""
    def differs(a: Any, b: Any) -> bool:
        if isinstance(a, list):
            return len(a) != len(b) or any(ka != kb or va is not vb
                                           for (ka, va), (kb, vb) in zip(a, b))
        return a != b

    assert [k for k, _ in before] == [k for k, _ in after]
    return [k for (k, a), (_, b) in zip(before, after) if differs(a, b)]


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


def _refused_with_nothing_changed(register: Callable[[nn.Module], Any], named: str,
                                  after_compile: bool = False) -> None:
    """The hook that ``register`` puts on layer ``a`` (before compile, or after) is refused
    at the first step, naming ``named`` and both fixes; compile and the refusal changed
    nothing (the wiring by identity, the values, no gradient); with it removed, the step
    is eager's."""
    model, batch = _model()
    ref = copy.deepcopy(model)
    values = _values(model)
    if after_compile:
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    handle = register(model.a)
    before = _wiring(model)
    if not after_compile:
        cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
        assert not _same(before, _wiring(model)), "compile changed the wiring"
    for _ in range(2):  # a second call too: nothing of the first was left
        with pytest.raises(UncheckedHookError) as refusal:
            cm(*batch).backward()
        message = str(refusal.value)
        assert f"a hook of Linear 'a' changes <the layer>{named}" in message, message
        assert "mbcompile.per_microbatch(hook)" in message and "outside forward" in message
        assert not _same(before, _wiring(model)), "the refusal changed the wiring"
        assert all(torch.equal(v, values[k]) for k, v in _values(model).items())
        assert all(p.grad is None for p in model.parameters())
    handle.remove()
    loss = cm(*batch)
    loss.backward()
    expected = ref(*batch)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12, n


@pytest.mark.parametrize("through", ["in the hook", "through a method"])
@pytest.mark.parametrize("way", list(WAYS))
def test_a_forward_hook_that_rewires_its_layer_is_refused_with_nothing_changed(way, through):
    """Each way, in the forward hook's own code and through a method of the user's it
    calls: refused, naming what it changed, the model as it was."""
    hook, named = WAYS[way]
    if through == "through a method":
        hook = _through_a_method(hook)
    _refused_with_nothing_changed(lambda layer: layer.register_forward_hook(hook), named)


@pytest.mark.parametrize("kind", ["forward pre-hook", "backward hook",
                                  "forward hook registered after compile"])
@pytest.mark.parametrize("way", ["registers a forward hook", "rebinds a parameter"])
def test_a_pre_backward_or_later_hook_that_rewires_its_layer_is_refused(kind, way):
    """The same from a forward pre-hook, from a full backward hook (which runs in each
    microbatch's backward, inside the step's call; compile's probes never attach it) and
    from a forward hook compile never called."""
    hook, named = WAYS[way]
    register = {"forward pre-hook": lambda layer: layer.register_forward_pre_hook(hook),
                "backward hook": lambda layer: layer.register_full_backward_hook(hook),
                "forward hook registered after compile":
                    lambda layer: layer.register_forward_hook(hook)}[kind]
    _refused_with_nothing_changed(register, named,
                                  after_compile=kind == "forward hook registered after compile")


def test_a_marked_hook_that_rewires_its_layer_runs_on_each_microbatch():
    """Marked ``per_microbatch``, a hook that registers a pre-hook on its layer and rebinds
    a buffer does so on each microbatch (four registrations, the buffer the last
    microbatch's rows), the loss and gradients eager's; compile's calls of it on made-up
    data left nothing."""
    model, batch = _model()
    ref = copy.deepcopy(model)
    handles: list[Any] = []

    def rewires(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        handles.append(m.register_forward_pre_hook(_noop))
        m.scale = torch.full((1,), float(out.shape[0]), dtype=torch.float64)

    model.a.register_forward_hook(mbcompile.per_microbatch(rewires))
    before, scale = _wiring(model), model.a.scale
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    assert not _same(before, _wiring(model)) and handles == [] and model.a.scale is scale
    loss = cm(*batch)
    loss.backward()
    expected = ref(*batch)
    expected.backward()
    assert len(handles) == 4 and all(h.id in model.a._forward_pre_hooks for h in handles)
    assert model.a.scale.item() == 1.0  # the last microbatch's rows (2, 2 | 2, 1)
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12


# ------------------------------------------------------------------ the snapshot alone


def test_rewired_names_each_change_and_restore_puts_it_back_in_order():
    """All the ways at once on a layer's snapshot: ``rewired`` names each (and ``changes``
    none: they are the module's own bookkeeping), ``restore`` puts every slot, hook and
    mark back, in its order (a parameter deleted and put back is first again)."""
    model, _ = _model()
    layer = model.a
    layer.register_buffer("hidden", torch.zeros(1), persistent=False)
    snapshot = Snapshot({"<the layer>": layer})
    before = _wiring(layer)
    layer.register_forward_hook(_noop)
    HANDLES["pre"].remove()
    _registers_backward_hook(layer)
    _deletes_parameter(layer)
    _rebinds_parameter_by_setattr(layer)
    _rebinds_buffer(layer)
    _registers_buffer(layer)
    del layer.hidden
    assert snapshot.changes() == []
    assert snapshot.rewired() == [
        "<the layer>.bias (rebinds a parameter)", "<the layer>.weight (deletes a parameter)",
        "<the layer>.scale (rebinds a buffer)", "<the layer>.extra (adds a buffer)",
        "<the layer>.hidden (deletes a buffer)",
        "<the layer>._backward_hooks (registers the backward hook '_noop_backward')",
        "<the layer>._forward_hooks (registers the forward hook '_noop')",
        "<the layer>._forward_pre_hooks (removes the forward pre-hook '_noop')"]
    snapshot.restore()
    assert not _same(before, _wiring(layer)) and snapshot.rewired() == []


def test_a_hook_table_or_the_slots_replaced_whole_is_named_and_put_back():
    """``m._forward_hooks = {}`` or ``m._parameters = dict(...)`` leaves the recorded
    tables as they were: named as ``nn.Module``'s own attribute rebound, and put back."""
    layer = nn.Linear(2, 2)
    layer.register_forward_hook(_noop)
    snapshot = Snapshot({"<the layer>": layer})
    before = _wiring(layer)
    layer._forward_hooks = type(layer._forward_hooks)()
    layer._parameters = dict(layer._parameters)
    assert snapshot.rewired() == [
        "<the layer>._forward_hooks (rebinds nn.Module's own attribute)",
        "<the layer>._parameters (rebinds nn.Module's own attribute)"]
    snapshot.restore()
    assert not _same(before, _wiring(layer))


def test_a_sandboxed_call_that_rewires_is_reported_and_put_back():
    """``call_sandboxed`` alone (outside a step): the write named, the layer as it was."""
    layer = nn.Linear(2, 2)
    layer.register_buffer("scale", torch.ones(1))
    x = torch.randn(3, 2)
    before = _wiring(layer)
    for hook, named in WAYS.values():
        if "HANDLES" in hook.__code__.co_names:
            continue  # (the removals need ``_model``'s hooks: covered in a step)
        wrote = call_sandboxed(_through_a_method(hook), layer, ((x,), layer(x)))[1]
        assert wrote is not None and named in wrote, (hook.__name__, wrote)
        assert not _same(before, _wiring(layer)), hook.__name__


def test_compile_never_calls_a_layers_backward_hook_on_fake_tensors():
    """A layer's backward hook present at compile: the probes (made-up data, fake tensors)
    call the layer without it, so nothing it records is left by compile; the step calls
    it on real gradients."""
    model, batch = _model()
    seen: list[str] = []
    model.a.register_full_backward_hook(
        mbcompile.per_microbatch(lambda m, grad_in, grad_out: seen.append(type(grad_out[0]))))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    assert seen == []
    cm(*batch).backward()
    assert seen and all(kind is torch.Tensor for kind in seen)
