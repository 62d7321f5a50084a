"""Calling a user's layer hook so that it changes nothing, and saying what it would have changed.

A torch layer the graph calls as one node (``nn.Linear``, ...) runs its forward hooks at
each call: on made-up data while compile probes the layer (``fake_probe``, the check of
``forward_modes.check_layer_hooks``), and once per microbatch in a step, where eager runs
them once per step on the whole batch. A hook that only computes (returns a new output,
or None) is judged by what it returns; one that also writes Python state would write at
compile, and once per microbatch, with each microbatch's values. ``call_sandboxed`` runs
the hook with that state recorded and puts it back, whatever the hook did:

- the Python state reachable from the layer and from the hook itself (its closure cells,
  ``self`` of a bound method, its defaults, the module-level names its code reads, a
  ``functools.partial``'s arguments), as ``python_state.Snapshot`` records it, plus the
  closure cells and globals it rebinds (``count += 1`` on a ``nonlocal``); the modules'
  wiring among it (a hook registered or removed, a parameter or buffer added, rebound or
  deleted) is named by ``Snapshot.rewired``;
- a ``print`` or ``logging`` call (recorded, not printed);
- the globals and closure variables its code reaches through the functions it calls
  (``passes.code_reach``: a helper's ``LOG.append``), recorded and put back the same way;
- a file it opens (refused before it opens, as in forward);
- a call into an installed package's code (``wandb.log``), which writes where nothing can
  be put back: refused before it runs where the hook's code names one (``library_calls``),
  and at compile ended there, as if the hook returned None;
- a tensor hook it registers (``out.register_hook(fn)``: it would fire on a microbatch's
  gradient), kept, with ``fn`` itself called the same way;
- an in-place write to a parameter or buffer of a module it reaches (which cannot be put
  back: reported).

Three shortcuts keep a step's calls cheap, none skipping a write: a hook whose code
provably writes nothing (``hook_reads.reads_only``) is called as it is; the watch of a
call that wrote nothing is kept (``kept``, one per hook in the step's wrapper) and used
again on the same layer while everything it recorded is as it was, by identity
(``state_unchanged.Fingerprint``, in C; the in-place counters read anew), else the hook's
state is walked afresh; and the patches of ``print``, ``logging``, ``open`` and
``Tensor.register_hook`` stay in place for a microbatch (``sandbox_patches``), acting only
while a sandboxed call runs.

Example::

    result, wrote = call_sandboxed(hook, layer, (args, out))
    wrote  # "self.seen (appended (7,))", or None for a hook that only computes

``per_microbatch(hook)`` marks a hook its author means to run on each microbatch (a probe
of the microbatches, an injected failure): the step then calls it as written.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .code_reach import Cell, Reach, Slot, open_refused, user_code
from .errors import CaptureError
from .hook_reads import reads_only
from .library_calls import library_calls_refused, names_library
from .python_state import Snapshot
from .sandbox_patches import Call, enter, leave
from .side_effects import prints_recorded
from .state_unchanged import Fingerprint, definition, definitions_unchanged

__all__ = ["Kept", "call_sandboxed", "hooks_sandboxed", "per_microbatch", "runs_per_microbatch"]

_MARK = "_mbcompile_per_microbatch"


def per_microbatch(hook: Any) -> Any:
    """Mark ``hook`` (a forward or forward-pre hook of a torch layer) as meant to run on
    each microbatch of a compiled step, with each microbatch's values: a probe that counts
    the microbatches' rows, an injected failure. Returns ``hook`` itself.

    >>> rows = []
    >>> hook = per_microbatch(lambda m, args: rows.append(args[0].shape[0]))
    >>> runs_per_microbatch(hook)
    True
    """
    try:
        setattr(hook, _MARK, True)
    except (AttributeError, TypeError):  # a bound method, a builtin: marked by a wrapper
        return _Marked(hook)
    return hook


class _Marked:
    """A hook that takes no attributes, marked to run per microbatch."""

    __slots__ = ("fn",)
    _mbcompile_per_microbatch = True

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def runs_per_microbatch(hook: Any) -> bool:
    return getattr(hook, _MARK, False) is True


def _unwrapped(fn: Any) -> tuple[Any, list[Any]]:
    """The plain function under ``fn`` and the objects it is bound to (partial's
    arguments, a method's ``self``, a callable object itself)."""
    bound: list[Any] = []
    while True:
        if isinstance(fn, _Marked):
            fn = fn.fn
        elif isinstance(fn, functools.partial):
            bound.extend((*fn.args, *fn.keywords.values()))
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            bound.append(fn.__self__)
            fn = fn.__func__
        elif isinstance(vars(type(fn)).get("__call__"), types.FunctionType):
            bound.append(fn)  # a callable object of a class of the user's
            fn = vars(type(fn))["__call__"]
        else:
            return fn, bound


_NOT_STATE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)


@dataclass
class _Watch:
    """What one call may change, recorded before it."""

    snapshot: Snapshot
    cells: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, cell, contents)
    globals_: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)
    versions: list[tuple[str, torch.Tensor, int]] = field(default_factory=list)
    reach: Reach = field(default_factory=lambda: Reach(lambda slot, state: None))
    library: bool = False  # its code names an installed package's module, function, object
    libraries: list[str] = field(default_factory=list)  # the calls into one, refused
    busy: bool = False  # a call under it runs (a hook that calls its layer: not shared)
    #: ``snapshot`` compared in C (``unchanged``), and the in-place counters' tensors
    fingerprint: Fingerprint = field(init=False)
    tensors: tuple[torch.Tensor, ...] = field(init=False)
    counts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.fingerprint = Fingerprint(self.snapshot)
        self.tensors = tuple(t for _, t, _ in self.versions)
        self.counts = [v for _, _, v in self.versions]

    @classmethod
    def of(cls, fns: list[Any], module: nn.Module, copied: nn.Module | None = None) -> _Watch:
        roots: dict[str, Any] = {"<the layer>": module}
        if copied is not None:  # the user's layer ``module`` copies (its hooks' handles)
            roots["<the layer copied>"] = copied
        cells, globals_, walked = [], [], []
        for i, fn in enumerate(fns):
            mark = f"<hook {i}> " if len(fns) > 1 else ""  # roots by name: none overwritten
            plain, bound = _unwrapped(fn)
            roots.update((mark + ("self" if j == 0 else f"<bound argument {j}>"), b)
                         for j, b in enumerate(reversed(bound)))
            code = getattr(plain, "__code__", None)
            if code is None:
                continue
            roots.update((f"{mark}<default {j}>", d)
                         for j, d in enumerate(plain.__defaults__ or ()))
            users = user_code(code.co_filename)
            if users:  # walked below too, with what it calls (its globals become slots)
                walked.append(plain)
            for name, cell in zip(code.co_freevars, plain.__closure__ or ()):
                with contextlib.suppress(ValueError):  # an empty cell
                    cells.append((name, cell, cell.cell_contents))
                    roots[mark + name] = cell.cell_contents
            namespace = plain.__globals__
            for name in code.co_names:
                value = namespace.get(name, _ABSENT)
                if not users:
                    globals_.append((namespace, name, value))
                if value is not _ABSENT and not isinstance(value, _NOT_STATE):
                    roots[mark + name] = value
        snapshot = Snapshot(roots)
        # the globals and closure variables the hook's code reaches, through the functions
        # it calls too (a helper's ``LOG.append``, ``helpers.COUNT += 1``), as forward's are
        reach = _Reach(lambda slot, state: snapshot.add_slot(
            Slot(slot.owner, slot.key, slot.key) if isinstance(slot.owner, Cell) else slot,
            state))  # a closure variable by its name, as the hook's author wrote it
        for plain in walked:
            reach.walk(plain.__code__, plain.__globals__, plain.__closure__)
        library = names_library((*roots.values(), *(
            s.owner.get(s.key, None) for s in reach.slots)))
        return cls(snapshot, cells, globals_, _versions(snapshot), reach, library)

    def unchanged(self, counts: bool = True) -> bool:
        """Whether nothing it records differs now (``changes`` would find nothing), nor the
        code its walk entered, told cheaply; False where unsure (``state_unchanged``).
        ``counts=False``: the in-place counters not compared (``renew`` reads them anew)."""
        try:
            return self.fingerprint.unchanged() and \
                (counts is False or list(map(_VERSION, self.tensors)) == self.counts) and \
                (not self.cells or all(c.cell_contents is v for _, c, v in self.cells)) and \
                (not self.globals_ or
                 all(ns.get(name, _ABSENT) is v for ns, name, v in self.globals_)) and \
                definitions_unchanged(getattr(self.reach, "defs", ()))
        except ValueError:  # a closure cell emptied
            return False

    def renew(self) -> None:
        """Made ready for another call on the state it recorded, which ``unchanged`` found
        as it was: the in-place counters as they are now (an optimizer step moves them, and
        what the call writes in place is told from them)."""
        self.counts = list(map(_VERSION, self.tensors))
        if self.reach.refused:
            self.reach.refused.clear()
        if self.libraries:
            self.libraries.clear()

    def libraries_refused(self) -> contextlib.AbstractContextManager[Any]:
        """A call of the hook's into an installed package refused (``library_calls``),
        watched only where its code names one."""
        return library_calls_refused(self.libraries) if self.library else \
            contextlib.nullcontext(lambda: None)

    def changes(self) -> list[str]:
        found = [c.where for c in self.snapshot.changes()] + self.snapshot.rewired()
        found += [f"{name} (a variable of its closure)" for name, c, v in self.cells
                  if c.cell_contents is not v]
        found += [f"the global {name!r}" for ns, name, v in self.globals_
                  if ns.get(name, _ABSENT) is not v]
        found += [f"{name} (in place)" for (name, t, _), v in zip(self.versions, self.counts)
                  if t._version != v]
        return found

    def restore(self) -> None:
        self.snapshot.restore()
        for _, cell, value in self.cells:
            cell.cell_contents = value
        for namespace, name, value in self.globals_:
            if namespace.get(name, _ABSENT) is not value:
                if value is _ABSENT:
                    namespace.pop(name, None)
                else:
                    namespace[name] = value


_ABSENT = object()
_VERSION = operator.attrgetter("_version")


@dataclass
class _Reach(Reach):
    """``Reach`` that also lists the user's functions and classes its walk entered, with
    their definitions (``state_unchanged.definition``): a kept watch is walked afresh
    where one changed."""

    defs: list[tuple[Any, Any]] = field(default_factory=list)
    _defined: set[int] = field(default_factory=set)

    def value(self, value: Any, code: types.CodeType, info: Any = None, where: str = ""
              ) -> None:
        if id(value) not in self._defined and _users_definition(value):
            self._defined.add(id(value))
            self.defs.append((value, definition(value)))
        super().value(value, code, info, where)


def _users_definition(value: Any) -> bool:
    if isinstance(value, types.FunctionType):
        return user_code(value.__code__.co_filename)
    return isinstance(value, type) and \
        user_code(getattr(sys.modules.get(value.__module__), "__file__", None))


def _versions(snapshot: Snapshot) -> list[tuple[str, torch.Tensor, int]]:
    """The in-place counters of the parameters and buffers of the modules ``snapshot``
    records: a write to one cannot be put back, only reported."""
    return [(f"{path}.{n}" if path else n, t, t._version)
            for m, path, _, slots in snapshot.modules
            for n, t in (*slots[0].items(), *slots[1].items()) if t is not None]


#: ``call_sandboxed``'s ``kept``: per layer, the watch of the hook's last call that wrote
#: nothing, the hook, and what ``_Watch.of`` read of it; a walk per call of an unchanged
#: layer and hook would find the same objects, with the same contents
Kept = dict[nn.Module, tuple[_Watch, Any, tuple[Any, ...]]]


def _read(fn: types.FunctionType) -> tuple[Any, ...]:
    """What ``_Watch.of`` reads of a plain function beyond the objects it records."""
    namespace = fn.__globals__
    return (fn.__code__, fn.__defaults__, fn.__kwdefaults__,
            *[namespace.get(name, _ABSENT) for name in fn.__code__.co_names])


def _watch(fn: Any, module: nn.Module | None, kept: Kept | None) -> _Watch:
    """A watch of ``fn``'s call on ``module``: the one in ``kept`` where nothing it records
    or read has changed since (by identity: ``_Watch.unchanged``), else a new walk, kept.
    Only a plain function's is kept: a bound method's or a partial's state is read
    through objects ``_read`` does not cover."""
    if kept is None or module is None or type(fn) is not types.FunctionType:
        return _Watch.of([fn], module if module is not None else nn.Module())
    held = kept.get(module)
    if held is not None and not held[0].busy and held[1] is fn and \
            all(map(operator.is_, held[2], _read(fn))) and held[0].unchanged(counts=False):
        held[0].renew()
        return held[0]
    watch = _Watch.of([fn], module)
    kept[module] = (watch, fn, _read(fn))
    return watch


def _quiet(hook: Any) -> Any:
    """A tensor hook a sandboxed call registers, called sandboxed too."""
    def quiet(grad: torch.Tensor) -> Any:
        return call_sandboxed(hook, None, (grad,), module_first=False)[0]
    return quiet


@contextlib.contextmanager
def _tensor_hooks_kept(registered: list[Any]) -> Iterator[None]:
    """``Tensor.register_hook`` still registers, with the hook called sandboxed too; each
    registration is listed in ``registered``."""
    original = torch.Tensor.register_hook

    def register(self: torch.Tensor, hook: Any) -> Any:
        registered.append(hook)
        return original(self, _quiet(hook))

    torch.Tensor.register_hook = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.register_hook = original  # type: ignore[method-assign]


def call_sandboxed(fn: Any, module: nn.Module | None, args: tuple[Any, ...],
                   module_first: bool = True, kept: Kept | None = None
                   ) -> tuple[Any, str | None]:
    """``fn(module, *args)`` (``fn(*args)`` with ``module_first=False``), with everything it
    writes put back after it, returned or raised; returns ``(result, what it wrote)``,
    the second None when it wrote nothing. A hook whose code provably writes nothing
    (``hook_reads.reads_only``: it only reads, and calls no more than a builtin that reads)
    is called as it is.
    ``kept`` (the caller's, one per hook): the watch of a call that wrote nothing, used
    again by the next call on the same layer while nothing it records has changed."""
    if reads_only(fn, (module, *args) if module_first else args):
        return (fn(module, *args) if module_first else fn(*args)), None
    watch = _watch(fn, module, kept)
    call = Call(watch.reach, _quiet)
    wrote: list[str] | None = None
    watch.busy = True
    try:
        enter(call)  # its prints recorded, its files refused, its tensor hooks kept
        try:
            if watch.library:
                with watch.libraries_refused():
                    result = fn(module, *args) if module_first else fn(*args)
            else:
                result = fn(module, *args) if module_first else fn(*args)
        finally:
            leave(call)
        wrote = [] if watch.unchanged() else watch.changes()
    except CaptureError:  # a file opened, a library called: refused before it ran
        if not (watch.reach.refused or watch.libraries):
            raise
        result, wrote = None, watch.changes()
    finally:
        watch.busy = False
        if wrote != [] or watch.reach.refused or watch.libraries:  # it raised, or wrote:
            watch.restore()                                         # put everything back
            if kept is not None:
                kept.pop(module, None)  # type: ignore[arg-type]
    if watch.reach.refused:  # (also where the hook caught the refusal itself)
        wrote.insert(0, f"a file (it {watch.reach.refused[0]})")
    if watch.libraries:
        wrote.insert(0, f"through {watch.libraries[0]}")
    prints = call.prints.prints() if call.prints.calls else ()  # (not a level asked)
    if prints:
        wrote.append(f"a print or log call at {prints[0].where}")
    if call.registered:
        wrote.append("a tensor hook it registers (it would fire on each microbatch's "
                     "gradient)")
    return result, (", ".join(wrote[:3]) if wrote else None)


@contextlib.contextmanager
def hooks_sandboxed(module: nn.Module, copied: nn.Module | None = None) -> Iterator[None]:
    """While compile calls ``module`` on made-up data (a shape probe, a copy that checks
    its hooks, ``copied``: the user's layer, recorded too: a hook removes one of its hooks
    by a handle): whatever its hooks (forward and backward) write is put back when the
    block ends, nothing they print is printed, and no file they open is written. One
    watch for the whole call, so a pre-hook's write that its post-hook reads (a timer)
    holds between them.

    (Global module hooks are hidden while compile runs: ``global_hooks.hidden``.)
    """
    tables = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
              module._backward_hooks)
    fns = [fn for table in tables for fn in table.values()]
    if not fns:
        yield
        return
    watch = _Watch.of(fns, module, copied)
    try:  # a file a hook opens to write is os.devnull: written at compile, it would stay
        with prints_recorded(), _tensor_hooks_kept([]), \
                open_refused(watch.reach, to_null=True), \
                watch.libraries_refused() as rearm, _libraries_skipped(tables, watch, rearm):
            yield
    finally:
        watch.restore()


@contextlib.contextmanager
def _libraries_skipped(tables: tuple[dict[int, Any], ...], watch: _Watch,
                       rearm: Any) -> Iterator[None]:
    """Where the hooks name an installed package: each hook, called on made-up data, ends
    at a call into one (refused before it ran), as if it returned None, and the probe goes
    on (the step refuses the hook, or, marked ``per_microbatch``, makes the call there)."""
    if not watch.library:
        yield
        return

    def skipping(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            made = len(watch.libraries)
            try:
                return fn(*args, **kwargs)
            except CaptureError:
                if len(watch.libraries) == made:
                    raise
                rearm()  # Python unset the profile function that raised
                return None
        return call

    held = [(table, key, fn) for table in tables for key, fn in table.items()]
    for table, key, fn in held:
        table[key] = skipping(fn)
    try:
        yield
    finally:
        for table, key, fn in held:
            table[key] = fn
