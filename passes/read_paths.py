"""How forward's code reads a container or object it loads: the steps it goes through
(constant keys, ``.get`` of a constant key, attributes of a held object, a method of it
called), and whether what it reaches there is only appended to or written.

A list forward appends to is replayed once per step (``side_effects.Extend``); its length
read in the same forward (``len(self.history)``, ``len(self.box.get("seen"))``,
``len(self.cfg.seen)``) would be fixed by the trace, so ``guards.unwritten`` refuses such a
read (``appended_read``). This tells the reads from the appends and writes, from the
bytecode after the load (once per code object); a method called on a held object (or
its ``__call__``) reads what that method's code reads of ``self``. A read it cannot follow
step by step (a key computed as it runs, a method of C code, a call the value is passed
to, a loop) reads everything the value holds: one that holds such a list is refused too,
though only appending to what such a key reaches (``self.box[key].append(x)``) is not.

>>> import dis
>>> ins = list(dis.get_instructions(lambda s: s.box["seen"].append(1)))
>>> load = next(i for i, x in enumerate(ins) if x.argval == "box")
>>> path_after(ins, load + 1) is None
True
>>> ins = list(dis.get_instructions(lambda s: len(s.box.get("seen"))))
>>> load = next(i for i, x in enumerate(ins) if x.argval == "box")
>>> path_after(ins, load + 1)
(Get(key='seen'),)
>>> seen = [1]
>>> shown(appended_read({"seen": seen, "n": 2}, {(Get("seen"),)}, frozenset({id(seen)})))
"['seen']"
"""

from __future__ import annotations

import dis
import inspect
import sys
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .guard_values import ATOMS, plain_object
from .whose_code import user_instance

__all__ = ["Attr", "Call", "Get", "appended_read", "path_after", "read_where_written", "shown"]


@dataclass(frozen=True)
class Attr:
    """``.name``: an attribute of a held object (``self.cfg.seen``)."""

    name: str


@dataclass(frozen=True)
class Get:
    """``.get(key)`` or ``.setdefault(key, default)`` of a dict, ``key`` a constant."""

    key: Any


@dataclass(frozen=True)
class Call:
    """A method ``name`` of it called (``__call__``: the value itself): what that method's
    code reads of its ``self`` is read (``appended_read`` follows it)."""

    name: str


_ANY = object()  # a key computed as the code runs (``self.box[key]``): not followed
_KEYS = object()  # a membership test: of a dict, its keys only
_ONLY_APPEND = frozenset({"append", "extend"})
_LOOKUPS = frozenset({"get", "setdefault"})
_NAME_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF",
                         "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CLOSURE"})
_METHOD_FLAG = sys.version_info >= (3, 12)  # LOAD_ATTR's low bit marks a method's load


def path_after(ins: list[dis.Instruction], n: int) -> tuple[Any, ...] | None:
    """For a load just before ``ins[n]``: the steps the code goes through before using what
    it reached (``()``: the value itself; cut at a key it computes), or None where that is
    only appended to (``.append``, ``.extend``) or written (``x["k"] = v``, ``x["k"] += 1``)."""
    path: list[Any] = []
    while n < len(ins):
        op, method = ins[n], _method(ins[n])
        if method in _ONLY_APPEND:
            return None
        if method in _LOOKUPS:
            after = _lookup(ins, n + 1)
            if after is None:
                path.append(Call(method))
                break
            n, key, constant = after
            path.append(Get(key) if constant else _ANY)
            continue
        if method is not None:
            path.append(Call(method))
            break
        if op.opname == "LOAD_ATTR":
            path.append(Attr(op.argval))
            n += 1
            continue
        if op.opname in ("STORE_ATTR", "DELETE_ATTR"):
            return None  # an attribute written: guarded where written
        if op.opname == "CONTAINS_OP":
            path.append(_KEYS)  # ``"k" in self.box``: a dict's keys, not what it holds
            break
        if op.opname in ("COPY", "DUP_TOP") and (op.arg or 1) == 1 and n + 1 < len(ins) and \
                ins[n + 1].opname == "LOAD_ATTR" and _method(ins[n + 1]) is None:
            path.append(Attr(ins[n + 1].argval))  # ``x.n += 1``: read, then written back
            break
        end, depth, constant = _operands(ins, n)
        following = ins[end] if end < len(ins) else None
        if depth == 1 and following is not None and _subscript(following):
            path.append(op.argval if constant else _ANY)
            n = end + 1
            continue
        if depth == 1 and following is not None and (
                following.opname in ("STORE_SUBSCR", "DELETE_SUBSCR", "DUP_TOP_TWO") or
                (following.opname == "COPY" and following.arg == 2)):
            return None  # a key written (``+=``: read and written back, as a write)
        if _call_end(ins, end, depth) is not None:
            path.append(Call("__call__"))
        break
    cut = next((i for i, step in enumerate(path) if step is _ANY), len(path))
    return tuple(path[:cut])


def _method(ins: dis.Instruction) -> str | None:
    """The name of the method ``ins`` loads to call, or None."""
    if ins.opname == "LOAD_METHOD" or (_METHOD_FLAG and ins.opname == "LOAD_ATTR" and
                                       (ins.arg or 0) & 1):
        return ins.argval
    return None


def _operands(ins: list[dis.Instruction], n: int) -> tuple[int, int, bool]:
    """The values the code pushes from ``ins[n]`` on above the one loaded before it (keys,
    arguments: names, constants, their attributes, subscripts and arithmetic), up to the
    first instruction that takes that one: ``(its index, how many values are above it,
    whether the first is a constant nothing has taken yet)``."""
    depth, first, constant = 0, n, n < len(ins) and ins[n].opname == "LOAD_CONST"
    while n < len(ins) and n - first < _SCAN:
        op = ins[n]
        if op.opname == "LOAD_CONST" or (op.opname in _NAME_LOADS and not (
                op.opname == "LOAD_GLOBAL" and _NULL_FLAG and (op.arg or 0) & 1)):
            pops = 0  # (a global loaded to be called pushes two: not followed)
        elif op.opname == "LOAD_ATTR" and _method(op) is None or op.opname.startswith("UNARY_"):
            pops = 1
        elif op.opname in _TWO or (op.opname.startswith("BINARY_") and op.opname != "BINARY_SLICE"):
            pops = 2
        elif op.opname in ("BUILD_TUPLE", "BUILD_LIST", "BUILD_SLICE"):
            pops = op.arg or 0
        else:
            break
        if pops > depth:
            break  # it takes the value loaded before ``ins[first]``
        if pops and depth - pops < 1:
            constant = False  # the first value was taken into another
        depth += 1 - pops
        n += 1
    return n, depth, constant and depth >= 1


_SCAN = 32  # instructions looked at for keys and arguments
_TWO = frozenset({"COMPARE_OP", "IS_OP", "CONTAINS_OP"})
_NULL_FLAG = sys.version_info >= (3, 11)  # LOAD_GLOBAL's low bit pushes a NULL to call


def _lookup(ins: list[dis.Instruction], n: int) -> tuple[int, Any, bool] | None:
    """After ``.get``/``.setdefault``: its key and optional default, then the call, as
    ``(index after the call, key, constant)``; None for any other form."""
    end, depth, constant = _operands(ins, n)
    after = _call_end(ins, end, depth) if depth in (1, 2) else None
    return None if after is None else (after, ins[n].argval if constant else _ANY, constant)


def _call_end(ins: list[dis.Instruction], n: int, count: int) -> int | None:
    """The index after a call of ``count`` arguments at ``ins[n]``, or None."""
    if n < len(ins) and ins[n].opname == "PRECALL":  # 3.11
        n += 1
    if n < len(ins) and ins[n].opname in ("CALL", "CALL_METHOD", "CALL_FUNCTION") and \
            ins[n].arg == count:
        return n + 1
    return None


def _subscript(ins: dis.Instruction) -> bool:
    return ins.opname == "BINARY_SUBSCR" or (ins.opname == "BINARY_OP" and ins.argrepr == "[]")


_ABSENT, _OPEN = object(), object()  # no such key; a step that cannot be followed exactly
_DEEPER = object()  # what a value holds below the depth searched
_DEPTH, _CALLS = 16, 8  # how deep a value read whole is searched; methods followed in turn


def appended_read(value: Any, paths: Iterable[tuple[Any, ...]], written: frozenset[int],
                  calls: int = _CALLS) -> tuple[Any, ...] | None:
    """The steps from ``value`` to a list forward appends to (``written``: ids) that one of
    ``paths`` reads other than to append: the list itself, one it goes through (an index),
    one a method it calls reads, or one held by what it reads whole (a step it cannot
    follow ends the path there). None where no path does."""
    for path in paths:
        walked: list[Any] = []
        here = value
        for step in path:
            if isinstance(here, list) and id(here) in written:
                return tuple(walked)  # an index or a slice of it
            if step is _KEYS:  # a dict's keys (guarded with it, or where written); else all
                found = None if type(here) is dict else _holding(here, written, _DEPTH, set())
                if found is not None:
                    return (*walked, *found)
                break
            if isinstance(step, Call):
                reads = _method_reads(here, step.name) if calls else None
                found = _holding(here, written, _DEPTH, set()) if reads is None else \
                    appended_read(here, reads, written, calls - 1)
                if found is not None:
                    return (*walked, *found)
                break
            after = _follow(here, step)
            if after is _ABSENT:
                break
            if after is _OPEN:  # a property, a lookup of another kind: reads it whole
                found = _holding(here, written, _DEPTH, set())
                if found is not None:
                    return (*walked, *found)
                break
            walked.append(step)
            here = after
        else:
            found = _holding(here, written, _DEPTH, set())
            if found is not None:
                return (*walked, *found)
    return None


def _method_reads(value: Any, name: str) -> frozenset[tuple[Any, ...]] | None:
    """The paths through which ``value.name(...)`` reads ``value`` (its ``self``): none for
    a static or class method; None where that cannot be told (a method of C code, a
    function held by the instance, a wrapper taking ``*args``)."""
    if name in getattr(value, "__dict__", {}):
        return None
    method = inspect.getattr_static(type(value), name, None)
    if isinstance(method, (staticmethod, classmethod)):
        return frozenset()
    if not isinstance(method, types.FunctionType) or method.__code__.co_argcount == 0:
        return None
    return _self_reads(method.__code__)


def _self_reads(code: types.CodeType) -> frozenset[tuple[Any, ...]]:
    """The paths through which ``code`` reads its first argument (``()``: whole, as where
    an inner function holds it or it is bound again)."""
    found = _SELF.get(code)
    if found is None:
        me = code.co_varnames[0]
        ins = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        paths: set[tuple[Any, ...]] = {()} if me in code.co_cellvars else set()
        for n, op in enumerate(ins):
            names = op.argval if isinstance(op.argval, tuple) else (op.argval,)
            if op.opname.startswith(("STORE_FAST", "DELETE_FAST")) and me in names:
                paths.add(())
            elif op.opname.startswith("LOAD_FAST") and me in names:
                path = path_after(ins, n + 1) if names[-1] == me else ()
                if path is not None:
                    paths.add(path)
        found = _SELF[code] = frozenset(paths)
    return found


_SELF: dict[types.CodeType, frozenset[tuple[Any, ...]]] = {}


def _object(value: Any) -> bool:
    """An object whose attributes are followed: a plain one, or one of the user's class."""
    return plain_object(value) or user_instance(value)


def read_where_written(value: Any, paths: Iterable[tuple[Any, ...]], written: frozenset[int],
                       keys_set: Mapping[int, set[Any]]
                       ) -> list[tuple[Any, Any, bool, str, Any]]:
    """The locations one of ``paths`` reads in ``value`` that forward also writes
    (``written``: the ids of the dicts and objects it sets keys or attributes of,
    ``keys_set`` those keys by id): ``(owner, key, item, path as written, value there)``.
    The value written may be computed from the one read there (``stats["ema"] = 0.9 *
    stats["ema"] + 0.1 * loss``), which the trace fixed: a replay is exact only while it
    is as traced."""
    found: dict[tuple[int, Any], tuple[Any, Any, bool, str, Any]] = {}

    def read(owner: Any, key: Any, item: bool, where: tuple[Any, ...]) -> None:
        now = owner.get(key, _ABSENT) if item else vars(owner).get(key, _ABSENT)
        if now is not _ABSENT:  # (one missing: guards._set_where_missing)
            found.setdefault((id(owner), key), (owner, key, item, shown(where), now))

    for path in paths:
        here, walked = value, ()
        for step in path:
            key = step.name if isinstance(step, Attr) else step.key if isinstance(step, Get) \
                else step
            if id(here) in written and key in keys_set.get(id(here), ()):
                read(here, key, not isinstance(step, Attr), (*walked, step))
                break
            after = _follow(here, step)
            if after is _ABSENT:
                break
            if after is _OPEN:  # read there in a way not followed: as if whole
                path = walked
                break
            here, walked = after, (*walked, step)
        if len(walked) == len(path):  # read whole (passed on, printed): every key set there
            for key in keys_set.get(id(here), ()) if id(here) in written else ():
                item = type(here) is dict
                read(here, key, item, (*walked, key if item else Attr(key)))
    return list(found.values())


def _follow(value: Any, step: Any) -> Any:
    """``value`` after ``step``; ``_ABSENT`` where it has no such key, ``_OPEN`` where the
    step is not a plain lookup (a property, a ``__getitem__`` of the user's)."""
    if isinstance(step, Attr):
        if _object(value) and step.name in vars(value) and \
                not hasattr(getattr(type(value), step.name, None), "__set__"):
            return vars(value)[step.name]
        return _OPEN
    if isinstance(step, Get):
        return value.get(step.key, _ABSENT) if type(value) is dict else _OPEN
    if type(value) in (dict, list, tuple):
        try:
            return value[step]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return _OPEN


def _holding(value: Any, written: frozenset[int], depth: int, seen: set[int]
             ) -> tuple[Any, ...] | None:
    """The steps to a list in ``written`` that ``value`` is or holds (in dicts, lists,
    tuples, plain objects and the user's objects, ``depth`` levels down), or None; a
    container below that depth may hold one, so it ends a path (``_DEEPER``)."""
    if isinstance(value, list) and id(value) in written:
        return ()
    if not written or id(value) in seen or isinstance(value, ATOMS):
        return None
    if depth == 0:  # deeper than searched: it may hold one (refused, not missed)
        return (_DEEPER,) if isinstance(value, (dict, list, tuple)) or _object(value) else None
    seen.add(id(value))
    if isinstance(value, dict):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif _object(value):
        items = ((Attr(k), v) for k, v in vars(value).items())
    else:
        return None
    for key, held in items:
        found = _holding(held, written, depth - 1, seen)
        if found is not None:
            return (key, *found)
    return None


def shown(path: tuple[Any, ...]) -> str:
    """``path`` as Python writes it after a name: ``['seen']``, ``.seen``, ``[0]``."""
    return "".join(_shown(step) for step in path)


def _shown(step: Any) -> str:
    if step is _DEEPER:
        return f" (more than {_DEPTH} levels down)"
    if isinstance(step, Attr):
        return f".{step.name}"
    return f"[{(step.key if isinstance(step, Get) else step)!r}]"
