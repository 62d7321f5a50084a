"""The guards of one compiled graph as one Python function: the per-call check made cheap.

``failed_guard`` asks each ``Guard`` in turn (``Guard.holds``: a method call, and a
container's whole ``fingerprint`` rebuilt as tuples), about 2.4 µs a guard. Like
dynamo's guard code, ``fast_check(guards)`` writes them once as one function. Its tests
fetch each object's ``__dict__`` once, compare identities and walk down to the containers
a config object holds; every plain value (an attribute, a key of a config's dict, a
list's length) then lands in one tuple, built in C by ``itemgetter``, compared with the
recorded one by type and by value, two comparisons for all of them::

    def check():
        try:
            return (type(_d0 := M0.__dict__) is dict and _d0[N1] is V1        # a tensor
                    and type(_c0 := _d0[N2]) is Config and ...                # a config
                    and tuple(map(type, _a := (*I0(_d0), *_c1, *I3(_c1)))) == TYPES
                    and _a == VALUES)
        except Exception:  # a key gone, an index out of range: not "holds for sure"
            return False

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
import types
from collections.abc import Callable, Sequence
from typing import Any

from .guard_values import ATOMS
from .guards import MISSING, Guard

__all__ = ["fast_check"]

#: the kinds of ``__dict__`` and global namespace read by subscript: no ``__missing__``
_SPACES = (dict, types.MappingProxyType)


def fast_check(guards: Sequence[Guard]) -> Callable[[], bool]:
    """One function: True when every guard in ``guards`` holds (False: ask
    ``failed_guard``, which may still find that they all hold)."""
    code = _Code()
    held: tuple[int, bool] | None = None  # (id, item) of the object whose space is _d now
    for guard in sorted(guards, key=lambda g: (id(g.module), g.item)):  # by object
        if (id(guard.module), guard.item) != held:
            held = (id(guard.module), guard.item) if code.space(guard) else None
        if held is None or not code.guard(guard):
            code.tests.append(f"{code.const(guard)}.holds()")  # fed a number, or as is
    return code.function()


def _walker(image: Any) -> Callable[[Any, None], bool] | None:
    """A function telling whether a value's ``fingerprint`` is ``image`` for sure, or None
    where the image holds an identity (``("id", n)``: an opaque object, a repeat, or a
    limit of ``guard_values._image`` reached), a set, or a key that is not a plain value:
    those are left to ``holds``.

    An image without identities comes from a tree of plain values under every limit, with
    no container twice; a value that walks the same tree (exact types, no container met
    twice) has the same image.

    >>> from mbcompile.passes.guard_values import fingerprint
    >>> walk = _walker(fingerprint({"beta": 0.5, "sizes": [2, 3]})[0])
    >>> walk({"beta": 0.5, "sizes": [2, 3]}, None), walk({"beta": 0.5, "sizes": [2]}, None)
    (True, False)
    """
    if not _walkable(image):
        return None
    code = _Code()
    code.walk(image, "v")
    return code.function()


def _walkable(image: Any) -> bool:
    """``_Code.walk`` can write a test for ``image``."""
    if isinstance(image, ATOMS):
        return True
    if not isinstance(image, tuple) or len(image) == 2 and image[0] == "id" and \
            isinstance(image[1], int):  # a set's image (a frozenset), an identity
        return False
    if len(image) == 2 and isinstance(image[0], type):  # a plain object: (type, its dict)
        return _walkable(image[1])
    if len(image) == 2 and image[0] in ("list", "tuple") and isinstance(image[1], tuple):
        return all(map(_walkable, image[1]))
    return all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], ATOMS)
               and _walkable(p[1]) for p in image)  # a dict: its items, plain keys


class _Code:
    """One check being written: its tests (in order), the plain values it fetches into one
    tuple (``leaves``: expressions, starred ones give several) and their recorded values."""

    def __init__(self) -> None:
        self.env: dict[str, Any] = {"OGA": object.__getattribute__, "MISSING": MISSING}
        self.tests: list[str] = []
        self.leaves: list[str] = []
        self.values: list[Any] = []
        self.plain: list[tuple[Any, Any]] = []  # (key, value) read from self.at, to fetch
        self.spaces = self.containers = 0  # names made: _d0, _d1, ...; _c0, _c1, ...
        self.at = ""  # the expression of the space in _d now, as ``_d0``

    def const(self, value: Any) -> str:
        name = f"K{len(self.env)}"
        self.env[name] = value
        return name

    def function(self) -> Callable[..., bool]:
        self.flush()
        tests = list(self.tests)
        if self.leaves:
            tests.append(f"tuple(map(type, _a := ({', '.join(self.leaves)},))) == "
                         f"{self.const(tuple(map(type, self.values)))} and _a == "
                         f"{self.const(tuple(self.values))}")
        body = " and ".join(tests) or "True"
        exec("def check(v=None, seen=None):\n    try:\n"  # noqa: S102 (our own text)
             f"        return {body}\n    except Exception:\n        return False\n", self.env)
        return self.env.pop("check")

    def space(self, guard: Guard) -> bool:
        """Fetch the dict ``guard``'s object holds its attributes in (its keys, for a
        dict) as ``_dN``: False where it is no plain dict or class namespace."""
        self.flush()
        space = guard.module if guard.item else getattr(guard.module, "__dict__", None)
        if type(space) not in _SPACES:
            return False
        if guard.item:  # the same dict object for good: no test
            self.at = self.const(space)
        else:  # ``obj.__dict__ = {...}`` gives it another
            self.at = f"_d{self.spaces}"
            self.spaces += 1
            self.tests.append(f"type({self.at} := {self.const(guard.module)}.__dict__) is "
                              f"{self.const(type(space))}")
        return True

    def flush(self) -> None:
        """The plain values read from the space ``self.at``, fetched in one call."""
        if len(self.plain) > 1:
            get = self.const(operator.itemgetter(*(k for k, _ in self.plain)))
            self.leaves.append(f"*{get}({self.at})")
        elif self.plain:
            self.leaves.append(f"{self.at}[{self.const(self.plain[0][0])}]")
        self.values.extend(v for _, v in self.plain)
        self.plain = []

    def guard(self, guard: Guard) -> bool:
        """Write the test of ``guard``, whose space is ``self.at``: False where it is fed a
        number or is a container with no walk (the caller asks ``holds``)."""
        now, key = guard.now(), self.const(guard.name)
        if guard.feeds is not None:
            return False
        if guard.value is MISSING:  # absent, as when read
            self.tests.append(f"{key} not in {self.at}")
        elif guard.identity:
            self.tests.append(f"{self.at}[{key}] is {self.const(guard.value)}")
        elif guard.entries is not None:  # an installed package's registry: the same one,
            self.tests.append(  # the same entries
                f"(_v := {self.at}[{key}]) is {self.const(guard.value)} and "
                f"{_entries_code(guard.value)} == {self.const(guard.entries)}")
        elif guard.contents is not None:
            walk = _walker(guard.contents)
            if walk is None or now is not guard.value or not walk(guard.value, None):
                return False  # its type is stricter than the image (an OrderedDict)
            self.walk(guard.contents, f"{self.at}[{key}]")
        else:
            self.plain.append((guard.name, guard.value))
        return True

    def walk(self, image: Any, x: str) -> None:
        """Tests and leaves true when the value of ``x`` has this (walkable) image for sure:
        the containers' exact types in the tests, their keys and plain values among the
        leaves (a dict's keys in order, a list's length), their ids all distinct."""
        containers: list[str] = []
        self._walk(image, x, containers)
        if len(containers) > 1:  # a container met twice would have an identity image
            ids = ", ".join(f"id({c})" for c in containers)
            self.tests.append(f"len({{{ids}}}) == {len(containers)}")

    def _walk(self, image: Any, x: str, containers: list[str]) -> None:
        if isinstance(image, ATOMS):
            self.leaves.append(x)
            self.values.append(image)
            return
        c = f"_c{self.containers}"
        self.containers += 1
        containers.append(c)
        if len(image) == 2 and isinstance(image[0], type):  # a plain object
            self.tests.append(f"type({c} := {x}) is {self.const(image[0])}")
            self._walk(image[1], f"OGA({c}, '__dict__')", containers)
            return
        if len(image) == 2 and image[0] in ("list", "tuple") and isinstance(image[1], tuple):
            kind = list if image[0] == "list" else tuple
            self.tests.append(f"type({c} := {x}) is {self.const(kind)}")
            self.leaves.append(f"len({c})")
            self.values.append(len(image[1]))
            pairs = list(enumerate(image[1]))
        else:  # a dict: its keys in order, then its values
            self.tests.append(f"type({c} := {x}) is dict")
            self.leaves.append(f"*{c}")
            self.values.extend(k for k, _ in image)
            pairs = list(image)
        atoms = [(k, v) for k, v in pairs if isinstance(v, ATOMS)]
        if len(atoms) > 1:  # fetched in one call
            self.leaves.append(f"*{self.const(operator.itemgetter(*(k for k, _ in atoms)))}({c})")
            self.values.extend(v for _, v in atoms)
        for k, v in pairs:
            if len(atoms) != 1 and isinstance(v, ATOMS):
                continue
            self._walk(v, f"{c}[{self.const(k)}]", containers)


def _entries_code(value: Any) -> str:
    """``guard_values.entries_of(_v)`` inlined for ``value``'s type (a call costs more)."""
    if isinstance(value, dict):
        return "tuple(_v.items())"
    return "frozenset(_v)" if isinstance(value, (set, frozenset)) else "tuple(_v)"
