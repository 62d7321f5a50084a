"""What forward's Python reaches beyond its modules: globals, other modules, closures, calls.

Tracing runs forward once; a global it reads (``SCALE * h``, ``helpers.scaled(h)`` reading
another module's ``SCALE``, ``SETTINGS["hard"]``, a closure's variable) is baked into the
graph, and a global it writes (``LOG.append(...)``, ``global CALLS; CALLS += 1``,
``helpers.COUNT = ...``) is written once, at compile time. Like dynamo, which follows every
frame forward calls, ``reached_code`` watches the trace (``sys.setprofile``): the first time
a frame of the user's code runs (not torch's, mbcompile's or Python's own), the globals its
code names, the attributes it names on modules of the user's, and the closure variables of
the functions it reaches are each a ``Slot``: taken into the capture's ``Snapshot`` before
the frame runs (so a write is put back and replayed once per step: ``side_effects.py``) and
guarded after it (``guards.slot_guard``).

Calls whose effect cannot happen once per step later are refused as they are made, before
they run: a file opened or written, a draw of Python's or numpy's random numbers, the clock
read, a torch generator seeded or its state read (also when imported by another name).

Before::

    def forward(self, x):                  # helpers.py: def scaled(h): return h * SCALE
        LOG.append(x.detach().sum())
        return helpers.scaled(self.lin(x))

Slots (``Reach.slots``): ``(globals of forward's module, "LOG")``, ``(…, "helpers")``,
``(helpers.__dict__, "scaled")``, ``(globals of helpers.py, "SCALE")``.
"""

from __future__ import annotations

import contextlib
import dis
import io
import os
import random
import sys
import sysconfig
import time
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CaptureError
from .sources import is_library, user_frame

__all__ = ["Cell", "Reach", "Slot", "holds_state", "reached_code", "user_code"]

_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})


def user_code(path: str | None) -> bool:
    """A file of the user's (installed packages included), not torch's, mbcompile's or
    Python's own."""
    return bool(path) and not is_library(path) and not os.path.abspath(path).startswith(_STDLIB)


class Cell:
    """A closure variable as a one-key mapping (``name`` -> its value), so that a guard reads
    it and a replayed write sets it as a dict's item."""

    __slots__ = ("cell", "name")

    def __init__(self, cell: types.CellType, name: str) -> None:
        self.cell, self.name = cell, name

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self.cell.cell_contents
        except ValueError:  # not yet bound
            return default

    def __setitem__(self, key: str, value: Any) -> None:
        self.cell.cell_contents = value

    def pop(self, key: str, default: Any = None) -> Any:
        value = self.get(key, default)
        with contextlib.suppress(ValueError):
            del self.cell.cell_contents
        return value


@dataclass(frozen=True)
class Slot:
    """``owner[key]``: a module's globals (or a module object's ``__dict__``) and a name, or
    a ``Cell``; ``where`` names it in messages."""

    owner: Any
    key: str
    where: str


@dataclass
class Reach:
    """What the watched trace reached: ``slots`` in the order met (each once)."""

    add_slot: Callable[[Slot, bool], None]  # the snapshot's: record it before code runs
    slots: list[Slot] = field(default_factory=list)
    seen: set[tuple[int, str]] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)

    def slot(self, owner: Any, key: str, where: str) -> None:
        if (id(owner), key) in self.seen:
            return
        self.seen.add((id(owner), key))
        slot = Slot(owner, key, where)
        self.slots.append(slot)
        value = owner.get(key, None)
        self.add_slot(slot, holds_state(value))
        if isinstance(value, types.FunctionType):
            if value.__closure__ and user_code(value.__code__.co_filename):
                for name, cell in zip(value.__code__.co_freevars, value.__closure__):
                    self.slot(Cell(cell, name), name,
                              f"the variable {name} of {value.__qualname__}")
        elif callable(value) and _user_instance(value):
            # a callable object of the user's (a schedule): not a plain object, so its
            # attributes are slots of their own, each guarded and its writes replayed
            for name in list(vars(value)):
                self.slot(vars(value), name, f"{where}.{name}")


def holds_state(value: Any) -> bool:
    """Whether what ``value`` holds is the user's state, looked into (a container, a
    namespace, an object of the user's class), not a library's object (a logger)."""
    if isinstance(value, (dict, list, tuple, set, frozenset, types.SimpleNamespace)):
        return True
    return not isinstance(value, (types.FunctionType, types.ModuleType)) and \
        _user_instance(value)


def _user_instance(value: Any) -> bool:
    kind = type(value)
    return (hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type))
            and user_code(getattr(sys.modules.get(kind.__module__), "__file__", None)))


@dataclass(frozen=True)
class _Code:
    """Names one code object uses: the globals (read or written) and attribute names."""

    globals: tuple[str, ...]
    attributes: tuple[str, ...]


_CODES: dict[types.CodeType, _Code | None] = {}


def _code(code: types.CodeType) -> _Code | None:
    """``code``'s names (None for code not the user's), worked out once per code object."""
    if code in _CODES:
        return _CODES[code]
    info = None
    if user_code(code.co_filename):
        names = [i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS]
        info = _Code(tuple(dict.fromkeys(names)), tuple(code.co_names))
    _CODES[code] = info
    return info


def _module_name(space: dict[str, Any]) -> str:
    return str(space.get("__name__", "?"))


def _enter(reach: Reach, frame: types.FrameType, info: _Code) -> None:
    """The first run of a user's frame: a slot for each global it names and, for a global
    that is a module of the user's, for each attribute name the code uses on it."""
    space = frame.f_globals
    for name in info.globals:
        reach.slot(space, name, f"the global {name}")
        value = space.get(name)
        if isinstance(value, types.ModuleType) and user_code(getattr(value, "__file__", None)):
            inner = vars(value)
            for attr in info.attributes:
                reach.slot(inner, attr, f"the global {value.__name__}.{attr}")


#: Python functions of torch's that seed a generator or read its state (their code objects)
_RNG_FUNCTIONS = {torch.random.manual_seed: "seeds a random generator (torch.manual_seed)",
                  torch.random.seed: "seeds a random generator (torch.seed)",
                  torch.random.set_rng_state: "seeds a random generator (torch.set_rng_state)",
                  torch.random.get_rng_state: "reads a random generator's state "
                                              "(torch.get_rng_state)",
                  torch.random.fork_rng.__wrapped__: "seeds a random generator (fork_rng)"}
_RNG_CODES = {f.__code__: what for f, what in _RNG_FUNCTIONS.items()}
_GENERATOR_METHODS = {name: f"{'reads' if name == 'get_state' else 'seeds'} a random generator "
                      f"(a torch.Generator's {name})"
                      for name in ("manual_seed", "seed", "set_state", "get_state")}
_CLOCKS = frozenset({time.time, time.time_ns, time.perf_counter, time.perf_counter_ns,
                     time.monotonic, time.monotonic_ns, time.process_time})


def _refused_call(fn: Any) -> str | None:
    """Why a C function called from the user's code cannot be replayed (None: it can)."""
    owner = getattr(fn, "__self__", None)
    if fn is io.open or fn is os.open:
        return "opens a file"
    if isinstance(owner, io.IOBase):
        return "reads or writes a file"
    if isinstance(owner, random.Random):
        return "draws from Python's random module"
    if type(owner).__module__.startswith("numpy.random"):
        return "draws from numpy's random generator"
    if fn in _CLOCKS:
        return "reads the clock"
    if isinstance(owner, torch.Generator):
        return _GENERATOR_METHODS.get(getattr(fn, "__name__", ""))
    return None


def _caller(frame: types.FrameType | None) -> types.FrameType | None:
    """The first frame from ``frame`` outward that is not Python's own (contextlib's)."""
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_STDLIB):
        frame = frame.f_back
    return frame


def _refuse(reach: Reach, model_name: str, what: str, frame: types.FrameType) -> None:
    where = user_frame(traceback.extract_stack(frame))
    reach.refused.append(where)
    raise CaptureError(
        f"{model_name}.forward {what} at {where}; capture runs forward once, at compile "
        "time, so that call would happen once, there, and never in a step, where eager "
        "makes it on every call. Fix: make it outside forward (in the training loop), or "
        "pass its result in as an input; nothing was changed")


def _other_rngs() -> list[tuple[str, Callable[[Any], Any], Any]]:
    """Python's and numpy's global generators: (name, how to set the state, the state)."""
    found: list[tuple[str, Callable[[Any], Any], Any]] = [
        ("Python's random module", random.setstate, random.getstate())]
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # numpy's functions are compiled: no call the profile sees
        found.append(("numpy's random generator", numpy.random.set_state,
                      numpy.random.get_state()))
    return found


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)


@contextlib.contextmanager
def reached_code(add_slot: Callable[[Slot, bool], None], model_name: str) -> Iterator[Reach]:
    """Watch the block (a capture's trace): the ``Reach`` yielded lists the slots of the
    user's code it ran, each handed to ``add_slot`` before that code ran; a refused call
    raises ``CaptureError`` before it is made (and again after the block, if forward
    caught it)."""
    reach = Reach(add_slot)
    entered: set[tuple[types.CodeType, int]] = set()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code in _RNG_CODES:
                caller = _caller(frame.f_back)
                if caller is not None and _code(caller.f_code) is not None:
                    _refuse(reach, model_name, _RNG_CODES[code], caller)
                return
            info = _code(code)
            if info is not None and (code, id(frame.f_globals)) not in entered:
                entered.add((code, id(frame.f_globals)))
                _enter(reach, frame, info)
        elif event == "c_call" and _code(frame.f_code) is not None:
            what = _refused_call(arg)
            if what is not None:
                _refuse(reach, model_name, what, frame)

    outer = sys.getprofile()
    states = _other_rngs()
    sys.setprofile(profile)
    try:
        yield reach
    finally:
        sys.setprofile(outer)
        drawn = _other_rngs()
        for (name, setter, before), (_, _, now) in zip(states, drawn):
            if not _same_state(before, now):  # drawn from where the profile sees no call
                setter(before)
                reach.refused.append(f"a draw from {name}")
    if reach.refused:  # raised inside forward, and forward caught it
        raise CaptureError(
            f"{model_name}.forward makes a call capture cannot replay ({reach.refused[0]}); "
            "capture runs forward once, at compile time, so it would happen once, there, "
            "and never in a step. Fix: make it outside forward (in the training loop), or "
            "pass its result in as an input; nothing was changed")
