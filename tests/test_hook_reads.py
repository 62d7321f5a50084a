"""The hook sandbox's two shortcuts (issue 35's cost of the hook checks): a hook whose code
provably writes nothing is called without it (``passes/hook_reads.py``), never where a
write could happen, whatever the code or the values it reaches; and a sandboxed hook's
watch is kept between calls that wrote nothing, and walked afresh when anything it
reaches changed (``hook_sandbox._watch``).

Each case that must not take a shortcut is also called through the sandbox, which must
see its write: the shortcut skipping it would lose that refusal."""

from __future__ import annotations

import collections
import os
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import tanh_pair

import mbcompile
from mbcompile.errors import UncheckedHookError
from mbcompile.execution import live_hooks
from mbcompile.passes import hook_sandbox
from mbcompile.passes.hook_reads import reads_only

pytestmark = pytest.mark.filterwarnings("ignore")

SCALE: Any = 2.0
SEEN: list[int] = []
TABLE: Any = {}


class _Writes:
    """An object whose operators and attributes write its own list."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __rmul__(self, other: Any) -> Any:
        self.seen.append(1)
        return other

    def __bool__(self) -> bool:
        self.seen.append(2)
        return True

    @property
    def factor(self) -> float:
        self.seen.append(3)
        return 1.0


class _Sub(torch.Tensor):
    pass


def _layer_and_call() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    return layer, x, layer(x)


def _scaled(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * SCALE


def _checks(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    # (no ``assert``: pytest rewrites it into calls)
    if out.shape[0] > 0 and out.dtype is torch.float64 and m.bias is not None and out.ndim > 5:
        return (out + m.bias[0],)[0]
    return None


def _appends(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    SEEN.append(out.shape[0])


def _counts(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    global SCALE
    SCALE = SCALE + 1


def _sets(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    m.last = out


def _in_place(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    count = m.count
    count += 1


def _looks_up(m: nn.Module, args: tuple, out: torch.Tensor) -> Any:
    return TABLE["rows"]


def _reads_factor(m: nn.Module, args: tuple, out: torch.Tensor) -> Any:
    return out * m.stats.factor


def _calls_builtins(m: nn.Module, args: tuple, out: torch.Tensor) -> Any:
    if isinstance(out, torch.Tensor) and len(args) == 1 and int(out.shape[0]) > 0 and \
            type(out) is torch.Tensor and max(out.shape) == abs(-4) and bool(callable(m)):
        return out * 2.0
    return None


@pytest.mark.parametrize("hook", [lambda m, args, out: None, _scaled, _checks,
                                  lambda m, args: (args[0] * 2.0,), _calls_builtins])
def test_a_hook_that_only_reads_is_called_without_the_sandbox(hook, monkeypatch):
    """No watch is built for it (the sandbox fails if it is), and it returns as called."""
    layer, x, out = _layer_and_call()
    monkeypatch.setattr(hook_sandbox._Watch, "of", None)  # the sandbox: fails if used
    args = ((x,),) if hook.__code__.co_argcount == 2 else ((x,), out)
    result, wrote = hook_sandbox.call_sandboxed(hook, layer, args)
    assert wrote is None
    expected = hook(layer, *args)
    assert (result is None) == (expected is None)


def _closure_writes() -> Any:
    factor: Any = 2.0

    def hook(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * factor

    def rebind() -> _Writes:
        nonlocal factor
        factor = _Writes()
        return factor

    return hook, rebind


@pytest.mark.parametrize("case", [
    "call", "global store", "attribute store", "in place", "closure rebound to an object",
    "global rebound to an object", "defaultdict read", "layer holds an object",
    "tensor subclass", "layer of the user's class"])
def test_a_hook_that_may_write_is_sandboxed_and_its_write_seen(case):
    """Code that calls or stores, or a read whose operator, property or lookup runs the
    user's code (a closure variable rebound after the code was first seen, a global, an
    attribute of the layer, a defaultdict, a tensor subclass, a layer of the user's class):
    never the shortcut, and the sandbox sees what it writes and puts it back."""
    global SCALE, TABLE
    layer, x, out = _layer_and_call()
    hook: Any = {"call": _appends, "global store": _counts, "attribute store": _sets,
                 "in place": _in_place, "defaultdict read": _looks_up}.get(case, _scaled)
    watched: Any = None
    if case == "closure rebound to an object":
        hook, rebind = _closure_writes()
        assert reads_only(hook, (layer, (x,), out))  # the same code: the shortcut, then
        watched = rebind()
    elif case == "global rebound to an object":
        assert reads_only(hook, (layer, (x,), out))
        SCALE = watched = _Writes()
    elif case == "in place":
        layer.register_buffer("count", torch.zeros(()))
    elif case == "defaultdict read":
        TABLE = collections.defaultdict(list)
    elif case == "layer holds an object":
        hook, layer.stats = _reads_factor, _Writes()
        watched = layer.stats
    elif case == "tensor subclass":
        out = out.detach().as_subclass(_Sub)
    elif case == "layer of the user's class":
        layer = type("MyLinear", (nn.Linear,), {"__module__": __name__})(4, 4)
        hook = _checks
    try:
        assert not reads_only(hook, (layer, (x,), out))
        if case in ("tensor subclass", "layer of the user's class"):
            return  # nothing of it writes: sandboxed, and clean
        _, wrote = hook_sandbox.call_sandboxed(hook, layer, ((x,), out))
        assert wrote is not None, case
        assert SEEN == [] and not TABLE and SCALE in (2.0, watched) and \
            "last" not in vars(layer)
        assert watched is None or watched.seen == []
    finally:
        SCALE, TABLE = 2.0, {}


@pytest.mark.parametrize("how", ["call", "operator"])
def test_a_hook_that_writes_on_a_later_call_of_a_step_is_refused(how):
    """A hook that writes only on the step's last microbatch call (1 row, after three of
    2): each call is judged, not the first one per step, so the step is refused with what
    it wrote put back and nothing changed."""
    model, batch = tanh_pair()
    rows: list[int] = []

    class _Late:
        def __init__(self) -> None:
            self.rows: list[int] = []

        def __rmul__(self, out: torch.Tensor) -> torch.Tensor:
            if out.shape[0] == 1:
                self.rows.append(1)
            return out

    late = _Late()

    def by_call(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if out.shape[0] == 1:
            rows.append(1)

    def by_operator(m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return out * late

    model.a.register_forward_hook(by_call if how == "call" else by_operator)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    with pytest.raises(UncheckedHookError, match="per_microbatch"):
        cm(*batch)
    assert rows == late.rows == [] and all(p.grad is None for p in model.parameters())


def test_a_read_only_hook_whose_closure_changes_after_compile_is_refused():
    """A hook that only reads runs each call without the sandbox; its closure variable
    rebound after compile to an object whose operator writes: the next step sandboxes it
    and refuses, with nothing changed."""
    model, batch = tanh_pair()
    hook, rebind = _closure_writes()
    model.a.register_forward_hook(hook)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    cm(*batch).backward()
    model.zero_grad(set_to_none=True)
    writes = rebind()
    with pytest.raises(UncheckedHookError, match="factor"):
        cm(*batch)
    assert writes.seen == [] and all(p.grad is None for p in model.parameters())


SINK: Any = None


def _into_global(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    if SINK is not None:
        SINK.append(out.shape[0])


def _armed(case: str, layer: nn.Module) -> tuple[Any, Any]:
    """A hook that calls (so sandboxed) and writes only once armed, and its arming: a new
    list put where the hook looks, between two calls (returns the hook and the arm)."""
    holder = types.SimpleNamespace(sink=None)
    box: Any = None

    def into_closure(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if box is not None:
            box.append(out.shape[0])

    def into_object(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if holder.sink is not None:
            holder.sink.append(out.shape[0])

    def into_layer(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if getattr(m, "sink", None) is not None:
            m.sink.append(out.shape[0])

    def into_default(m: nn.Module, args: tuple, out: torch.Tensor, sink: Any = None) -> None:
        if sink is not None:
            sink.append(out.shape[0])

    def arm() -> list[int]:
        global SINK
        nonlocal box
        sink: list[int] = []
        if case == "global":
            SINK = sink
        elif case == "closure":
            box = sink
        elif case == "object attribute":
            holder.sink = sink
        elif case == "layer attribute":
            layer.sink = sink
        else:
            into_default.__defaults__ = (sink,)
        return sink

    hooks = {"global": _into_global, "closure": into_closure, "object attribute": into_object,
             "layer attribute": into_layer, "default": into_default}
    return hooks[case], arm


@pytest.mark.parametrize("case", ["global", "closure", "object attribute", "layer attribute",
                                  "default"])
def test_a_kept_watch_is_walked_again_when_what_the_hook_reaches_changes(case, monkeypatch):
    """A sandboxed hook's watch is kept after a call that wrote nothing, and used again
    (no walk); a new list put where the hook looks between two calls (a global, a closure
    variable, an object's or the layer's attribute, a default) is seen: the next call is
    walked afresh, its append seen and put back, and the user's new binding kept."""
    global SINK
    layer, x, out = _layer_and_call()
    hook, arm = _armed(case, layer)
    kept: hook_sandbox.Kept = {}  # a step's wrapper of the hook holds one
    try:
        assert hook_sandbox.call_sandboxed(hook, layer, ((x,), out), kept=kept)[1] is None
        walks = []
        monkeypatch.setattr(hook_sandbox._Watch, "of", classmethod(
            lambda cls, *a, _of=hook_sandbox._Watch.of.__func__: walks.append(1) or
            _of(cls, *a)))
        assert hook_sandbox.call_sandboxed(hook, layer, ((x,), out), kept=kept)[1] is None
        assert walks == []  # kept: nothing it reaches changed
        sink = arm()
        _, wrote = hook_sandbox.call_sandboxed(hook, layer, ((x,), out), kept=kept)
        assert wrote is not None and sink == [] and walks == [1] and layer not in kept
        assert {"global": lambda: SINK, "layer attribute": lambda: layer.sink}.get(
            case, lambda: sink)() is sink
    finally:
        SINK = None


def test_a_read_only_hook_added_after_compile_that_returns_an_output_is_refused():
    """Run without the sandbox, a hook registered after compile that returns a new output
    (``out * 2.0``: nothing tells whether it reads the whole batch) is still refused at its
    first call, the step not run."""
    model, batch = tanh_pair()
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    hook = lambda m, args, out: out * 2.0  # noqa: E731
    assert reads_only(hook, (model.a, (batch[0],), batch[0]))
    model.a.register_forward_hook(hook)
    with pytest.raises(UncheckedHookError, match="changes what the layer returns"):
        cm(*batch)
    assert all(p.grad is None for p in model.parameters())


def _calls_its_layer(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    if out.shape[0] == 2:  # the outer call: a file opened (refused, the refusal caught),
        try:               # then the layer again, so this hook's check inside this one
            open(os.devnull, "w")  # noqa: SIM115
        except Exception:  # noqa: S110
            pass
        m(args[0][:1])


def test_a_hook_called_inside_its_own_call_does_not_share_the_outer_watch():
    """A hook that calls its layer again (so its own check) while its first call runs, in
    a step: the inner call gets a watch of its own, so the outer call still holds the
    refusal of the file it opened (sharing the kept one, the inner call would clear it)
    and is refused."""
    layer, x, _ = _layer_and_call()
    watched = live_hooks.WatchedHook(_calls_its_layer, "lin", checked=True)
    layer.register_forward_hook(watched)
    live_hooks.in_step.depth += 1
    try:
        layer(x[:1])
        assert layer in watched.kept  # kept: the next call would use it
        with pytest.raises(UncheckedHookError, match="a file"):
            layer(x)
    finally:
        live_hooks.in_step.depth -= 1


LOG: list[int] = []


def _helper(out: torch.Tensor) -> None:
    return None


def _logging_helper(out: torch.Tensor) -> None:
    LOG.append(out.shape[0])


def _calls_helper(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    _helper(out)


def test_a_kept_watch_is_walked_again_when_a_function_it_entered_is_redefined(monkeypatch):
    """The walk follows the helper the hook calls; the helper's code swapped between two
    calls for one that appends to another global: the kept watch, which never recorded
    that global, is not used, and the append is seen and put back."""
    layer, x, out = _layer_and_call()
    kept: hook_sandbox.Kept = {}
    assert hook_sandbox.call_sandboxed(_calls_helper, layer, ((x,), out), kept=kept)[1] is None
    assert layer in kept
    monkeypatch.setattr(_helper, "__code__", _logging_helper.__code__)
    _, wrote = hook_sandbox.call_sandboxed(_calls_helper, layer, ((x,), out), kept=kept)
    assert wrote is not None and "LOG" in wrote and LOG == []


@pytest.mark.parametrize("hook", [
    lambda m, args, out: out.grad_fn,  # autograd's graph: its metadata dict is the user's
    lambda m, args, out: m._parameters,  # a private attribute
    lambda m, args, out: [t for t in args],  # an inner function (a comprehension)
    lambda m, args, out: tuple(args),  # a call
    lambda m, args, out: (yield out),  # a generator
], ids=["grad_fn", "private", "comprehension", "call", "generator"])
def test_code_the_scan_cannot_prove_never_takes_the_shortcut(hook):
    """Each shape of code the bytecode scan does not prove writes nothing: sandboxed."""
    layer, x, out = _layer_and_call()
    assert not reads_only(hook, (layer, (x,), out))


def _writes_seen(*args: Any) -> bool:
    SEEN.append(1)
    return True


def _shadowed(name: str) -> Any:
    """``lambda m, args, out: <name>(out, torch.Tensor)`` in a module whose global ``name``
    is a function of the user's that writes."""
    namespace = {"torch": torch, name: _writes_seen, "__builtins__": vars(__builtins__)
                 if isinstance(__builtins__, types.ModuleType) else __builtins__}
    return eval(f"lambda m, args, out: {name}(out, torch.Tensor)", namespace)  # noqa: S307


@pytest.mark.parametrize("case", ["setattr", "print", "exec", "shadowed isinstance",
                                  "replaced builtin", "keyword", "held in a variable",
                                  "three-argument type", "user's class"])
def test_a_hook_whose_builtin_call_may_write_is_sandboxed(case, monkeypatch, capsys):
    """Only a builtin that reads, Python's own, by its name, with its positional arguments,
    on values that run only Python's or torch's code, is called without the sandbox: one
    that writes, prints or runs code, one shadowed by a global or replaced in
    ``builtins``, a keyword, a builtin held in a variable, ``type`` making a class, or
    ``isinstance`` of a class of the user's are sandboxed, and any write seen and put
    back."""
    layer, x, out = _layer_and_call()
    hook = {
        "setattr": lambda m, args, out: setattr(m, "seen", 1),
        "print": lambda m, args, out: print("rows", out.shape[0]),
        "exec": lambda m, args, out: exec("m.seen = 1"),
        "shadowed isinstance": _shadowed("isinstance"),
        "replaced builtin": lambda m, args, out: abs(-1),
        "keyword": lambda m, args, out: min(args, key=len),
        "held in a variable": lambda m, args, out, f=isinstance: f(out, torch.Tensor),
        "three-argument type": lambda m, args, out: type("Seen", (), {}),
        "user's class": lambda m, args, out: isinstance(out, _Writes),
    }[case]
    try:
        if case == "replaced builtin":  # (only while asked: pytest itself calls builtins)
            monkeypatch.setattr("builtins.abs", print)  # a builtin too, which prints
            assert not reads_only(hook, (layer, (x,), out))
            monkeypatch.undo()
            assert reads_only(hook, (layer, (x,), out))
            return
        assert not reads_only(hook, (layer, (x,), out))
        if case in ("keyword", "held in a variable", "three-argument type", "user's class"):
            return  # nothing of it writes: sandboxed, and clean
        _, wrote = hook_sandbox.call_sandboxed(hook, layer, ((x,), out))
        assert wrote is not None, case
        assert "seen" not in vars(layer) and capsys.readouterr().out == "" and SEEN == []
    finally:
        SEEN.clear()
