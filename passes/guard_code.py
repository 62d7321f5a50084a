"""The guards of one compiled graph as one Python function: the per-call check made cheap.

``failed_guard`` asks each ``Guard`` in turn (``Guard.holds``: a method call, and a
container's whole ``fingerprint`` rebuilt as tuples), about 2.4 µs a guard. Like
dynamo's guard code, ``fast_check(guards)`` writes them once as one expression, each
plain value a dict lookup and a type test, each container or config object a walk of
closures made from its recorded image that builds nothing::

    lambda: (type(_v := M0.__dict__.get(N0, MISSING)) is T0 and _v == V0) and C1() and ...

It answers only "every guard holds for sure". When it says no, the caller asks
``failed_guard``, whose answer (and the guard it names) is the one that counts, so the
fast check can be stricter than the guards (a dict's exact type) but never looser.

>>> import types
>>> m = types.SimpleNamespace(beta=1.0)
>>> check = fast_check([Guard(m, "beta", 1.0)])
>>> check(), setattr(m, "beta", 0.5), check()
(True, None, False)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .guard_values import ATOMS
from .guards import MISSING, Guard

__all__ = ["fast_check"]

_Walk = Callable[[Any, "set[int] | None"], bool]  # (value, the containers seen: None if flat)


def fast_check(guards: Sequence[Guard]) -> Callable[[], bool]:
    """One function: True when every guard in ``guards`` holds (False: ask
    ``failed_guard``, which may still find that they all hold)."""
    env: dict[str, Any] = {"MISSING": MISSING}
    terms = []
    for i, guard in enumerate(guards):
        source = f"M{i}" if guard.item else f"M{i}.__dict__"
        env[f"M{i}"], env[f"N{i}"] = guard.module, guard.name
        now = f"{source}.get(N{i}, MISSING)"
        walk = None if guard.contents is None else _walker(guard.contents)
        if walk is not None and not walk(guard.value, set()):
            walk = None  # its type is stricter than the image (an OrderedDict): never walked
        if guard.feeds is not None or (guard.contents is not None and walk is None
                                       and not guard.identity):
            env[f"G{i}"] = guard  # fed a number, or a container with no fast walk: as is
            terms.append(f"G{i}.holds()")
        elif guard.identity:
            env[f"V{i}"] = guard.value
            terms.append(f"{now} is V{i}")
        elif guard.entries is not None:  # an installed package's registry: the same one,
            env[f"V{i}"], env[f"E{i}"] = guard.value, guard.entries  # the same entries
            terms.append(f"((_v := {now}) is V{i} and {_entries_code(guard.value)} == E{i})")
        elif walk is not None:  # a flat one needs no record of the containers seen
            env[f"W{i}"] = walk
            terms.append(f"W{i}({now}, {'None' if _flat(guard.contents) else 'set()'})")
        else:
            env[f"T{i}"], env[f"V{i}"] = type(guard.value), guard.value
            terms.append(f"(type(_v := {now}) is T{i} and _v == V{i})")
    return eval(f"lambda: {' and '.join(terms) or 'True'}", env)  # noqa: S307 (our own text)


def _entries_code(value: Any) -> str:
    """``guard_values.entries_of(_v)`` inlined for ``value``'s type (a call costs more)."""
    if isinstance(value, dict):
        return "tuple(_v.items())"
    return "frozenset(_v)" if isinstance(value, (set, frozenset)) else "tuple(_v)"


def _walker(image: Any) -> _Walk | None:
    """A function telling whether a value's ``fingerprint`` is ``image`` for sure, or None
    where the image holds an identity (``("id", n)``: an opaque object, a repeat, or a
    limit of ``guard_values._image`` reached) or a set: those are left to ``holds``.

    An image without identities comes from a tree of plain values under every limit, with
    no container twice; a value that walks the same tree (exact types, no repeat, tracked
    in ``seen``) has the same image."""
    if isinstance(image, ATOMS):  # an atom: its own image
        kind = type(image)
        return lambda v, seen: type(v) is kind and v == image
    if not isinstance(image, tuple):  # a set's image (a frozenset)
        return None
    if len(image) == 2 and image[0] == "id" and isinstance(image[1], int):
        return None
    if len(image) == 2 and isinstance(image[0], type):  # a plain object: (type, its dict)
        cls, inner = image[0], _walker(image[1])
        if inner is None:
            return None

        def walk_object(v: Any, seen: set[int] | None) -> bool:
            if type(v) is not cls or seen is not None and id(v) in seen:
                return False
            if seen is not None:
                seen.add(id(v))
            return inner(object.__getattribute__(v, "__dict__"), seen)
        return walk_object
    if len(image) == 2 and image[0] in ("list", "tuple") and isinstance(image[1], tuple):
        seq = list if image[0] == "list" else tuple
        items = [_walker(x) for x in image[1]]
        if any(w is None for w in items):
            return None
        return _sequence(seq, items)  # type: ignore[arg-type]
    if all(isinstance(p, tuple) and len(p) == 2 for p in image):  # a dict: its items in order
        if _flat(image):
            return _flat_mapping(image)
        pairs = [(_walker(k), _walker(x)) for k, x in image]
        if any(k is None or x is None for k, x in pairs):
            return None
        return _mapping(pairs)  # type: ignore[arg-type]
    return None


def _flat(image: Any) -> bool:
    """A dict of plain values, or a plain object holding one: no container inside, so no
    container can be met twice."""
    if isinstance(image, tuple) and len(image) == 2 and isinstance(image[0], type):
        image = image[1]
    return isinstance(image, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and all(isinstance(a, ATOMS) for a in p)
        for p in image)


def _sequence(seq: type, items: list[_Walk]) -> _Walk:
    n = len(items)

    def walk_sequence(v: Any, seen: set[int]) -> bool:
        if type(v) is not seq or len(v) != n or id(v) in seen:
            return False
        seen.add(id(v))
        return all(w(x, seen) for w, x in zip(items, v))
    return walk_sequence


def _mapping(pairs: list[tuple[_Walk, _Walk]]) -> _Walk:
    n = len(pairs)

    def walk_mapping(v: Any, seen: set[int]) -> bool:
        if type(v) is not dict or len(v) != n or id(v) in seen:
            return False
        seen.add(id(v))
        return all(wk(k, seen) and wv(x, seen) for (wk, wv), (k, x) in zip(pairs, v.items()))
    return walk_mapping


def _flat_mapping(image: tuple[tuple[Any, Any], ...]) -> _Walk:
    """A dict of plain keys and values (a dict of flags, an object's attributes): three
    comparisons of lists made in C, types first (a tensor's ``==`` is no answer)."""
    items = list(image)
    key_types, value_types = [type(k) for k, _ in image], [type(x) for _, x in image]

    def walk_flat(v: Any, seen: set[int] | None) -> bool:
        if type(v) is not dict or seen is not None and id(v) in seen:
            return False
        if seen is not None:
            seen.add(id(v))
        return (list(map(type, v)) == key_types and list(map(type, v.values())) == value_types
                and list(v.items()) == items)
    return walk_flat
