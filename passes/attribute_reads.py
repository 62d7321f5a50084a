"""The attributes forward reads of a plain object a module holds (a transformers config, a
dataclass of settings), recorded while the capture traces and guarded one by one.

A plain object is guarded whole by default (``guard_values.fingerprint``): any change in
it compiles again. A transformers config holds far more than forward reads, and training
changes some of it: the HF Trainer's checkpoint (``save_pretrained``) sets
``config.architectures`` and ``config.dtype``, which no forward reads. So while the
capture traces, the class of each plain object read from a module's attribute has a
``__getattribute__`` (``watch``) that notes every name asked of that object, found or not
(``getattr`` with a default, ``hasattr``), through a property or method of its class too
(their code reads ``self`` through it). After the capture, each name is asked again
(``settled``): the guard holds while every name gives what it gave then.

Before (``config`` guarded whole)::

    config.architectures = ["GPT2LMHeadModel"]    # compiled again
After (its reads: ``.vocab_size``, ``._attn_implementation``, ``.output_attentions``, ...)::

    config.architectures = ["GPT2LMHeadModel"]    # nothing read changed: no compile
    config.output_attentions = True               # compiled again, as before

A read that takes the whole object makes the guard whole again, as before: its
``__dict__`` (``vars(config)``, ``config.to_dict()``, ``==``, a copy, a pickle), and a
method or property of its class whose code reads past ``__getattribute__``
(``object.__getattribute__(self, k)``, ``super().__getattribute__(k)``). A class's own
``__getattribute__`` (transformers maps ``hidden_size`` to ``n_embd`` there) is asked
again as a whole, so whatever it reads is compared through its answer. mbcompile's own
walks of the object (the state snapshot, the code walk) are not forward's reads.

Checking every read on every call would cost more than the whole fingerprint, so the
guard compares the fingerprint first (``state``), as before, and asks the reads only when
it differs; when they still give the same, the new fingerprint becomes ``state``
(``version`` counts it, so that the one-function check of ``guard_code`` is written again).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

from .guard_values import ATOMS, fingerprint, plain_object
from .sources import own_code

__all__ = ["AttributeReads", "Record", "paused", "settled", "state_version", "watch",
           "watched"]

_STATE = threading.local()  # .records: {id(obj): Record} of the capture in progress, or None
#: a class whose ``__getattribute__`` records (``_hook``) -> [what its own namespace held
#: there before (``_MISSING``: nothing, it inherited one), how many captures watch with it]
_HOOKED: dict[type, list[Any]] = {}
_HOOKING = threading.Lock()  # captures on two threads hook and put back one class
_MISSING = object()
#: asked of an object, these give its whole state to code that reads it past
#: ``__getattribute__`` (a dict, ``object.__getstate__``, ``copyreg``)
_WHOLE = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__", "__copy__",
                    "__deepcopy__", "__getnewargs__", "__getnewargs_ex__"})


class Record:
    """What forward asked of one watched object while the capture traced: ``names`` in the
    order first asked; ``whole``: why it reads the object whole (empty: it does not);
    ``children``: the plain objects it read that are watched too, by the key that holds
    them in its ``__dict__``; ``peers``: the records of the capture, by the object's id."""

    __slots__ = ("children", "names", "obj", "peers", "whole")

    def __init__(self, obj: Any, peers: dict[int, Record]) -> None:
        self.obj, self.peers = obj, peers
        self.names: dict[str, None] = {}
        self.whole = ""
        self.children: dict[str, Any] = {}

    def asked(self, name: str, value: Any, caller: types.FrameType) -> None:
        if name == "__class__":  # isinstance, type checks: the class, never the state
            return
        if name[:2] == "__" == name[-2:]:
            if not self.whole and not own_code(caller.f_code.co_filename) and (
                    name in _WHOLE or name in object.__getattribute__(self.obj, "__dict__")):
                self.whole = f"forward reads its {name}"
            return
        if name not in self.names:
            self.names[name] = None
            code = _bypassing_code(type(self.obj), name)
            if code and not self.whole:
                self.whole = f"{code} reads past __getattribute__"
        if self.whole or value is self.obj or value is _MISSING or not plain_object(value):
            return
        own = object.__getattribute__(self.obj, "__dict__")
        key = name if own.get(name) is value else next(
            (k for k, v in own.items() if v is value), None)
        if key is not None and watch(value) is not None:
            self.children.setdefault(key, value)


def watch(obj: Any) -> Record | None:
    """Record what is asked of ``obj`` for the rest of the capture in progress (its class's
    ``__getattribute__`` a recording one until it ends); None outside a capture, or where
    its class takes no attribute (a built-in type's object: it is then guarded whole)."""
    records = getattr(_STATE, "records", None)
    if records is None:
        return None
    record = records.get(id(obj))
    if record is not None:
        return record
    cls = type(obj)
    if cls not in _STATE.hooked:  # this capture's first object of its class
        with _HOOKING:
            try:
                if cls not in _HOOKED:  # else an outer capture's, or another thread's
                    _hook(cls)
            except (TypeError, AttributeError):  # an immutable type: guarded whole
                return None
            _HOOKED[cls][1] += 1
        _STATE.hooked.append(cls)
    record = records[id(obj)] = Record(obj, records)
    return record


def _hook(cls: type) -> None:
    """Give ``cls`` a ``__getattribute__`` that tells the record of the object (if any) each
    name asked of it, then asks what it asked before. On the class itself, not a subclass:
    ``type(config) is GPT2Config`` stays true, and no ``__init_subclass__`` runs (transformers
    makes every config class a dataclass there)."""
    inner = cls.__getattribute__  # its own, or inherited: transformers' maps names

    def __getattribute__(self: Any, name: str) -> Any:
        records = getattr(_STATE, "records", None)
        record = records.get(id(self)) if records else None
        if record is None:
            return inner(self, name)
        try:
            value = inner(self, name)
        except AttributeError:  # ``hasattr``, ``getattr(config, name, None)``: read missing
            record.asked(name, _MISSING, sys._getframe(1))
            if not record.whole and _bypassing_code(cls, "__getattr__"):
                record.whole = "its __getattr__ reads past __getattribute__"
            raise
        record.asked(name, value, sys._getframe(1))
        return value

    own = vars(cls).get("__getattribute__", _MISSING)
    type.__setattr__(cls, "__getattribute__", __getattribute__)
    _HOOKED[cls] = [own, 0]


def _unhook(cls: type) -> None:
    """One capture less watches with ``cls``'s hook: the last puts its own back."""
    with _HOOKING:
        _HOOKED[cls][1] -= 1
        if _HOOKED[cls][1]:
            return
        own = _HOOKED.pop(cls)[0]
        if own is _MISSING:
            type.__delattr__(cls, "__getattribute__")
        else:
            type.__setattr__(cls, "__getattribute__", own)


def _bypassing_code(cls: type, name: str) -> str:
    """The name of the function ``cls.<name>`` runs (a method, a property's getter) where
    its code reads attributes past ``__getattribute__`` (``super().__getattribute__``,
    ``object.__getattribute__``): what it reads there is not seen. Empty otherwise."""
    for c in cls.__mro__:
        if name in vars(c):
            attr = vars(c)[name]
            break
    else:
        return ""
    fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", None) or \
        getattr(attr, "func", None) or attr  # a classmethod, a cached_property
    code = getattr(fn, "__code__", None)
    return getattr(fn, "__qualname__", name) if code is not None and _names(code) else ""


def _names(code: types.CodeType) -> bool:
    found = _BYPASSING.get(code)
    if found is None:
        found = _BYPASSING[code] = "__getattribute__" in code.co_names or any(
            _names(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return found


_BYPASSING: dict[types.CodeType, bool] = {}


@contextlib.contextmanager
def watched() -> Iterator[dict[int, Record]]:
    """The block is a capture: ``watch`` records what is asked of the objects it is given;
    the classes it hooked for them are as they were when the block ends. Yields the
    records, by the object's id."""
    outer = getattr(_STATE, "records", None), getattr(_STATE, "hooked", None)
    records: dict[int, Record] = {}
    _STATE.records, _STATE.hooked = records, []
    try:
        yield records
    finally:
        hooked = _STATE.hooked
        _STATE.records, _STATE.hooked = outer
        for cls in reversed(hooked):
            _unhook(cls)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Reads in the block are the capture's own, not forward's (``guards.unrecorded``)."""
    outer = getattr(_STATE, "records", None)
    _STATE.records = None
    try:
        yield
    finally:
        _STATE.records = outer


class AttributeReads:
    """The names forward read of ``obj`` and what each gave (``_image``), and ``state``: the
    fingerprint of the last contents of ``obj`` found to give the same."""

    __slots__ = ("obj", "reads", "state", "version")

    def __init__(self, obj: Any, reads: tuple[tuple[str, Any], ...], state: Any) -> None:
        self.obj, self.reads, self.state, self.version = obj, reads, state, 0

    def holds(self, now: Any) -> bool:
        image = fingerprint(now)[0]
        if image == self.state:
            return True
        if now is not self.obj or self.changed(now):
            return False
        self.state, self.version = image, self.version + 1
        return True

    def changed(self, now: Any) -> list[str]:
        """What differs among the reads of ``now``, as ``.name = value`` or ``.name
        deleted``; empty when every read gives what it gave at the capture."""
        parts = []
        for name, image in self.reads:
            value = _asked(now, name)
            if _same(image, value, now):
                continue
            if value is _MISSING or value is _FAILED:
                parts.append(f".{name} {'deleted' if value is _MISSING else 'raises'}")
                continue
            text = repr(value)
            parts.append(f".{name} = {text if len(text) <= 80 else 'another value'}")
        return parts


def settled(record: Any, state: Any) -> AttributeReads | None:
    """The reads of ``record``'s object as they give now (the capture over, its object as
    the user holds it again), with ``state`` its fingerprint; None where it is read whole,
    or a read fails other than as missing (it is then guarded whole)."""
    if not isinstance(record, Record) or record.whole:
        return None
    obj, kept = record.obj, {id(r.obj) for r in record.peers.values()}
    reads = []
    for name in record.names:
        value = _asked(obj, name)
        if value is _FAILED:
            return None
        if value is _MISSING:
            image: Any = ("missing",)
        elif isinstance(value, types.MethodType) and value.__self__ is obj:
            image = ("method", value.__func__)
        elif isinstance(value, ATOMS):
            image = ("atom", type(value), value)
        elif id(value) in kept:  # a watched object: guarded on its own reads
            image = ("is", value)
        else:
            image = ("fingerprint", fingerprint(value)[0], value)
        reads.append((name, image))
    return AttributeReads(obj, tuple(reads), state)


_FAILED = object()


def _asked(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        return _MISSING
    except Exception:  # noqa: BLE001 - a read that raises now: never what it gave
        return _FAILED


def _same(image: tuple[Any, ...], value: Any, obj: Any) -> bool:
    kind = image[0]
    if kind == "atom":
        return type(value) is image[1] and (value is image[2] or value == image[2])
    if kind == "method":
        return isinstance(value, types.MethodType) and value.__func__ is image[1] and \
            value.__self__ is obj
    if kind == "is":
        return value is image[1]
    if kind == "missing" or value is _MISSING or value is _FAILED:
        return value is _MISSING and kind == "missing"
    # an equal container, or an opaque object (imaged by id) the same one: image[2] is
    # kept alive here, so no other object has its id
    return fingerprint(value)[0] == image[1]


def state_version(guards: Sequence[Any]) -> int:
    """How many times the guards' ``AttributeReads`` took a new state: the one-function
    check written before that compares an old one (``mbcompile/guard_cache.py``)."""
    return sum(g.attributes.version for g in guards
               if isinstance(getattr(g, "attributes", None), AttributeReads))
