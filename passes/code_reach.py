"""What forward's Python reaches beyond its modules: globals, other modules, closures.

Tracing runs forward once; a global it reads (``SCALE * h``, ``helpers.scaled(h)`` reading
another module's ``SCALE``, ``SETTINGS["hard"]``, a closure's variable) is baked into the
graph, and a global it writes (``LOG.append(...)``, ``global CALLS; CALLS += 1``,
``helpers.COUNT = ...``) is written once, at compile time. Like dynamo, which follows the
functions forward calls, ``reached_code`` walks the code objects of the user's code that
forward can reach (every module's ``forward``, the methods it names on ``self``, its hooks,
the functions, classes and modules it names, their closures, recursively; torch's,
mbcompile's, Python's own and installed packages' code is not entered) and takes each
global and closure variable they name as a ``Slot``: recorded by the capture's ``Snapshot``
before the trace (so a write is put back, then replayed once per step: ``side_effects.py``)
and guarded after it (``slot_guards.slot_guards``). A walk of the code, not of one run, so a
global read in a branch not taken is guarded too (a change compiles again, needlessly but
exactly).

Calls whose effect cannot happen once per step later are refused, changing nothing: a
file opened (at the call), a draw of Python's or numpy's global random numbers (found by
their state, which is put back), and, where the walk found the code naming one, the clock
read or a torch generator seeded or its state read through a name the code holds
(``from torch import manual_seed``, ``GEN.manual_seed(0)``), found as the trace makes the
call (``torch.manual_seed`` itself: ``generators.seeding_refused``).

Before::

    def forward(self, x):                  # helpers.py: def scaled(h): return h * SCALE
        LOG.append(x.detach().sum())
        return helpers.scaled(self.lin(x))

Slots (``Reach.slots``): ``(globals of forward's module, "LOG")``, ``(…, "helpers")``,
``(helpers.__dict__, "scaled")``, ``(globals of helpers.py, "SCALE")``.
"""

from __future__ import annotations

import builtins
import contextlib
import dis
import io
import itertools
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn

from . import global_hooks
from .clock_reads import CLOCK_FUNCTIONS, clock_read, names_clock
from .errors import CaptureError
from .host_draws import draws_refused
from .library_calls import IN_PACKAGE
from .library_reach import walk_installed_models
from .library_writes import library_writes_watched
from .read_paths import path_after
from .sources import installed_package, user_frame
from .whose_code import holds_state, user_code, user_instance

__all__ = ["Cell", "Reach", "Slot", "holds_state", "open_checked", "open_refused", "reached_code",
           "user_code"]

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL"})
_ATTR_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"})
_MAX_CODES = 5_000  # code objects walked per capture at most: a package is not walked whole


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
    library: bool = False  # an installed package's: guarded, never forward's state to replay
    #: the steps the code read it through, other than to append or write (``read_paths``;
    #: ``()``: itself, ``len(LOG)``): ``guards.unwritten`` refuses such a read of a list appended
    reads: frozenset[tuple[Any, ...]] = frozenset()


def _user_function(value: Any) -> bool:
    return isinstance(value, types.FunctionType) and user_code(value.__code__.co_filename)


@dataclass(frozen=True)
class _Code:
    """One code object's names: globals (read or written), attribute chains on a global
    (``helpers.scaled`` -> ``("helpers", "scaled")``), attribute names, inner code."""

    globals: tuple[str, ...]
    chains: tuple[tuple[str, ...], ...]
    attributes: tuple[str, ...]
    inner: tuple[types.CodeType, ...]
    #: globals and closure variables read other than to append or write: name -> the
    #: steps read through (``len(LOGS["seen"])``: ``("seen",)``; ``read_paths``)
    reads: dict[str, frozenset[tuple[Any, ...]]] = field(default_factory=dict)


_CODES: dict[types.CodeType, _Code] = {}


def _code(code: types.CodeType) -> _Code:
    """``code``'s names, worked out once per code object."""
    info = _CODES.get(code)
    if info is None:
        names, chains, chain = [], [], None
        every = [i for i in dis.get_instructions(code) if i.opname != "CACHE"]
        reads: dict[str, set[tuple[Any, ...]]] = {}
        for n, ins in enumerate(every):
            path = path_after(every, n + 1) if ins.opname in ("LOAD_GLOBAL", "LOAD_DEREF") \
                else None
            if path is not None:
                reads.setdefault(ins.argval, set()).add(path)
            if ins.opname == "LOAD_GLOBAL":
                chain = [ins.argval]
                chains.append(chain)
            elif ins.opname in _ATTR_OPS and chain is not None:
                chain.append(ins.argval)
            elif ins.opname not in ("COPY", "CACHE"):
                chain = None
            if ins.opname in _GLOBAL_OPS:
                names.append(ins.argval)
        info = _CODES[code] = _Code(
            tuple(dict.fromkeys(names)), tuple(dict.fromkeys(tuple(c) for c in chains)),
            tuple(code.co_names), tuple(c for c in code.co_consts if isinstance(c, types.CodeType)),
            {k: frozenset(v) for k, v in reads.items()})
    return info


#: what forward cannot call: it would happen once, at compile time, and never in a step
_RNG = {torch.random.manual_seed: "seeds a random generator (torch.manual_seed)",
        torch.random.seed: "seeds a random generator (torch.seed)",
        torch.random.set_rng_state: "seeds a random generator (torch.set_rng_state)",
        torch.random.get_rng_state: "reads a random generator's state (torch.get_rng_state)",
        torch.random.fork_rng: "seeds a random generator (fork_rng)"}
_REFUSED: dict[int, str] = {
    **{id(f): what for f, what in _RNG.items()},
    **{id(f): "reads the clock" for f in CLOCK_FUNCTIONS}}
_RNG_NAMES = {(f.__module__, f.__name__): what for f, what in _RNG.items()}
_GENERATOR_METHODS = frozenset({"manual_seed", "seed", "set_state", "get_state"})


def _refused(value: Any) -> str | None:
    """Why forward cannot call ``value`` (None: it can)."""
    what = _REFUSED.get(id(value)) or clock_read(value)
    if what is None and callable(value):
        # by name too: a wrapper of torch.manual_seed (a test's or a library's patch)
        # is another object than the one this table was built from
        what = _RNG_NAMES.get((getattr(value, "__module__", None),
                               getattr(value, "__name__", None)))
    if what is None and isinstance(getattr(value, "__self__", None), torch.Generator) and \
            getattr(value, "__name__", "") in _GENERATOR_METHODS:
        kind = "reads" if value.__name__ == "get_state" else "seeds"
        what = f"{kind} a random generator (a torch.Generator's {value.__name__})"
    return what


@dataclass
class Reach:
    """What the walk reached: ``slots`` in the order met (each once); ``refused``: the calls
    made that cannot be replayed, with their places."""

    add_slot: Callable[[Slot, bool], None]  # the snapshot's: record it before the trace
    slots: list[Slot] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    suspects: bool = False  # the code names a call that cannot be replayed (``_refused``)
    _seen: dict[tuple[int, str], int] = field(default_factory=dict)  # -> its index in slots
    _walked: set[tuple[int, int, int]] = field(default_factory=set)  # code, globals, closure

    def slot(self, owner: Any, key: str, where: str, library: bool = False,
             reads: frozenset[tuple[Any, ...]] = frozenset()) -> Any:
        """Record ``owner[key]`` once (``reads``: a code's paths of reading it, gathered
        over every code that names it); its value (or None, absent)."""
        value = owner.get(key, None)
        index = self._seen.get((id(owner), key))
        if index is not None and not reads <= self.slots[index].reads:
            self.slots[index] = replace(self.slots[index], reads=self.slots[index].reads | reads)
        if index is None:
            self._seen[(id(owner), key)] = len(self.slots)
            slot = Slot(owner, key, where, library, reads)
            self.slots.append(slot)
            self.add_slot(slot, holds_state(value) and not library)
        return value

    def enter(self, code: types.CodeType, space: dict[str, Any], closure: Any = None) -> bool:
        """Whether to walk ``code`` now: not walked yet, and under the cap."""
        key = (id(code), id(space), id(closure))
        if key in self._walked or len(self._walked) >= _MAX_CODES:
            return False
        self._walked.add(key)
        return True

    def walk(self, code: types.CodeType, space: dict[str, Any], closure: Any = None) -> None:
        """The globals ``code`` names in ``space``, and what they lead to."""
        if not user_code(code.co_filename) or not self.enter(code, space, closure):
            return
        info = _code(code)
        for name, cell in zip(code.co_freevars, closure or ()):  # (a module held: its
            self.value(self.slot(Cell(cell, name), name,          # attributes the code names)
                                 f"the variable {name} of {code.co_qualname}",
                                 reads=info.reads.get(name, frozenset())), code, info)
        for name in info.globals:
            where = f"the global {name}"
            self.value(self.slot(space, name, where, reads=info.reads.get(name, frozenset()))
                       if name in space or name not in
                       vars(builtins) else vars(builtins)[name], code, info, where)
        for chain in info.chains:
            self.chain(space, chain, code)
        for inner in info.inner:
            self.walk(inner, space)

    def chain(self, space: dict[str, Any], chain: tuple[str, ...], code: types.CodeType) -> None:
        """``a.b.c`` from a global: a slot for each attribute of a module of the user's,
        and what a chain's end leads to (a function called, a generator's method)."""
        value, where = space.get(chain[0], vars(builtins).get(chain[0])), chain[0]
        for attr in chain[1:]:
            where = f"{where}.{attr}"
            if isinstance(value, types.ModuleType) and \
                    user_code(getattr(value, "__file__", None)):
                value = self.slot(vars(value), attr, f"the global {where}")
            else:
                value = getattr(value, attr, None) if not isinstance(value, nn.Module) else None
            self.value(value, code, where=where)

    def value(self, value: Any, code: types.CodeType, info: _Code | None = None,
              where: str = "") -> None:
        """What a name leads to: a function's code (and closure), a class's methods, a
        module's attributes this code names, a callable object's attributes."""
        if _refused(value) is not None or (info is not None
                                           and names_clock(value, info.attributes)):
            self.suspects = True  # named: the trace is watched for the call itself
        elif _user_function(value):
            self.walk(value.__code__, value.__globals__, value.__closure__)
        elif isinstance(value, type) and user_code(
                getattr(sys.modules.get(value.__module__), "__file__", None)) and \
                not issubclass(value, nn.Module):  # a module's forward is walked as one
            for member in vars(value).values():
                fn = getattr(member, "__func__", member)  # static and class methods
                if _user_function(fn):
                    self.walk(fn.__code__, fn.__globals__, fn.__closure__)
        elif callable(value) and user_instance(value):  # a schedule object: its attributes
            for name in list(vars(value)):                # are slots, its methods walked
                self.slot(vars(value), name, f"{where or 'an object'}.{name}")
            self.value(type(value), code)
        elif isinstance(value, types.ModuleType) and info is not None and \
                user_code(getattr(value, "__file__", None)):
            for attr in info.attributes:  # over-approximated: any attribute name the code uses
                if attr in vars(value):
                    self.value(self.slot(vars(value), attr,
                                         f"the global {value.__name__}.{attr}"), code)


def _roots(model: nn.Module, live: Callable[[nn.Module], bool] | None
           ) -> Iterator[Callable[..., Any]]:
    """The functions forward starts from: each module's ``forward``, the methods its code
    names on the class, the functions it holds in attributes, and its hooks (but not those
    of a module ``live`` names, a layer the graph calls as one node: its hooks run at each
    call, reading their state then, not at compile time)."""
    for module in model.modules():
        kind = type(module)
        forward = getattr(kind.forward, "__func__", kind.forward)
        if _user_function(forward):
            yield forward
            for name in forward.__code__.co_names:
                member = getattr(kind, name, None)
                yield getattr(member, "__func__", member)
        called: bool | None = None  # live(module), asked once for its dozen hook dicts
        for key, value in vars(module).items():
            if "hook" in key and isinstance(value, dict):
                if called is None:
                    called = live is not None and live(module)
                if not called:
                    yield from value.values()
            elif isinstance(value, types.FunctionType):
                yield value
            elif user_instance(value):  # a schedule object it calls, a logger, a config
                yield from _methods(value)
    for hooks in global_hooks.FORWARD:
        yield from hooks.values()


def _methods(value: Any) -> Iterator[types.FunctionType]:
    """The functions ``value``'s class defines (those its forward can call on it)."""
    yield from (f for f in vars(type(value)).values() if isinstance(f, types.FunctionType))


@contextlib.contextmanager
def open_refused(reach: Reach, to_null: bool = False) -> Iterator[None]:
    """``open`` called from the user's code while the block runs, directly or, to write,
    through Python's own code (``Path.open("a")``): refused before it opens (torch's and
    Python's own calls, reading source lines for a stack trace or a warning, go through).
    With ``to_null`` (a hook called on made-up data at compile) a file opened to write is
    ``os.devnull`` instead, and one opened to read is read."""
    def refusing(*args: Any, **kwargs: Any) -> Any:
        return open_checked(reach, sys._getframe(1), args, kwargs, to_null)

    outer = builtins.open, io.open
    builtins.open = io.open = refusing  # type: ignore[assignment]
    try:
        yield
    finally:
        builtins.open, io.open = outer  # type: ignore[assignment]


_OPEN = io.open
_STDLIB = ("<frozen ", os.path.dirname(os.path.abspath(os.__file__)) + os.sep)


def open_checked(reach: Reach, frame: Any, args: tuple, kwargs: dict, to_null: bool = False) -> Any:
    """``open(*args, **kwargs)`` from ``frame`` under ``open_refused`` or ``sandbox_patches``."""
    through = False  # Python's own code between (``Path.open``, ``linecache`` reading)
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):
        frame, through = frame.f_back, True
    mode = str(args[1] if len(args) > 1 else kwargs.get("mode", "r"))
    writes = any(c in mode for c in "wax+")
    if to_null and writes:
        return _OPEN(os.devnull, mode.replace("x", "w"))
    if frame is not None and not to_null and (  # a warning reads its line: let through
            (user_code(frame.f_code.co_filename) and (not through or writes)) or
            (writes and installed_package(frame.f_code.co_filename))):  # np.save's
        where = user_frame(traceback.extract_stack()[:-1])
        reach.refused.append(f"opens a file at {where}")
        raise CaptureError(f"forward opens a file at {where}")
    return _OPEN(*args, **kwargs)


@contextlib.contextmanager
def reached_code(model: nn.Module, add_slot: Callable[[Slot, bool], None], model_name: str,
                 live: Callable[[nn.Module], bool] | None = None,
                 arguments: Mapping[str, Any] | None = None) -> Iterator[Reach]:
    """Walk the user's code ``model``'s forward reaches, handing each slot to ``add_slot``
    (before the block, a capture's trace, runs), and watch the block: a file opened, a draw
    of Python's or numpy's global random numbers, and (where the walk found the code naming
    one) a call of ``_refused`` are refused; nothing is changed by a refusal. ``live``: the
    modules whose hooks the trace leaves to run at each call (fx's leaf layers). The global
    module hooks compile hides from its probes run in the block (``global_hooks.shown``):
    the trace calls them on the modules it enters, as eager's forward does. ``arguments``:
    the call's non-tensor arguments, looked into for a package's object as the model is
    (``model(x, logger)`` whose forward calls ``logger.log(loss)``)."""
    with global_hooks.shown(), _reached(model, add_slot, model_name, live,
                                        arguments or {}) as reach:
        yield reach


@contextlib.contextmanager
def _reached(model: nn.Module, add_slot: Callable[[Slot, bool], None], model_name: str,
             live: Callable[[nn.Module], bool] | None, arguments: Mapping[str, Any]
             ) -> Iterator[Reach]:
    reach = Reach(add_slot)
    held = (m for v in arguments.values() if user_instance(v) for m in _methods(v))
    for fn in itertools.chain(_roots(model, live), held):  # ``model(x, cfg)``: cfg's too
        fn = getattr(fn, "__wrapped__", fn)  # a global hook called on the model in its place
        fn = getattr(fn, "func", fn)  # functools.partial
        fn = getattr(fn, "__func__", fn)  # a bound method
        if _user_function(fn):
            reach.walk(fn.__code__, fn.__globals__, fn.__closure__)
    named = [s.owner.get(s.key) for s in reach.slots]  # the user's code's, not a package's
    named.extend(arguments.values())
    walk_installed_models(model, reach, _code)  # transformers' module-level flags
    with draws_refused(reach.refused):  # Python's or numpy's: put back, and refused
        try:
            with open_refused(reach), _calls_watched(reach) if reach.suspects else \
                    contextlib.nullcontext(), library_writes_watched(model, named, reach.refused):
                yield reach
        except Exception:  # a refusal raised in forward, as the trace passed it on
            if not reach.refused:
                raise
    if reach.refused:
        _refuse(model_name, reach.refused[0])


#: the Python functions among ``_RNG`` (``fork_rng``: its generator's code), as a frame runs them
_RNG_CODES = {getattr(f, "__wrapped__", f).__code__: what for f, what in _RNG.items()}


#: the frames between a call of the user's and the function it names: fork_rng's
#: ``__enter__``, and the wrapper importing dynamo puts on ``torch.manual_seed`` (its
#: ``_disable_dynamo``: torch/_compile.py's ``inner``, then eval_frame.py's ``_fn``)
_WRAPPERS = frozenset({contextlib.__file__, *(
    os.path.join(os.path.dirname(torch.__file__), f)
    for f in ("_compile.py", os.path.join("_dynamo", "eval_frame.py")))})


@contextlib.contextmanager
def _calls_watched(reach: Reach) -> Iterator[None]:
    """While the block runs, a call of ``_refused`` made from the user's code is refused
    before it runs (``sys.setprofile``: slow, so only where the walk found one named)."""
    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            what, caller = _refused(arg), frame
        elif event == "call" and frame.f_code in _RNG_CODES:
            what, caller = _RNG_CODES[frame.f_code], frame.f_back
            while caller is not None and caller.f_code.co_filename in _WRAPPERS:
                caller = caller.f_back
        else:
            return
        if what is not None and caller is not None and user_code(caller.f_code.co_filename):
            where = user_frame(traceback.extract_stack(caller))
            reach.refused.append(f"{what} at {where}")
            raise CaptureError(f"forward {what} at {where}")

    outer = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(outer)


def _refuse(model_name: str, what: str) -> None:
    fix = "Fix: make it outside forward (in the training loop), or pass its result in as an " \
        "input; nothing was changed"
    if IN_PACKAGE in what:  # a library's write: print and logging are replayed
        fix = "Fix: make the call from the training loop (after the step, with what forward " \
            "returns), or log with print or logging, which are replayed once per step; " \
            "nothing was changed"
    raise CaptureError(
        f"{model_name}.forward {what}; capture runs forward once, at compile time, so that "
        f"call would happen once, there, and never in a step, where eager makes it on every "
        f"call. {fix}")
