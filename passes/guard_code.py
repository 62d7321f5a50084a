"""The guards of one compiled graph as one Python function: the per-call check made cheap.

``failed_guard`` asks each ``Guard`` in turn (``Guard.holds``: a method call, and a
container's whole ``fingerprint`` rebuilt as tuples), about 2.4 µs a guard. Like
dynamo's guard code, ``fast_check(guards)`` writes them once as one expression, each
plain value a dict lookup and a type test, each container or config object an expression
written from its recorded image, which fetches and compares its plain values in C::

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

import operator
from collections.abc import Callable, Sequence
from typing import Any

from .guard_values import ATOMS
from .guards import MISSING, Guard

__all__ = ["fast_check"]

_Walk = Callable[[Any, None], bool]  # (value, None): a generated walk (``_walker``)


def fast_check(guards: Sequence[Guard]) -> Callable[[], bool]:
    """One function: True when every guard in ``guards`` holds (False: ask
    ``failed_guard``, which may still find that they all hold)."""
    env: dict[str, Any] = {"MISSING": MISSING}
    terms, held = [], None  # held: (the object, item) whose dict _d holds, at this term
    for i, guard in sorted(enumerate(guards), key=lambda p: (id(p[1].module), p[1].item)):
        # the guards on one object in a row: its __dict__ fetched once, as _d
        env[f"M{i}"], env[f"N{i}"] = guard.module, guard.name
        space = "_d" if held == (id(guard.module), guard.item) else \
            f"(_d := M{i}{'' if guard.item else '.__dict__'})"
        now = f"{space}.get(N{i}, MISSING)"
        walk = None if guard.contents is None else _walker(guard.contents)
        if walk is not None and not walk(guard.value, None):
            walk = None  # its type is stricter than the image (an OrderedDict): never walked
        if guard.feeds is not None or (guard.contents is not None and walk is None
                                       and not guard.identity):
            env[f"G{i}"] = guard  # fed a number, or a container with no fast walk: as is
            terms.append(f"G{i}.holds()")
            continue  # _d is as it was
        if guard.identity or guard.value is MISSING or guard.value is None or \
                type(guard.value) is bool:  # one object of its type: the same one
            env[f"V{i}"] = guard.value
            terms.append(f"{now} is V{i}")
        elif guard.entries is not None:  # an installed package's registry: the same one,
            env[f"V{i}"], env[f"E{i}"] = guard.value, guard.entries  # the same entries
            terms.append(f"((_v := {now}) is V{i} and {_entries_code(guard.value)} == E{i})")
        elif walk is not None:
            env[f"W{i}"] = walk
            terms.append(f"W{i}({now}, None)")
        else:
            env[f"T{i}"], env[f"V{i}"] = type(guard.value), guard.value
            terms.append(f"(type(_v := {now}) is T{i} and _v == V{i})")
        held = (id(guard.module), guard.item)
    return eval(f"lambda: {' and '.join(terms) or 'True'}", env)  # noqa: S307 (our own text)


def _entries_code(value: Any) -> str:
    """``guard_values.entries_of(_v)`` inlined for ``value``'s type (a call costs more)."""
    if isinstance(value, dict):
        return "tuple(_v.items())"
    return "frozenset(_v)" if isinstance(value, (set, frozenset)) else "tuple(_v)"


def _walker(image: Any) -> _Walk | None:
    """A function telling whether a value's ``fingerprint`` is ``image`` for sure, or None
    where the image holds an identity (``("id", n)``: an opaque object, a repeat, or a
    limit of ``guard_values._image`` reached), a set, or a key that is not a plain value:
    those are left to ``holds``.

    An image without identities comes from a tree of plain values under every limit, with
    no container twice; a value that walks the same tree (exact types, no container met
    twice) has the same image. The walk is one generated expression: each container's
    plain values fetched and compared in C (``itemgetter``, tuples, ``map(type, ...)``),
    its containers walked in turn, their ids all distinct at the end::

        type(_c0 := v) is Config and type(_c1 := OGA(_c0, "__dict__")) is dict
        and list(_c1) == K1 and tuple(map(type, I2(_c1))) == K3 and I2(_c1) == K4
        and ... and len({id(_c0), id(_c1), ...}) == 3

    >>> from mbcompile.passes.guard_values import fingerprint
    >>> walk = _walker(fingerprint({"beta": 0.5, "sizes": [2, 3]})[0])
    >>> walk({"beta": 0.5, "sizes": [2, 3]}, None), walk({"beta": 0.5, "sizes": [2]}, None)
    (True, False)
    """
    code = _Code()
    test = code.match(image, "v")
    if test is None:
        return None
    if len(code.containers) > 1:  # a container met twice would have an identity image
        ids = ", ".join(f"id({c})" for c in code.containers)
        test += f" and len({{{ids}}}) == {len(code.containers)}"
    return eval(f"lambda v, seen: {test}", code.env)  # noqa: S307 (our own text)


class _Code:
    """The text of one walk, the constants it names (``env``) and its containers."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {"OGA": object.__getattribute__}
        self.containers: list[str] = []

    def const(self, value: Any) -> str:
        name = f"K{len(self.env)}"
        self.env[name] = value
        return name

    def container(self) -> str:
        self.containers.append(f"_c{len(self.containers)}")
        return self.containers[-1]

    def match(self, image: Any, x: str) -> str | None:
        """An expression true when the value of ``x`` has this image for sure, or None."""
        if isinstance(image, ATOMS):
            return f"(type(_a := {x}) is {self.const(type(image))} and _a == {self.const(image)})"
        if not isinstance(image, tuple):  # a set's image (a frozenset)
            return None
        if len(image) == 2 and image[0] == "id" and isinstance(image[1], int):
            return None
        if len(image) == 2 and isinstance(image[0], type):  # a plain object: (type, its dict)
            c = self.container()
            inner = self.match(image[1], f"OGA({c}, '__dict__')")
            return None if inner is None else \
                f"type({c} := {x}) is {self.const(image[0])} and {inner}"
        if len(image) == 2 and image[0] in ("list", "tuple") and isinstance(image[1], tuple):
            c = self.container()
            kind = self.const(list if image[0] == "list" else tuple)
            items = self.items(c, list(enumerate(image[1])))
            return None if items is None else \
                f"type({c} := {x}) is {kind} and len({c}) == {len(image[1])}{items}"
        if all(isinstance(p, tuple) and len(p) == 2 for p in image):  # a dict: items in order
            if not all(isinstance(k, ATOMS) for k, _ in image):
                return None
            c = self.container()
            keys = [k for k, _ in image]
            items = self.items(c, list(image))
            return None if items is None else (
                f"type({c} := {x}) is dict and list(map(type, {c})) == "
                f"{self.const([type(k) for k in keys])} and list({c}) == {self.const(keys)}"
                f"{items}")
        return None

    def items(self, c: str, pairs: list[tuple[Any, Any]]) -> str | None:
        """`` and ...`` testing the entries ``c[key]`` (their presence already tested): the
        plain ones in one fetch, types first (a tensor's ``==`` is no answer), the others
        walked one by one."""
        atoms = [(k, x) for k, x in pairs if isinstance(x, ATOMS)]
        text = ""
        if len(atoms) == 1:
            text = f" and {self.match(atoms[0][1], f'{c}[{self.const(atoms[0][0])}]')}"
        elif atoms:
            get = self.const(operator.itemgetter(*(k for k, _ in atoms)))
            text = (f" and tuple(map(type, {get}({c}))) == "
                    f"{self.const(tuple(type(x) for _, x in atoms))} and {get}({c}) == "
                    f"{self.const(tuple(x for _, x in atoms))}")
        for k, x in pairs:
            if not isinstance(x, ATOMS):
                inner = self.match(x, f"{c}[{self.const(k)}]")
                if inner is None:
                    return None
                text += f" and {inner}"
        return text
