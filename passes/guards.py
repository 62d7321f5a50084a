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

Instance attributes of any name holding plain values (bools, numbers, strings, None
and tuples of them) are guarded by value, a tensor kept in a plain attribute by
identity (fx holds it as a constant); submodules, parameters and buffers are checked
by identity elsewhere (``CompiledModule``). A plain value forward reads and then
assigns (``self.calls += 1``) is guarded too: the capture's side effects replay the
write (``side_effects.py``), exact while the value read is the one traced, and the
next call, which reads the new value, compiles again for it.
"""

from __future__ import annotations

import contextlib
import dis
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from .errors import CaptureError
from .guard_values import (
    ATOMS,
    NUMPY_NUMBERS,
    entries_of,
    fingerprint,
    method_lookups,
    parts_changed,
    plain_object,
    slotted_object,
)
from .python_state import MODULE_INTERNALS
from .read_paths import Call, Get, appended_read, path_after, read_where_written, shown
from .whose_code import holds_state, user_code

__all__ = ["MISSING", "Guard", "NumberInput", "failed_guard", "inputs_wanted",
           "numbers_as_inputs", "own_class", "plain", "read_number", "recorded_reads", "unrecorded",
           "unwritten", "written_guard"]

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
    identity: bool = False  # the same object (a tensor), not an equal value
    feeds: NumberInput | None = None  # a graph input: any number of the type, fed each call
    contents: Any = None  # a container or object: its fingerprint (guard_values.py)
    reached: frozenset[int] = frozenset()  # the containers and objects that fingerprint read
    entries: Any = None  # an installed package's container, the same one: its entries
    #: the paths (``read_paths``: constant keys, ``.get``, attributes, a method called;
    #: ``()``: itself) through which forward read it other than to append or write
    #: (``len(self.box["seen"])``: ``("seen",)``), checked by ``unwritten``
    reads: frozenset[tuple[Any, ...]] = frozenset()
    opaque: frozenset[int] = frozenset()  # inside ``contents``: forward writes them, by id


    def now(self) -> Any:
        if self.item:
            return self.module.get(self.name, _MISSING)
        return vars(self.module).get(self.name, _MISSING)

    def holds(self) -> bool:
        now = self.module.get(self.name, _MISSING) if self.item else \
            self.module.__dict__.get(self.name, _MISSING)  # self.now(), inlined: every call
        if self.feeds is not None:  # checked on every call, before the graph runs: feed it
            if type(now) is not type(self.value):
                return False
            self.feeds.value = now
            return True
        if self.identity:
            return now is self.value
        if self.entries is not None:
            return now is self.value and entries_of(now) == self.entries
        if self.contents is not None:
            return fingerprint(now, self.opaque)[0] == self.contents
        return type(now) is type(self.value) and now == self.value

    def describe(self, names: dict[int, str]) -> str:
        now = self.now()

        def shown(value: Any, absent: str) -> str:
            return absent if value is _MISSING else repr(value)

        # the same container, changed in place: only its fingerprint was kept, not its old
        # contents (repr(self.value) would show the new ones twice)
        if (self.contents is not None or self.entries is not None) and now is self.value:
            parts = parts_changed(self.contents, now, self.opaque)
            change = f"changed, now {parts or shown(now, 'deleted')}"
        else:
            change = f"was {shown(self.value, 'missing')}, now {shown(now, 'deleted')}"
        if self.where:
            return f"{self.where} {change}"
        owner = names.get(id(self.module), type(self.module).__name__)
        return f"{'.'.join(filter(None, (owner, self.name)))} {change}"


def written_guard(owner: Any, key: Any, before: Any, item: bool, where: str) -> Guard:
    """A guard on a location forward wrote a plain value to (``self.stats["n"] = ... + 1``):
    the value written may depend on the one it replaced, which the trace saw as
    ``before`` (``MISSING`` when absent), so a replay is exact only while that holds."""
    return Guard(owner, key, before, item, where)


MISSING = _MISSING


class NumberInput:
    """A module attribute's number read by the graph at run time (``read_number``): the
    graph holds this object, its guard sets ``value`` from the attribute on every call."""

    __slots__ = ("value",)  # not a plain object: never guarded itself

    def __init__(self, value: float) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"NumberInput({self.value!r})"


def read_number(holder: NumberInput) -> float:
    """The number a graph input holds now (a Python number, as eager reads it)."""
    return holder.value


@contextlib.contextmanager
def numbers_as_inputs(keys: frozenset[tuple[int, Any]]) -> Iterator[None]:
    """Captures in the block read the numbers at ``(id(module), name)`` as graph inputs
    (``recorded_reads``' ``as_input``) instead of constants: a value that changes on every
    call then costs no compile (``mbcompile/guard_cache.py`` says which)."""
    outer = getattr(_LOCAL, "as_inputs", frozenset())
    _LOCAL.as_inputs = keys
    try:
        yield
    finally:
        _LOCAL.as_inputs = outer


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Reads in the block are the capture's own, not forward's, and guard nothing: fx's
    ``GraphModule(model, graph)`` copies the model's ``training``, which would make every
    fx capture look like a trace that branched on the mode (``mbcompile/captures.py``)."""
    sink = getattr(_LOCAL, "sink", None)
    _LOCAL.sink = None
    try:
        yield
    finally:
        _LOCAL.sink = sink


def inputs_wanted() -> frozenset[tuple[int, Any]]:
    """The keys of the ``numbers_as_inputs`` block in progress (empty outside one)."""
    return getattr(_LOCAL, "as_inputs", frozenset())


def failed_guard(guards: Sequence[Guard]) -> Guard | None:
    """The first guard that no longer holds, or None."""
    for guard in guards:
        if not guard.holds():
            return guard
    return None


def plain(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(plain(v) for v in value)
    return isinstance(value, ATOMS)


def own_class(obj: Any) -> type:
    """``type(obj)``, or while a capture records ``obj``'s reads the class it records for
    (``_recording``: errors name ``torch.nn.BatchNorm1d``, not its recording subclass)."""
    cls = type(obj)
    return cls.__base__ if cls in _RECORDING.values() else cls  # type: ignore[return-value]


def _recording(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that reports reads of plain instance attributes,
    and a ``__setattr__`` that reports writes of public ones."""
    if cls in _RECORDING.values():  # a capture inside a capture: already recording
        return cls
    if cls not in _RECORDING:
        def __getattribute__(self: Any, name: str) -> Any:
            try:
                value = super(sub, self).__getattribute__(name)
            except AttributeError:  # ``hasattr(self, "first")``: guarded missing
                _missing_read(self, name)
                raise
            sink = getattr(_LOCAL, "sink", None)
            if sink is not None and not name.startswith("__") and name not in MODULE_INTERNALS:
                own = object.__getattribute__(self, "__dict__")
                key = (id(self), name)
                if name in own and own[name] is value and key not in _LOCAL.written:
                    make = _LOCAL.as_input
                    if make is not None and key in inputs_wanted() and (type(value) in (
                            int, float) or isinstance(value, NUMPY_NUMBERS)):
                        guard = sink.setdefault(key, Guard(self, name, value,
                                                           feeds=NumberInput(value)))
                        return make(guard.feeds)
                    if plain(value):
                        sink.setdefault(key, Guard(self, name, value))
                    elif isinstance(value, (dict, list, tuple, set, frozenset)) or \
                            plain_object(value) or slotted_object(value):  # a config object
                        path = _read_path(sys._getframe(1))
                        if path is not None:
                            _LOCAL.paths.setdefault(key, set()).add(path)
                        # fingerprinted once the capture has put back what it switched
                        # for the trace (export's use_cache=False): ``unwritten``
                        sink.setdefault(key, Guard(self, name, value, contents=_PENDING))
                    elif isinstance(value, torch.Tensor):  # a tensor kept in a plain attribute:
                        # fx holds it as a constant, so a new one (a replayed write) recompiles
                        sink.setdefault(key, Guard(self, name, value, identity=True))
                    elif isinstance(value, types.BuiltinFunctionType):  # self.act = torch.tanh:
                        # the trace calls it by name, a replacement would not be seen
                        sink.setdefault(key, Guard(self, name, value, identity=True))
                    elif callable(value) and holds_state(value):  # a schedule object
                        path = _read_path(sys._getframe(1))
                        if path is not None:
                            _LOCAL.paths.setdefault(key, set()).add(path)
                        _callable_object(sink, self, name, value)
                elif name not in own and key not in _LOCAL.written and (plain(value) or isinstance(
                        value, (dict, list, set)) or plain_object(value)):  # ``self.LOG``, too
                    _class_attribute(sink, self, name, value, _read_path(sys._getframe(1)))
            return value

        def __setattr__(self: Any, name: str, value: Any) -> None:
            # written before it is read (self.seq_len = x.size(1)): set afresh by every call,
            # so later reads see forward's own value and are not guarded; read first
            # (self.calls += 1): the read's guard makes the replayed write exact
            if getattr(_LOCAL, "written", None) is not None:
                _LOCAL.written[(id(self), name)] = (self, name, value)
            super(sub, self).__setattr__(name, value)

        sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                          "__setattr__": __setattr__,
                                          "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _RECORDING[cls] = sub
    return _RECORDING[cls]


def _read_path(frame: types.FrameType) -> tuple[Any, ...] | None:
    """The steps through which the attribute ``frame`` loads now is read
    (``self.box["seen"]`` then anything: ``("seen",)``; ``read_paths``), or None where what
    it leads to is only appended to (``.append``, ``.extend``) or written
    (``self.stats["k"] = v``, ``+=``: guarded where written); loaded to be called
    (``self.schedule(t)``): what its ``__call__`` reads. Worked out once per code object."""
    code = frame.f_code
    after = _NEXT.get(code)
    if after is None:
        ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        after = _NEXT[code] = {a.offset: (_CALLED if a.opname == "LOAD_METHOD" or (
            a.opname == "LOAD_ATTR" and sys.version_info >= (3, 12) and (a.arg or 0) & 1)
            else path_after(ins, n + 1)) for n, a in enumerate(ins)
            if a.opname in ("LOAD_ATTR", "LOAD_METHOD")}
    return after.get(frame.f_lasti, ())


_CALLED = (Call("__call__"),)


_NEXT: dict[types.CodeType, dict[int, Any]] = {}


def _callable_object(sink: dict[tuple[int, str], Guard], module: Any, name: str, value: Any
                     ) -> None:
    """``self.schedule(t)``, a callable object of the user's (not a plain object, whose
    fingerprint would be its identity): guarded by identity, and each attribute it holds
    by value (a plain value) or contents (a container)."""
    where = f"{type(module).__name__}.{name}"
    sink.setdefault((id(module), name), Guard(module, name, value, identity=True, where=where))
    for attr, held in vars(value).items():
        guard = Guard(value, attr, held, where=f"{where}.{attr}")
        if plain(held):
            sink.setdefault((id(value), attr), guard)
        elif isinstance(held, (dict, list, tuple, set, frozenset)) or plain_object(held):
            sink.setdefault((id(value), attr), replace(guard, contents=_PENDING))


def _class_attribute(sink: dict[tuple[int, str], Guard], module: Any, name: str, value: Any,
                     path: tuple[Any, ...] | None) -> None:
    """``self.SCALE`` read from the class of the user's that defines it: guarded there (a
    container by its contents, ``path``: how it was read), and against an instance
    attribute that would shadow it."""
    owner = next((c for c in type(module).__mro__[1:] if name in vars(c)), None)
    if owner is not None and vars(owner)[name] is value and \
            user_code(getattr(sys.modules.get(owner.__module__), "__file__", None)):
        guard = Guard(owner, name, value, where=f"{owner.__name__}.{name}")
        if not plain(value) and path is not None:
            _LOCAL.paths.setdefault((id(owner), name), set()).add(path)
        sink.setdefault((id(owner), name), guard if plain(value) else
                        replace(guard, contents=_PENDING))
        sink.setdefault((id(module), name), Guard(module, name, _MISSING, identity=True,
                                                  where=f"{type(module).__name__}.{name}"))


def _missing_read(obj: Any, name: str) -> None:
    """``hasattr(self, "x")`` of an attribute ``obj`` lacks (nor a parameter, buffer or
    submodule): guarded missing, so a lazy ``self.x = ...`` in forward compiles again once."""
    sink, own = getattr(_LOCAL, "sink", None), object.__getattribute__(obj, "__dict__")
    if sink is not None and not name.startswith("__") and name not in MODULE_INTERNALS and \
            name not in own and (id(obj), name) not in _LOCAL.written and not any(
            name in own.get(slots, ()) for slots in ("_parameters", "_buffers", "_modules")):
        sink.setdefault((id(obj), name), Guard(obj, name, _MISSING, identity=True,
                                               where=f"{type(obj).__name__}.{name}"))


@contextlib.contextmanager
def recorded_reads(model: nn.Module, model_name: str = "",
                   as_input: Callable[[NumberInput], Any] | None = None,
                   writes: dict[tuple[int, str], tuple[Any, str, Any]] | None = None,
                   layers: Sequence[nn.Module] | None = None) -> Iterator[list[Guard]]:
    """While the block traces ``model``: record the plain attributes read from its modules.

    The list yielded is filled when the block ends, first read first. Each module's class
    is a recording subclass for the duration (same name and module), then its own again.
    An attribute forward assigns before reading it (``self.seq_len = x.size(1)``) is set
    afresh by every call: its later reads are not guarded. (The capture undoes every
    assignment itself, ``python_state.python_state_kept``, and replays it per step.)
    ``as_input``: makes what forward reads instead of a number ``numbers_as_inputs`` names
    (the tracer's proxy of ``read_number(holder)``); each such read is guarded by type.
    ``writes``: filled with the attributes forward assigned, ``(module, name, last value)``
    (torch.export puts them back itself before the capture's snapshot can see them).
    ``layers``: record the reads of these modules only, and not the code they run
    (``layer_settings.py``).
    """
    modules = list(model.modules()) if layers is None else list(layers)
    classes = [type(m) for m in modules]
    sink: dict[tuple[int, str], Guard] = {}
    outer = (getattr(_LOCAL, "sink", None), getattr(_LOCAL, "written", None),
             getattr(_LOCAL, "as_input", None), getattr(_LOCAL, "paths", None))
    guards: list[Guard] = []
    for m, cls in zip(modules, classes):
        m.__class__ = _recording(cls)
    written: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    paths: dict[tuple[int, str], set[tuple[Any, ...]]] = {}
    _LOCAL.sink, _LOCAL.written, _LOCAL.as_input, _LOCAL.paths = sink, written, as_input, paths
    try:
        yield guards
    finally:
        _LOCAL.sink, _LOCAL.written, _LOCAL.as_input, _LOCAL.paths = outer
        if writes is not None:
            writes.update(written)
        for m, cls in zip(modules, classes):
            m.__class__ = cls
        fingerprinted: set[int] = set()  # a config read by every layer: fingerprinted once
        for key, guard in sink.items():
            if key in paths:
                guard = replace(guard, reads=frozenset(paths[key]))
            if guard.contents is not None and id(guard.value) in fingerprinted:
                guard = replace(guard, contents=None, reached=frozenset(), identity=True)
            elif guard.contents is not None:
                fingerprinted.add(id(guard.value))
            guards.append(guard)
        # the code forward runs: each forward and the methods it calls on self, wherever
        # Python looks them up (replaced later, they compile again); the globals it reads:
        # ``slot_guards``
        guards.extend(Guard(owner, n, value, identity=True, where=f"{_named(owner)}.{n}")
                      for owner, n, value in (method_lookups(model, _MISSING)
                                              if layers is None else ()))


def _named(owner: Any) -> str:
    """A class by its name, a module instance by its class's."""
    return owner.__name__ if isinstance(owner, type) else type(owner).__name__


def unwritten(guards: Sequence[Guard], written: frozenset[int],
              keys_set: Mapping[int, set[Any]] | None = None) -> tuple[Guard, ...]:
    """``guards`` with the containers and objects forward read fingerprinted as the user
    holds them (called after the capture put back its state), without those forward
    itself writes (``written``: their ids): their new contents come from forward, replayed
    each step (``side_effects.py``), a key it reads there is guarded where it is written
    (``written_guard``), and the others beside it (``side_effects._unwritten_keys``). One
    that holds such a container keeps its guard, with that container by identity. A key
    forward sets (``keys_set``: by the dict's id) where it was missing, in a dict forward
    also looks keys up in (``.setdefault``, ``.get``), is guarded missing: the write may
    depend on the absence (``setdefault`` keeps the first value; compiled again once set)."""
    done = []
    for guard in guards:
        done.extend(Guard(o, k, now, item, (guard.where or f"self.{guard.name}") + path,
                          identity=isinstance(now, torch.Tensor)) for o, k, item, path, now
                    in read_where_written(guard.value, guard.reads, written, keys_set or {}))
        read = appended_read(guard.value, guard.reads, written) if guard.reads else None
        if read is not None:
            name = (guard.where or f"self.{guard.name}") + shown(read)
            raise CaptureError(
                f"forward reads {name}, a list it also appends to, other than to append "
                "(its length, an index, a loop over it; or through what mbcompile cannot "
                "follow: a key held in a variable, a function given what holds it); the "
                "trace fixed what it read there, which eager reads afresh on every call. "
                "Fix: keep a count in a number attribute (self.seen += 1 is guarded), or "
                "read the list outside forward; nothing was changed")
        if guard.contents is _PENDING:
            image, reached = fingerprint(guard.value)
            if id(guard.value) in written:
                done.extend(_set_where_missing(guard, (keys_set or {}).get(id(guard.value))))
                continue
            if reached & written:  # what it holds beside them is guarded: by id only
                opaque = reached & written
                image, reached = fingerprint(guard.value, opaque)
                guard = replace(guard, opaque=opaque)
            guard = replace(guard, contents=image, reached=reached)
        done.append(guard)
    return tuple(done)


def _set_where_missing(guard: Guard, keys: set[Any] | None) -> list[Guard]:
    """``keys`` forward sets in ``guard``'s dict that are missing there, guarded missing where
    forward also looks keys up in it (``unwritten``)."""
    if not keys or type(guard.value) is not dict or not any(
            path and (isinstance(path[0], Get) or path[0] in _LOOKED_UP) for path in guard.reads):
        return []
    where = guard.where or f"self.{guard.name}"
    return [written_guard(guard.value, key, _MISSING, True, f"{where}[{key!r}]")
            for key in keys if key not in guard.value]


_LOOKED_UP = (Call("setdefault"), Call("get"))
_PENDING = object()  # a fingerprint to take once the capture is over
