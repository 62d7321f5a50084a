"""The sandbox's cheaper per-call check (issue 35's cost of a layer hook's check), never
looser than the sandbox as it was.

``passes/sandbox_patches.py`` leaves ``print``, ``logging``, ``open`` and
``Tensor.register_hook`` switched from a microbatch's first sandboxed hook call to its end:
inside a sandboxed call each records or refuses as the per-call patches did, between calls
each acts as the function it replaced. ``state_unchanged.Fingerprint`` answers a kept
watch's ``unchanged``: never True where ``Snapshot.changes`` finds a difference, and the
same answer as ``unchanged``. A kept watch reads the in-place counters anew before each
call, so an optimizer step between calls keeps it, and a hook's own in-place write is
still seen."""

from __future__ import annotations

import builtins
import collections
import copy
import io
import logging
import operator
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn
from models import rel_err, tanh_pair

import mbcompile
from mbcompile.errors import UncheckedHookError
from mbcompile.passes import hook_sandbox, sandbox_patches
from mbcompile.passes.code_reach import Slot
from mbcompile.passes.hook_sandbox import call_sandboxed
from mbcompile.passes.print_calls import prints_recorded
from mbcompile.passes.python_state import Snapshot
from mbcompile.passes.state_unchanged import Fingerprint, unchanged

pytestmark = pytest.mark.filterwarnings("ignore")

LOG = logging.getLogger("mbcompile.tests.sandbox_patches")
PATH: Any = None  # the file a hook opens (set per test)
LAST: Any = None
SETTING: Any = 1000


def _patched() -> tuple[Any, ...]:
    return (builtins.print, builtins.open, io.open, logging.Logger._log,
            logging.Logger.isEnabledFor, torch.Tensor.register_hook)


ORIGINALS = _patched()


@pytest.fixture(autouse=True)
def originals_back() -> Iterator[None]:
    yield
    assert all(map(operator.is_, _patched(), ORIGINALS)), "a patch was left in place"


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """What ``LOG`` emits, as its handler receives it."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    LOG.addHandler(handler)
    try:
        yield got
    finally:
        LOG.removeHandler(handler)


def _layer() -> tuple[nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Linear(4, 4), torch.randn(2, 4)


def _args(layer: nn.Module, x: torch.Tensor) -> tuple[Any, ...]:
    return (x,), layer(x)


def _sized(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
    return None if out.size(0) else None  # a method call: sandboxed


class _Recorder:
    def record(self, m: nn.Module, rows: int) -> None:
        m.seen = rows  # the layer written inside a method call

    def hook(self, m: nn.Module) -> None:
        m.register_forward_pre_hook(_sized)  # its hooks rewired inside a method call

    def rebind(self, m: nn.Module) -> None:
        m.weight = nn.Parameter(m.weight.detach().clone())


RECORDER = _Recorder()


def _set_last(rows: int) -> None:
    global LAST
    LAST = rows


def _hooks(seen: list[int]) -> dict[str, Any]:
    """Hooks that call a method and, given 2 rows (not 1), write in one way each."""
    return {
        "print": lambda m, a, o: o.size(0) == 2 and print("rows", o.size(0)),
        "log": lambda m, a, o: o.size(0) == 2 and LOG.warning("rows %s", o.size(0)),
        "open": lambda m, a, o: o.size(0) == 2 and open(PATH, "w"),  # noqa: SIM115
        "tensor hook": lambda m, a, o: o.size(0) == 2 and o.register_hook(lambda g: g * 2),
        "global": lambda m, a, o: o.size(0) == 2 and _set_last(o.size(0)),
        "layer, in a method": lambda m, a, o: o.size(0) == 2 and RECORDER.record(m, 2),
        "closure list": lambda m, a, o: o.size(0) == 2 and seen.append(o.size(0)),
        "in place": lambda m, a, o: o.size(0) == 2 and m.weight.detach().mul_(1.0),
        "hook registered, in a method": lambda m, a, o: o.size(0) == 2 and RECORDER.hook(m),
        "parameter rebound, in a method": lambda m, a, o: o.size(0) == 2 and RECORDER.rebind(m),
    }


CASES = list(_hooks([]))


def _nothing_kept(layer: nn.Module, seen: list[int], capsys: Any,
                  records: list[logging.LogRecord], weight: nn.Parameter) -> None:
    assert "seen" not in vars(layer) and seen == [] and LAST is None
    assert not layer._forward_pre_hooks and not PATH.exists()
    assert layer.weight is weight and list(layer._parameters) == ["weight", "bias"]
    assert capsys.readouterr().out == "" and records == []


@pytest.mark.parametrize("case", CASES)
def test_a_held_microbatchs_kept_watch_refuses_each_write_as_a_call_alone(
        case, tmp_path, capsys, records):
    """Each way of writing, made inside a method call on the second call of a hook whose
    first call was clean: in a held microbatch, through the kept watch (the fingerprint
    before and after the call, the patches left in place), it is refused with the very
    words a call alone (fresh patches, a fresh walk) gives, and put back the same way."""
    global PATH, LAST
    PATH, LAST = tmp_path / "opened.txt", None
    layer, x = _layer()
    seen: list[int] = []
    hook = _hooks(seen)[case]
    alone = call_sandboxed(hook, layer, _args(layer, x))[1]
    assert alone is not None, case
    _nothing_kept(layer, seen, capsys, records, weight := layer.weight)
    kept: hook_sandbox.Kept = {}
    sandbox_patches.hold()
    try:
        assert call_sandboxed(hook, layer, _args(layer, x[:1]), kept=kept)[1] is None
        assert layer in kept
        held = call_sandboxed(hook, layer, _args(layer, x), kept=kept)[1]
    finally:
        sandbox_patches.release()
    assert held == alone
    _nothing_kept(layer, seen, capsys, records, weight)


def test_the_patches_stay_for_a_held_microbatch_and_go_with_it():
    """Alone, a sandboxed call puts the six functions back after it; in a held microbatch
    they stay between its calls, and go back when it ends."""
    layer, x = _layer()
    kept: hook_sandbox.Kept = {}
    assert call_sandboxed(_sized, layer, _args(layer, x), kept=kept)[1] is None
    assert all(map(operator.is_, _patched(), ORIGINALS))
    sandbox_patches.hold()
    try:
        for _ in range(3):
            assert call_sandboxed(_sized, layer, _args(layer, x), kept=kept)[1] is None
        assert not any(map(operator.is_, _patched(), ORIGINALS))
    finally:
        sandbox_patches.release()


def test_between_sandboxed_calls_each_switched_function_is_the_one_it_replaced(
        tmp_path, capsys, records):
    """In place between two sandboxed calls, the six functions print, log (the record
    naming this function and line, not the switch), answer a logger's level, open files
    and register tensor hooks as without them."""
    layer, x = _layer()
    sandbox_patches.hold()
    try:
        call_sandboxed(_sized, layer, _args(layer, x), kept={})
        assert builtins.print is not ORIGINALS[0]
        print("between")
        LOG.warning("logged"); line = _line()  # noqa: E702
        assert LOG.isEnabledFor(logging.WARNING) and not LOG.isEnabledFor(logging.DEBUG)
        with open(tmp_path / "a.txt", "w") as f, \
                io.open(tmp_path / "b.txt", "w") as g:  # noqa: UP020
            f.write("a")
            g.write("b")
        t = torch.ones(2, requires_grad=True)
        t.register_hook(lambda grad: grad * 3)
        t.sum().backward()
    finally:
        sandbox_patches.release()
    assert capsys.readouterr().out == "between\n"
    assert [(r.getMessage(), r.funcName, r.lineno, r.pathname) for r in records] == [
        ("logged", test_between_sandboxed_calls_each_switched_function_is_the_one_it_replaced
         .__name__, line, __file__)]
    assert (tmp_path / "a.txt").read_text() == "a" and (tmp_path / "b.txt").read_text() == "b"
    assert torch.equal(t.grad, torch.full((2,), 3.0))


def _line() -> int:
    import inspect
    return inspect.currentframe().f_back.f_lineno  # type: ignore[union-attr]


def test_a_patch_replaced_inside_a_microbatch_is_put_in_place_again(capsys):
    """A capture's ``prints_recorded`` run inside a held microbatch puts back what it found
    (the switched ``print``); a ``print`` the user puts in place meanwhile is switched
    again at the next sandboxed call, which still records the hook's print, and is theirs
    again after the microbatch; the switched one they kept, put back later, prints as the
    one it replaced."""
    layer, x = _layer()
    printed: list[tuple[Any, ...]] = []
    sandbox_patches.hold()
    try:
        call_sandboxed(_sized, layer, _args(layer, x), kept={})
        kept_by_user = builtins.print
        with prints_recorded():
            assert builtins.print is not kept_by_user
        assert builtins.print is kept_by_user
        builtins.print = lambda *a, **k: printed.append(a)
        wrote = call_sandboxed(lambda m, a, o: print("rows", o.size(0)), layer,
                               _args(layer, x))[1]
        assert wrote is not None and "print" in wrote and printed == []
    finally:
        sandbox_patches.release()
    try:
        print("mine")
        assert printed == [("mine",)]
        builtins.print = kept_by_user
        print("theirs")
        assert capsys.readouterr().out == "theirs\n" and printed == [("mine",)]
    finally:
        builtins.print = ORIGINALS[0]


def test_asking_a_loggers_level_alone_writes_nothing():
    """A hook that logs below its logger's level asks the level and logs nothing: clean
    (the sandbox read a level asked for a print's line, and failed)."""
    layer, x = _layer()
    LOG.isEnabledFor(logging.DEBUG)  # its cache filled, as by any earlier call

    def hook(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        LOG.debug("rows %s", out.size(0))

    assert call_sandboxed(hook, layer, _args(layer, x))[1] is None


def test_a_kept_watch_outlives_an_optimizer_step_and_still_sees_an_in_place_write(
        monkeypatch):
    """The parameters written in place between two calls (an optimizer step) keep the
    watch (no walk: its counters are read anew before the call); the hook's own in-place
    write, on the next call, is still reported."""
    layer, x = _layer()
    hook = _hooks([])["in place"]
    kept: hook_sandbox.Kept = {}
    assert call_sandboxed(hook, layer, _args(layer, x[:1]), kept=kept)[1] is None
    walks: list[int] = []
    monkeypatch.setattr(hook_sandbox._Watch, "of", classmethod(
        lambda cls, *a, _of=hook_sandbox._Watch.of.__func__: walks.append(1) or _of(cls, *a)))
    with torch.no_grad():
        layer.weight.add_(0.1)
    assert call_sandboxed(hook, layer, _args(layer, x[:1]), kept=kept)[1] is None
    assert walks == []
    wrote = call_sandboxed(hook, layer, _args(layer, x), kept=kept)[1]
    assert wrote is not None and "weight (in place)" in wrote and walks == []


class _Config:
    def __init__(self) -> None:
        self.lr, self.name = 0.1, "run"


def _state() -> tuple[nn.Module, dict[str, Any]]:
    layer = nn.Linear(2, 2)
    layer.cfg = _Config()
    layer.table = collections.OrderedDict(a=1, b=2)
    layer.items, layer.queue, layer.tags = [1, 2], collections.deque([1]), {"x"}
    layer.big, layer.empty, layer.none = SETTING, {}, []
    return layer, globals()


def _renamed(layer: nn.Module) -> None:
    value = layer.big
    del layer.big
    layer.other = value  # as many attributes, the same objects, another name


MUTATIONS = {
    "nothing": lambda m, g: None,
    "attribute rebound to an equal value": lambda m, g: setattr(m, "big", int("1000")),
    "attribute added": lambda m, g: setattr(m, "new", 1),
    "attribute deleted": lambda m, g: delattr(m, "big"),
    "attribute renamed": lambda m, g: _renamed(m),
    "ordered key moved to the end": lambda m, g: m.table.move_to_end("a"),
    "dict value replaced by an equal one": lambda m, g: m.table.__setitem__("a", 1.0),
    "list item replaced": lambda m, g: m.items.__setitem__(0, 3),
    "list appended": lambda m, g: m.items.append(3),
    "deque appended": lambda m, g: m.queue.append(2),
    "set added to": lambda m, g: m.tags.add("y"),
    "empty dict filled": lambda m, g: m.empty.__setitem__("k", 1),
    "empty list filled": lambda m, g: m.none.append(1),
    "object attribute rebound": lambda m, g: setattr(m.cfg, "lr", 0.2),
    "object dict replaced, same items": lambda m, g: setattr(m.cfg, "__dict__",
                                                             dict(vars(m.cfg))),
    "parameter replaced": lambda m, g: setattr(m, "weight", nn.Parameter(m.weight.detach())),
    "buffer registered": lambda m, g: m.register_buffer("extra", torch.zeros(1)),
    "forward hook registered": lambda m, g: m.register_forward_hook(_sized),
    "slots dict replaced": lambda m, g: setattr(m, "_parameters", dict(m._parameters)),
    "global rebound": lambda m, g: g.__setitem__("SETTING", int("1000")),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_fingerprint_answers_as_unchanged_and_is_never_looser(mutation):
    """A layer holding a config object, an ordered dict, a list, a deque, a set, an empty
    dict and list and a global slot: after each mutation the fingerprint answers as
    ``unchanged`` does, and True only where ``Snapshot.changes`` finds nothing (the
    mutations that change something answer False)."""
    layer, namespace = _state()
    snapshot = Snapshot({"<the layer>": layer})
    snapshot.add_slot(Slot(namespace, "SETTING", "SETTING"), True)
    fingerprint = Fingerprint(snapshot)
    assert fingerprint.unchanged() and unchanged(snapshot)
    try:
        MUTATIONS[mutation](layer, namespace)
        answer = fingerprint.unchanged()
        assert answer == unchanged(snapshot)
        assert not (answer and snapshot.changes())
        assert answer == (mutation in ("nothing", "object dict replaced, same items"))
    finally:
        globals()["SETTING"] = 1000


def _records_rows() -> Any:
    def records_rows(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        print("rows", out.size(0))
        LOG.warning("rows %s", out.size(0))
    return records_rows  # a new function each time (``per_microbatch`` marks its hook)


def test_a_step_runs_marked_hooks_as_written_beside_sandboxed_ones(capsys, records):
    """In a step, a sandboxed hook on one layer (a method call, clean) leaves the patches in
    place for its microbatch; a hook marked ``per_microbatch`` on the next layer still
    prints and logs once per microbatch (its line in each record), the step is eager's,
    and the six functions are back after it. The same printing hook unmarked is refused,
    nothing printed or logged, no gradient."""
    model, batch = tanh_pair()
    ref = copy.deepcopy(model)
    model.a.register_forward_hook(_sized)
    handle = model.b.register_forward_hook(mbcompile.per_microbatch(_records_rows()))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    capsys.readouterr()
    records.clear()
    loss = cm(*batch)
    loss.backward()
    rows = [2, 2, 2, 1]
    assert capsys.readouterr().out == "".join(f"rows {r}\n" for r in rows)
    assert [(r.getMessage(), r.funcName) for r in records] == [
        (f"rows {r}", "records_rows") for r in rows]
    expected = ref(*batch)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12
    assert all(map(operator.is_, _patched(), ORIGINALS))
    handle.remove()
    model.zero_grad(set_to_none=True)
    model.b.register_forward_hook(_records_rows())
    records.clear()
    with pytest.raises(UncheckedHookError, match="a print or log call"):
        cm(*batch)
    assert capsys.readouterr().out == "" and records == []
    assert all(p.grad is None for p in model.parameters())
