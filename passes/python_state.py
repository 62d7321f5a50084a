"""The Python state a traced forward can touch: taken before tracing, put back after.

Tracing runs forward once on symbolic or fake values, so whatever forward writes into
Python objects (``self.last = loss.detach()``, ``self.stats["loss"] = ...``,
``self.history.append(...)``, ``self.cfg.seen = n``, legacy ``spectral_norm`` setting
``module.weight``) would leave a proxy or fake tensor in the user's objects. A
``Snapshot`` records, before the trace, every module's attributes, parameter, buffer and
submodule slots and hook dictionaries, and the contents of every plain container
(dict, list, set, deque; tuples are looked into) and plain object (a dataclass, a
config) reachable from them or held by a module's class of the user's (``LOG = []`` in
the class body), each by identity; ``changes`` lists what differs after the
trace, and ``restore`` puts everything back as it was, in place, whatever happened.

Before (forward ran ``self.history.append(o.detach())`` under fx)::

    model.history == [Proxy(detach)]

After ``restore``::

    model.history == []        # the same list object; ``changes`` said: appended (detach,)
"""

from __future__ import annotations

import collections
import contextlib
import sys
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .whose_code import holds_state, user_code, user_instance

__all__ = ["DELETED", "MODULE_INTERNALS", "REWIRED", "Change", "Snapshot", "python_state_kept"]

_MISSING = object()
#: ``nn.Module``'s own bookkeeping (slots, hooks, flags): compared by ``Snapshot`` itself
MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
_LIMIT = 100_000  # objects looked into at most: a vocabulary list is not walked item by item
_OPAQUE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, torch.Generator)


@dataclass(frozen=True)
class Change:
    """One difference a trace left: ``kind`` is ``"attr"`` (``owner.key = value``, or deleted:
    ``value is DELETED``), ``"item"`` (``owner[key] = value`` or deleted), ``"extend"``
    (``owner`` a list that grew by ``value``, a tuple) or ``"other"`` (``owner`` changed some
    other way: a list reordered, a set or deque written). ``where`` names it for messages."""

    kind: str
    owner: Any
    key: Any
    value: Any
    where: str
    before: Any = None  # the value it replaced ("attr", "item"; DELETED: there was none)


DELETED = object()


def _plain_object(value: Any) -> bool:
    """A user's object whose attributes are state (a dataclass, a namespace, a config, a
    callable schedule of the user's own class)."""
    return (hasattr(value, "__dict__") and not isinstance(value, _OPAQUE)
            and (not callable(value) or holds_state(value))
            and not type(value).__module__.startswith("torch"))


@dataclass
class Snapshot:
    """Everything reachable from ``roots`` (name -> object), recorded by identity."""

    roots: Mapping[str, Any]
    modules: list[tuple[nn.Module, str, dict[str, Any], tuple[dict[str, Any], ...]]] = \
        field(default_factory=list)
    hooks: list[tuple[dict[Any, Any], dict[Any, Any]]] = field(default_factory=list)
    saved: dict[int, tuple[Any, str, Any]] = field(default_factory=dict)  # id -> obj, path, copy
    #: ``owner[key]`` locations outside the model: globals, closure variables (``add_slot``)
    slots: list[tuple[Any, Any, Any, str]] = field(default_factory=list)  # owner, key, before, path
    #: each module's ``_non_persistent_buffers_set`` and a copy: ``register_buffer`` and
    #: ``del`` write it beside ``_buffers`` (put back with it, told by ``_buffers``)
    marks: list[tuple[set[str], set[str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for root, obj in self.roots.items():
            if isinstance(obj, nn.Module):
                for name, mod in obj.named_modules(remove_duplicate=True):
                    self._module(mod, ".".join(filter(None, (root, name))))
            else:
                self._visit(obj, root)

    def _module(self, mod: nn.Module, path: str) -> None:
        own = dict(mod.__dict__)
        self.modules.append((mod, path, own, tuple(dict(s) for s in _slots_of(mod))))
        self.hooks.extend((t, dict(t)) for t in _hook_tables(mod))
        marks = own.get("_non_persistent_buffers_set")
        if isinstance(marks, set):
            self.marks.append((marks, set(marks)))
        for key, value in own.items():
            if key not in MODULE_INTERNALS:
                self._visit(value, ".".join(filter(None, (path, key))))
        for cls in type(mod).__mro__:  # ``self.LOG`` a list the class holds: shared state
            if user_code(getattr(sys.modules.get(cls.__module__), "__file__", None)):
                for key, value in vars(cls).items():
                    if not key.startswith("__") and (isinstance(
                            value, (dict, list, set, collections.deque)) or user_instance(value)):
                        self._visit(value, f"the class attribute {cls.__name__}.{key}")

    def _visit(self, value: Any, path: str) -> None:
        if id(value) in self.saved or len(self.saved) >= _LIMIT:
            return
        if isinstance(value, tuple):  # immutable itself; what it holds may not be
            for i, item in enumerate(value):
                self._visit(item, f"{path}[{i}]")
            return
        if isinstance(value, dict):
            copy: Any = dict(value)
            items = ((f"{path}[{k!r}]", v) for k, v in copy.items())
        elif isinstance(value, (list, collections.deque)):
            copy = list(value)
            items = ((f"{path}[{i}]", v) for i, v in enumerate(copy))
        elif isinstance(value, (set, frozenset)):
            copy, items = set(value), iter(())
        elif _plain_object(value):
            copy = dict(vars(value))
            items = ((f"{path}.{k}", v) for k, v in copy.items())
        else:
            return
        self.saved[id(value)] = (value, path, copy)
        for where, item in items:
            self._visit(item, where)

    def add_slot(self, slot: Any, holds_state: bool) -> None:
        """Record ``slot.owner[slot.key]`` (a global, a closure variable: ``code_reach.Slot``)
        from now on, and with ``holds_state`` what it holds: forward reaches it by name, not
        from the model."""
        before = slot.owner.get(slot.key, DELETED)
        self.slots.append((slot.owner, slot.key, before, slot.where))
        if holds_state:
            self._visit(before, slot.where)

    # ------------------------------------------------------------------ comparing
    def changes(self) -> list[Change]:
        """What differs now from the snapshot, attributes first, in a fixed order."""
        found: list[Change] = []
        for owner, key, before, path in self.slots:
            now = owner.get(key, DELETED)
            if not _same(before, now):
                found.append(Change("item", owner, key, now, path, before))
        for mod, path, own, _ in self.modules:
            found.extend(_mapping_changes("attr", mod, mod.__dict__, own, path,
                                          skip=MODULE_INTERNALS | _torch_caches(mod),
                                          saved=self.saved))
        for obj, path, copy in self.saved.values():
            if isinstance(obj, dict):
                found.extend(_mapping_changes("item", obj, obj, copy, path))
            elif isinstance(obj, list):
                now = list(obj)
                if len(now) >= len(copy) and all(a is b for a, b in zip(now, copy)):
                    if len(now) > len(copy):
                        found.append(Change("extend", obj, None, tuple(now[len(copy):]), path))
                else:
                    found.append(Change("other", obj, None, None, path))
            elif isinstance(obj, collections.deque):
                if len(obj) != len(copy) or any(a is not b for a, b in zip(obj, copy)):
                    found.append(Change("other", obj, None, None, path))
            elif isinstance(obj, set):
                if obj != copy:
                    found.append(Change("other", obj, None, None, path))
            elif not isinstance(obj, frozenset):
                found.extend(_mapping_changes("attr", obj, vars(obj), copy, path))
        return found

    def unseen_assignments(self, writes: Mapping[Any, tuple[Any, str, Any]]) -> list[Change]:
        """The assignments of plain values forward made to module attributes (``writes``:
        ``(module, name, value)``, ``guards.recorded_reads``) that the tracer itself already
        undid (torch.export puts back what it saw set on a module: ``self._step += 1``), as
        ``changes`` would have listed them."""
        found: list[Change] = []
        known = {id(mod): (path, own) for mod, path, own, _ in self.modules}
        for mod, name, value in writes.values():
            if id(mod) not in known or name in MODULE_INTERNALS or \
                    name in _torch_caches(mod) or any(name in s for s in _slots_of(mod)):
                continue
            path, own = known[id(mod)]
            before = own.get(name, DELETED)
            if mod.__dict__.get(name, DELETED) is before and _plain(value) and \
                    not _same(before, value):  # a counter, a flag (a tensor: export's own)
                found.append(Change("attr", mod, name, value,
                                    ".".join(filter(None, (path, name))), before))
        return found

    def rebound_slots(self) -> list[str]:
        """Parameter, buffer and submodule slots forward assigned (``self.seen = seen + n``
        on a buffer): qualified names."""
        rebound: list[str] = []
        for mod, path, _, slot_copies in self.modules:
            for slots, before in zip(_slots_of(mod), slot_copies):
                rebound.extend(".".join(filter(None, (path, k))) for k in slots
                               if slots[k] is not before.get(k, _MISSING))
                rebound.extend(".".join(filter(None, (path, k))) for k in before
                               if k not in slots)
        return rebound

    def rewired(self) -> list[str]:
        """What changed in the modules' own bookkeeping, which ``changes`` leaves out: a
        parameter, buffer or submodule slot added, rebound or deleted, a hook registered,
        removed or replaced, and, where none of those is found on a module, one of
        ``nn.Module``'s own attributes rebound (a hook table or the slots replaced whole,
        a table of flags); a flag a registration sets beside them is not named again.
        Each says what was done, with a word of ``REWIRED``.

        >>> layer.register_forward_hook(show); del layer.bias; snapshot.rewired()
        ["<the layer>.bias (deletes a parameter)",
         "<the layer>._forward_hooks (registers the forward hook 'show')"]
        """
        found: list[str] = []
        copies = {id(t): c for t, c in self.hooks}
        for mod, path, own, slot_copies in self.modules:
            told = len(found)
            for kind, slots, before in zip(_SLOT_KINDS, _slots_of(mod), slot_copies):
                found += [f"{_at(path, k)} ({'rebinds' if k in before else 'adds'} a {kind})"
                          for k, v in slots.items() if v is not before.get(k, _MISSING)]
                found += [f"{_at(path, k)} (deletes a {kind})" for k in before
                          if k not in slots]
            changed: list[str] = []
            for name, table in own.items():
                before = copies.get(id(table))
                if before is None or _same_items(table, before):
                    continue
                changed.append(name)
                if name in _HOOK_KINDS:
                    found += [f"{_at(path, name)} ({verb} the {_HOOK_KINDS[name]} "
                              f"{_hook_name(fn)})" for verb, fn in _hook_edits(table, before)]
                elif not any(name.startswith(f"{c}_") for c in changed):  # flags alone
                    found.append(f"{_at(path, name)} (rebinds a hook's flag)")
            if len(found) == told:  # (a hook's flag beside its table is not named again)
                found += [f"{_at(path, k)} (rebinds nn.Module's own attribute)" for k in
                          sorted(MODULE_INTERNALS) if mod.__dict__.get(k, _MISSING) is not
                          own.get(k, _MISSING)]
        return found

    # ------------------------------------------------------------------ restoring
    def restore(self) -> None:
        """Put every recorded object back as it was, in place (identities kept); a module's
        slots and hooks in their order too (``named_parameters`` is the optimizer's)."""
        for mod, _, own, slot_copies in self.modules:
            _put_back(mod.__dict__, own)  # first: a slots dict replaced whole is back
            for slots, before in zip(_slots_of(mod), slot_copies):
                _put_back_in_order(slots, before)
        for marks, before in self.marks:
            if marks != before:
                marks.clear()
                marks.update(before)
        for owner, key, before, _ in reversed(self.slots):
            if owner.get(key, DELETED) is not before:
                if before is DELETED:
                    owner.pop(key, None)
                else:
                    owner[key] = before
        for table, before in self.hooks:  # a library's on its first call, a hook's
            _put_back_in_order(table, before)
        for obj, _, copy in self.saved.values():
            if isinstance(obj, dict):
                if not _same_items(obj, copy):
                    obj.clear()
                    obj.update(copy)
            elif isinstance(obj, (list, collections.deque)):
                if len(obj) != len(copy) or any(a is not b for a, b in zip(obj, copy)):
                    obj.clear()
                    obj.extend(copy)
            elif isinstance(obj, set):
                if obj != copy:
                    obj.clear()
                    obj.update(copy)
            elif not isinstance(obj, frozenset):
                _put_back(vars(obj), copy)


def _plain(value: Any) -> bool:
    """A number, string, flag or None, or a tuple of them; a symbolic number too (a size
    read off an input under torch.export: listed, so that the capture can refuse it)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str, type(None), torch.SymInt, torch.SymFloat,
                              torch.SymBool))


def _same_items(now: dict[Any, Any], before: dict[Any, Any]) -> bool:
    """Whether a dict holds the same keys, in order, with the same values by identity."""
    return len(now) == len(before) and all(
        k1 is k2 or k1 == k2 for k1, k2 in zip(now, before)) and all(
        now[k] is v for k, v in before.items())


def _torch_caches(mod: nn.Module) -> frozenset[str]:
    """The private attributes of a layer torch itself defines: caches its forward rebuilds
    from the parameters (``nn.RNNBase._flat_weights`` under export), never user state; the
    snapshot still puts them back."""
    if not type(mod).__module__.startswith("torch."):
        return frozenset()
    return frozenset(k for k in vars(mod) if k.startswith("_"))


def _mapping_changes(kind: str, owner: Any, now: Mapping[Any, Any], before: Mapping[Any, Any],
                     path: str, skip: frozenset[str] = frozenset(),
                     saved: Mapping[int, tuple[Any, str, Any]] | None = None) -> Iterator[Change]:
    """The keys set and deleted; a module's list or dict that torch.export's non-strict
    trace put back as a copy of what it held before forward (``_rebuilt``) is no change:
    the snapshot puts the user's own back, and forward's appends to it are replayed."""
    def where(key: Any) -> str:
        if kind == "item":
            return f"{path}[{key!r}]"
        return ".".join(filter(None, (path, str(key))))

    for key, value in now.items():
        if key not in skip and not _same(before.get(key, _MISSING), value) and \
                not (saved is not None and _rebuilt(before.get(key, _MISSING), value, saved)):
            yield Change(kind, owner, key, value, where(key), before.get(key, DELETED))
    for key in before:
        if key not in skip and key not in now:
            yield Change(kind, owner, key, DELETED, where(key), before[key])


def _rebuilt(old: Any, new: Any, saved: Mapping[int, tuple[Any, str, Any]]) -> bool:
    """``new`` a list or dict of the very items ``old`` held when the snapshot was taken
    (or of such copies of the lists and dicts it held: export copies them all)."""
    if old is new:
        return True
    if type(old) is not type(new) or type(old) not in (list, dict) or id(old) not in saved:
        return False
    copy = saved[id(old)][2]
    if isinstance(new, dict):
        return list(new) == list(copy) and all(_rebuilt(copy[k], new[k], saved) for k in copy)
    return len(new) == len(copy) and all(_rebuilt(a, b, saved) for a, b in zip(copy, new))


def _same(old: Any, new: Any) -> bool:
    """``new`` is ``old``, or a tuple rebuilt of the very same items (torch.export's
    non-strict tracing rebinds a module's tuples of tensors to copies of the tuple)."""
    if old is new:
        return True
    return (type(old) is tuple and type(new) is tuple and len(old) == len(new)
            and all(_same(a, b) for a, b in zip(old, new)))


def _put_back(live: dict[Any, Any], before: dict[Any, Any]) -> None:
    """``live`` holds ``before``'s items again; only keys that differ are touched."""
    for key in [k for k in live if k not in before]:
        del live[key]
    for key, value in before.items():
        if live.get(key, _MISSING) is not value:
            live[key] = value


def _put_back_in_order(live: dict[Any, Any], before: dict[Any, Any]) -> None:
    """``live`` holds ``before``'s items again, in its order (a key deleted and set again
    goes back to its place)."""
    if not _same_items(live, before):
        live.clear()
        live.update(before)


#: words ``rewired`` says what was done with: ``live_hooks`` tells a rewiring by them
REWIRED = ("(adds a ", "(rebinds ", "(deletes a ", "(registers the ", "(removes the ",
           "(replaces the ")
_SLOT_KINDS = ("parameter", "buffer", "submodule")
_HOOK_KINDS = {"_forward_hooks": "forward hook", "_forward_pre_hooks": "forward pre-hook",
               "_backward_hooks": "backward hook", "_backward_pre_hooks": "backward pre-hook",
               "_state_dict_hooks": "state_dict hook",
               "_state_dict_pre_hooks": "state_dict pre-hook",
               "_load_state_dict_pre_hooks": "load_state_dict pre-hook",
               "_load_state_dict_post_hooks": "load_state_dict post-hook"}


def _at(path: str, key: str) -> str:
    return ".".join(filter(None, (path, key)))


def _hook_edits(table: dict[Any, Any], before: dict[Any, Any]) -> Iterator[tuple[str, Any]]:
    """(what was done, the hook) for each entry of a hook table that differs."""
    for key, fn in table.items():
        if key not in before:
            yield "registers", fn
        elif fn is not before[key]:
            yield "replaces", before[key]
    for key, fn in before.items():
        if key not in table:
            yield "removes", fn


def _hook_name(fn: Any) -> str:
    """A hook by its function's name, under the wrappers a step puts around it
    (``live_hooks.WatchedHook``, a ``per_microbatch`` mark)."""
    for _ in range(8):  # (a wrapper that wraps itself: named as it is)
        inner = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return repr(getattr(fn, "__qualname__", None) or type(fn).__name__)


def _slots_of(mod: nn.Module) -> tuple[dict[str, Any], ...]:
    return mod._parameters, mod._buffers, mod._modules


def _hook_tables(mod: nn.Module) -> list[dict[Any, Any]]:
    """Every dict of hooks (and hook flags) a module keeps, as ``Module.__init__`` makes them."""
    return [v for k, v in vars(mod).items() if "hook" in k and isinstance(v, dict)]


@contextlib.contextmanager
def python_state_kept(model: nn.Module, inputs: Mapping[str, Any] | None = None
                      ) -> Iterator[Snapshot]:
    """Record the Python state reachable from ``model`` (and from ``inputs``, the call's
    non-tensor arguments, by name) for the block, and put it back when the block ends,
    on success or error. The snapshot yielded says what the block changed (``changes``,
    ``rebound_slots``): ask it before the block ends.
    """
    snapshot = Snapshot({"": model, **{f"<argument {k!r}>": v for k, v in
                                       (inputs or {}).items()}})
    try:
        yield snapshot
    finally:
        snapshot.restore()
