"""What a guard compares for values that are not plain numbers: containers, objects, globals.

A forward reads more than numbers: a dict of flags (``if self.flags["hard"]``), a config
object (``self.cfg.beta``), an enum (``self.mode is Mode.TRAIN``), a module-level
constant (``SCALE * loss``), a helper method it calls (``self.head_fn(x)``). Each is
baked into the graph by the trace, so each is guarded: a container or plain object by
its ``fingerprint`` (plain values by value, anything else by identity, recursively), a
global by value, a method by the absence of an instance attribute that would shadow it.

>>> fingerprint({"hard": False, "sizes": (2, 3)})[0]
(('hard', False), ('sizes', ('tuple', (2, 3))))
"""

from __future__ import annotations

import enum
import inspect
import sys
import types
from typing import Any

import torch
import torch.nn as nn

from .whose_code import user_code

__all__ = ["ATOMS", "NUMPY_NUMBERS", "Unguardable", "entries_of", "fingerprint", "parts_changed",
           "method_lookups", "plain_object", "slotted_object", "user_defined"]

try:  # numpy's scalars (``np.float32(0.5)``, ``np.cos`` of a schedule) are numbers too
    import numpy as _numpy

    NUMPY_NUMBERS: tuple[type, ...] = (_numpy.bool_, _numpy.number)
except ImportError:  # torch runs without numpy
    NUMPY_NUMBERS = ()

#: compared by value: numbers (numpy's too), strings, flags, None, enum members
ATOMS = (bool, int, float, str, type(None), enum.Enum, *NUMPY_NUMBERS)
_DEPTH, _ITEMS = 6, 2_000  # deeper or larger: compared by identity only


def fingerprint(value: Any, opaque: frozenset[int] = frozenset()) -> tuple[Any, frozenset[int]]:
    """A comparable image of ``value`` (plain values by value, other objects by ``id``)
    and the ``id`` of every container and object it went through; those in ``opaque`` (a
    list forward appends to) by ``id`` only, as a repeat is."""
    reached: set[int] = set(opaque)
    budget = [_ITEMS]
    return _image(value, reached, _DEPTH, budget), frozenset(reached)


def _image(value: Any, reached: set[int], depth: int, budget: list[int]) -> Any:
    kind = _KINDS.get(type(value)) or _kind(type(value))  # by type: no __class__ lookups
    if kind == "atom":  # the common case first: this runs on every call
        return value
    budget[0] -= 1
    if kind == "id" or depth == 0 or budget[0] <= 0 or id(value) in reached:
        return ("id", id(value))  # a tensor, a module, a function: by identity
    reached.add(id(value))
    if kind == "dict":
        return tuple((_image(k, reached, depth - 1, budget), _image(v, reached, depth - 1, budget))
                     for k, v in value.items())
    if kind == "seq":
        return (type(value).__name__,
                tuple(_image(v, reached, depth - 1, budget) for v in value))
    if kind == "set":
        return frozenset(_image(v, reached, depth - 1, budget) for v in value)
    if kind == "slots":  # (a dataclass(slots=True), an attrs class): each slot's value
        return (type(value), tuple((n, _image(_slot(value, n), reached, depth - 1, budget))
                                   for n in _SLOTS[type(value)]))
    image = _image(object.__getattribute__(value, "__dict__"), reached, depth, budget)
    extra = _SLOTS.get(type(value))  # slots beside its __dict__ (pydantic's private fields)
    if extra and isinstance(image, tuple) and image[:1] != ("id",):
        image += tuple((n, _image(_slot(value, n), reached, depth - 1, budget)) for n in extra)
    return (type(value), image)


def _slot(value: Any, name: str) -> Any:
    try:
        return object.__getattribute__(value, name)
    except AttributeError:
        return _ABSENT  # (a slot never set: the same marker every time)


def parts_changed(image: Any, now: Any, opaque: frozenset[int] = frozenset()) -> str:
    """What changed in an object or dict changed in place, by its fingerprint ``image`` at
    capture (``opaque``: the containers forward appends to, imaged by identity):
    ``.output_hidden_states = True`` for a transformers config, whose whole repr is a
    page; empty where the image does not say. Never raises: it words a warning."""
    try:
        before, after = _pairs(image), _pairs(fingerprint(now, opaque)[0])
        if before is None or after is None:
            return ""
        in_dict = isinstance(now, dict)
        keys = {fingerprint(k)[0]: k for k in now} if in_dict else {}
        parts = []
        for k in {**before, **after}:
            if before.get(k, _ABSENT) == after.get(k, _ABSENT):
                continue
            key = keys.get(k, k)
            where = f"[{key!r}]" if in_dict else f".{key}"
            if k not in after:
                parts.append(f"{where} deleted")
                continue
            text = repr(now[key] if in_dict else vars(now)[key])
            parts.append(f"{where} = {text if len(text) <= 80 else 'another value'}")
        return ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
    except Exception:  # noqa: BLE001 - a warning's words: the whole repr instead
        return ""


def _pairs(image: Any) -> dict[Any, Any] | None:
    """An object's or a dict's fingerprint as {key's image: value's image}; None for other
    images."""
    if isinstance(image, tuple) and len(image) == 2 and isinstance(image[0], type):
        image = image[1]  # an object: the image of its __dict__
    if isinstance(image, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in image):
        return dict(image)
    return None


_ABSENT = object()  # a key one image has and the other not


_KINDS: dict[type, str] = {}


def entries_of(value: Any) -> Any:
    """A container's entries, compared with ``==`` on every call (an installed package's
    registry: ``ACT2FN``, an attention interface's mapping, transformers'
    ``_CAN_RECORD_REGISTRY``): functions, classes, modules and tensors by identity, plain
    values by value, and what an entry holds to ``_ENTRY_DEPTH`` levels as it is now: a
    dict, list or tuple inside copied (so that one changed in place compares unequal), a
    plain object as its attributes (``_Held``). The guard compares the live container's
    items with this in C (``tuple(_v.items()) == E``), so a registry of functions costs
    what it did one level deep. Raises ``Unguardable`` for what cannot be compared so: an
    entry deeper than ``_ENTRY_DEPTH``, more than ``_ENTRY_ITEMS`` values inside entries,
    an object whose own ``==`` would answer for a copy (a custom ``__eq__``).

    >>> entries_of({"tanh": abs}) == entries_of({"tanh": abs})
    True
    >>> entries_of([1, 2]) == entries_of([1, 3])
    False
    >>> inner = {"max": 10}
    >>> image = entries_of({"gelu_10": (abs, inner)})
    >>> inner["max"] = 5
    >>> tuple({"gelu_10": (abs, inner)}.items()) == image
    False
    """
    budget = [_ENTRY_ITEMS]
    if isinstance(value, dict):
        return tuple((k, _entry(v, _ENTRY_DEPTH, (), budget)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        for v in value:
            _entry(v, _ENTRY_DEPTH, (), budget)  # hashable: refused if it holds state
        return frozenset(value)
    return tuple(_entry(v, _ENTRY_DEPTH, (), budget) for v in value)


class Unguardable(Exception):
    """What an installed package's container holds cannot be guarded (``entries_of``)."""


_ENTRY_DEPTH, _ENTRY_ITEMS = 6, 2_000


def _entry(value: Any, depth: int, path: tuple[int, ...], budget: list[int]) -> Any:
    """``value`` as the guard compares it: itself (an atom, an opaque object), or a copy of
    the containers and plain objects it holds (``path``: the ids above it, for cycles)."""
    kind = _KINDS.get(type(value)) or _kind(type(value))
    if kind in ("atom", "id"):
        return value
    if id(value) in path:
        return _Same(value)  # a cycle: the same object again
    budget[0] -= 1
    if depth == 0 or budget[0] < 0:
        raise Unguardable(f"a {type(value).__name__} nested deeper than {_ENTRY_DEPTH} "
                          f"levels, or more than {_ENTRY_ITEMS} values inside entries")
    path, depth = (*path, id(value)), depth - 1
    if kind == "dict":
        return {k: _entry(v, depth, path, budget) for k, v in value.items()}
    if kind == "seq":
        copied = [_entry(v, depth, path, budget) for v in value]
        return copied if isinstance(value, list) else tuple(copied)
    if kind == "set":
        for v in value:
            _entry(v, depth, path, budget)
        return frozenset(value)
    if type(value).__eq__(value, _PROBE) is not NotImplemented:
        raise Unguardable(f"a {type(value).__name__} with its own ==")
    return _Held(type(value), _entry(vars(value), depth, path, budget))


class _Held:
    """A plain object inside a registry's entry as it was: equal to an object of its type
    whose attributes are equal (``live == held`` asks this, as the object's own ``==``
    answers ``NotImplemented`` for another type)."""

    __slots__ = ("attributes", "kind")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, kind: type, attributes: dict[str, Any]) -> None:
        self.kind, self.attributes = kind, attributes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Held):
            return self.kind is other.kind and self.attributes == other.attributes
        return type(other) is self.kind and other.__dict__ == self.attributes

    def __repr__(self) -> str:
        return f"{self.kind.__name__}({self.attributes!r})"


class _Same:
    """An object met again inside itself: equal to that object only."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (other.value if isinstance(other, _Same) else other) is self.value


_PROBE = _Same(None)  # no object's ``==`` knows it: a plain one answers NotImplemented


def _kind(t: type) -> str:
    """How ``_image`` reads a value of type ``t`` (worked out once per type)."""
    if issubclass(t, ATOMS):
        kind = "atom"
    elif issubclass(t, dict):
        kind = "dict"
    elif issubclass(t, (list, tuple)):
        kind = "seq"
    elif issubclass(t, (set, frozenset)):
        kind = "set"
    elif _plain_type(t):
        kind = "object"
        slots = tuple(dict.fromkeys(n for c in t.__mro__ for n in _names(c)))
        if slots:  # a __dict__ and slots too: both are its state
            _SLOTS[t] = slots
    elif _plain_type(t, slotted=True):  # fingerprinted by its slots (not a plain_object)
        kind = "slots"
        _SLOTS[t] = tuple(dict.fromkeys(n for c in t.__mro__ for n in _names(c)))
    else:
        kind = "id"
    _KINDS[t] = kind
    return kind


_SLOTS: dict[type, tuple[str, ...]] = {}  # a slotted type's slot names, base classes' too


def _names(c: type) -> tuple[str, ...]:
    slots = vars(c).get("__slots__", ())
    return tuple(n for n in ((slots,) if isinstance(slots, str) else slots)
                 if n not in ("__dict__", "__weakref__"))


def _plain_type(t: type, slotted: bool = False) -> bool:
    """A user's class whose instances hold state in ``__dict__`` (``slotted``: in slots
    only, no ``__dict__``)."""
    held = (t.__dictoffset__ == 0 and any(_names(c) for c in t.__mro__)) if slotted \
        else t.__dictoffset__ != 0
    return (held and not issubclass(t, _OPAQUE)
            and not any("__call__" in vars(c) for c in t.__mro__ if c is not object)
            and not t.__module__.startswith("torch"))


_OPAQUE = (nn.Module, torch.Tensor, types.ModuleType, type, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType)


def slotted_object(value: Any) -> bool:
    """A user's object that holds its state in slots only (``dataclass(slots=True)``, an
    attrs class): guarded by its fingerprint, which reads each slot."""
    return (_KINDS.get(type(value)) or _kind(type(value))) == "slots"


def plain_object(value: Any) -> bool:
    """A user's object whose attributes are state (a dataclass, a namespace, a config)."""
    return (_KINDS.get(type(value)) or _kind(type(value))) == "object"


def user_defined(value: Any) -> bool:
    """A function, class or module of the user's (not torch's or Python's own): a global
    that forward calls or reads through, guarded by identity."""
    if isinstance(value, types.FunctionType):
        return user_code(value.__code__.co_filename)
    if isinstance(value, types.ModuleType):
        return user_code(getattr(value, "__file__", None))
    if isinstance(value, type):
        module = sys.modules.get(value.__module__)
        return user_code(getattr(module, "__file__", None))
    return False


def method_lookups(model: nn.Module, missing: Any) -> list[tuple[Any, str, Any]]:
    """``(owner, name, value)`` of every place Python looks up each module's ``forward``
    and the methods and properties its code reaches on ``self`` by name (through the
    methods it calls, too): the instance's ``__dict__``, then each class of the MRO but
    ``nn.Module`` and ``object`` (``missing`` where absent: a ``super()`` call reaches past
    the first definer). Each is guarded by identity: code replaced after compile, on the instance
    (``m.forward = wrapped``) or on a class (``Block.forward = patched``, a library's
    ``GPT2MLP.forward``), changes what eager runs, so it compiles again."""
    found: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    names_of: dict[type, set[str]] = {}
    for module in model.modules():
        cls = type(module)
        if cls not in names_of:
            names_of[cls] = _reached_names(cls)
        mro = [c for c in cls.__mro__ if c not in (nn.Module, object)]
        for name in names_of[cls]:
            found[(id(module), name)] = (module, name, vars(module).get(name, missing))
            for owner in mro:
                found[(id(owner), name)] = (owner, name, vars(owner).get(name, missing))
    return list(found.values())


def _reached_names(cls: type) -> set[str]:
    """``forward`` and the names its code, and the code of each method or property it
    reaches so, reads on the class: the methods that run when forward does."""
    names, todo = {"forward"}, ["forward"]
    while todo:
        found = inspect.getattr_static(cls, todo.pop(), None)
        fn = found.fget if isinstance(found, property) else getattr(found, "__func__", found)
        for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
            held = inspect.getattr_static(cls, name, None)
            if name not in names and not name.startswith("__") and isinstance(
                    held, (types.FunctionType, staticmethod, classmethod, property)):
                names.add(name)
                todo.append(name)
    return names
