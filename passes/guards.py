"""Guards: the Python values a capture read from the model, checked again on every call.

Tracing runs forward once; a Python value it reads (``self.beta`` in
``self.beta * kl``, a flag in an ``if``, a dropout's ``p`` under export) is baked into
the graph as a constant. Like dynamo's guards, each such read is recorded with its
value, and the compiled module compares them on every call: a change recompiles
(once per new state) with a warning that names the attribute, instead of running a
stale constant.

Before::

    def forward(self, x, y):
        return self.beta * F.mse_loss(self.lin(x), y)      # beta = 1.0 at compile time

Recorded (``recorded_reads(model)``): ``Guard(module=<Net>, name="beta", value=1.0)``;
``model.beta = 0.5`` later makes ``failed_guard(guards)`` return it.

Only instance attributes holding plain values (bools, numbers, strings, None and
tuples of them) are guards: tensors are read live from the graph, and submodules,
parameters and buffers are checked by identity elsewhere (``CompiledModule``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from .errors import CaptureError

__all__ = ["MISSING", "Guard", "failed_guard", "plain", "recorded_reads", "written_guard"]

_MISSING = object()
_LOCAL = threading.local()  # .sink: the reads of the capture in progress on this thread
_RECORDING: dict[type, type] = {}  # a module class -> its recording subclass


@dataclass(frozen=True)
class Guard:
    """``module.<name>`` held ``value`` when the graph was captured; with ``item``,
    ``module[name]`` (a dict's key), and ``module`` any object; ``where`` names it."""

    module: Any
    name: Any
    value: Any
    item: bool = False
    where: str = ""

    def now(self) -> Any:
        if self.item:
            return self.module.get(self.name, _MISSING)
        return vars(self.module).get(self.name, _MISSING)

    def holds(self) -> bool:
        now = self.now()
        return type(now) is type(self.value) and now == self.value

    def describe(self, names: dict[int, str]) -> str:
        now = self.now()
        shown = "deleted" if now is _MISSING else repr(now)
        before = "missing" if self.value is _MISSING else repr(self.value)
        if self.where:
            return f"{self.where} was {before}, now {shown}"
        owner = names.get(id(self.module), type(self.module).__name__)
        return f"{'.'.join(filter(None, (owner, self.name)))} was {before}, now {shown}"


def written_guard(owner: Any, key: Any, before: Any, item: bool, where: str) -> Guard:
    """A guard on a location forward wrote a plain value to (``self.stats["n"] = ... + 1``):
    the value written may depend on the one it replaced, which the trace saw as
    ``before`` (``MISSING`` when absent), so a replay is exact only while that holds."""
    return Guard(owner, key, before, item, where)


MISSING = _MISSING


def failed_guard(guards: Sequence[Guard]) -> Guard | None:
    """The first guard that no longer holds, or None."""
    for guard in guards:
        if not guard.holds():
            return guard
    return None


def plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _recording(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that reports reads of plain instance attributes,
    and a ``__setattr__`` that reports writes of public ones."""
    if cls in _RECORDING.values():  # a capture inside a capture: already recording
        return cls
    if cls not in _RECORDING:
        def __getattribute__(self: Any, name: str) -> Any:
            value = super(sub, self).__getattribute__(name)
            sink = getattr(_LOCAL, "sink", None)
            if sink is not None and not name.startswith("__") and plain(value):
                own = object.__getattribute__(self, "__dict__")
                key = (id(self), name)
                if name in own and own[name] is value and key not in _LOCAL.written:
                    sink.setdefault(key, Guard(self, name, value))
            return value

        def __setattr__(self: Any, name: str, value: Any) -> None:
            writes = getattr(_LOCAL, "writes", None)
            if writes is not None and plain(value):
                key = (id(self), name)
                # read before it is written (self.calls += 1): state carried across calls;
                # written first (self.seq_len = x.size(1)): set afresh by every call
                if key in _LOCAL.sink and _LOCAL.sink[key].value != value:
                    writes.append((self, name))
                _LOCAL.written.add(key)
            super(sub, self).__setattr__(name, value)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__setattr__": __setattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _RECORDING[cls] = sub
    return _RECORDING[cls]


@contextlib.contextmanager
def recorded_reads(model: nn.Module, model_name: str) -> Iterator[list[Guard]]:
    """While the block traces ``model``: record the plain attributes read from its modules.

    The list yielded is filled when the block ends, first read first. Each module's class
    is a recording subclass for the duration (same name and module), then its own again.
    A public number, string or flag that forward reads and then assigns a new value
    (``self.calls += 1``) is state the compiled module would never update: ``CaptureError``.
    One that forward assigns before reading it (``self.seq_len = x.size(1)``) is set afresh
    by every call: neither refused nor guarded. (The capture undoes every assignment itself,
    ``capture.python_state_kept``.)
    """
    modules = list(model.modules())
    classes = [type(m) for m in modules]
    sink: dict[tuple[int, str], Guard] = {}
    writes: list[tuple[nn.Module, str]] = []
    outer = (getattr(_LOCAL, "sink", None), getattr(_LOCAL, "writes", None),
             getattr(_LOCAL, "written", None))
    guards: list[Guard] = []
    for m, cls in zip(modules, classes):
        m.__class__ = _recording(cls)
    _LOCAL.sink, _LOCAL.writes, _LOCAL.written = sink, writes, set()
    try:
        yield guards
    finally:
        _LOCAL.sink, _LOCAL.writes, _LOCAL.written = outer
        for m, cls in zip(modules, classes):
            m.__class__ = cls
        guards.extend(sink.values())
    if writes:
        module, name = writes[0]
        owner = next((n for n, m in model.named_modules() if m is module), "")
        raise CaptureError(
            f"{model_name}.forward assigns the Python attribute "
            f"{'.'.join(filter(None, (owner, name)))!r}; tracing ran that assignment once, "
            "at compile time, and the compiled module would never repeat it. Fix: keep the "
            "value in a buffer (register_buffer) and update it in place, or update it "
            "outside forward")
