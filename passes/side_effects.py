"""Side effects of forward on Python objects: recorded at capture, replayed once per step.

Tracing runs forward once, on proxies; the Python state it wrote is put back
(``python_state.Snapshot``) and compared with what it was, and each difference becomes a
record: an attribute assigned or deleted, a dict key set or deleted, a list appended to or
extended; a ``print`` or a ``logging`` call is recorded where it is made (nothing is
printed or logged while tracing). A traced value held by an effect (``loss.detach()``)
becomes one more output of the captured graph, after the model's own, so the microbatch
rewrite combines it like any output: a per-sample tensor concatenated in order, a loss
from the global sums. After a
successful step the compiled module calls ``replay``: each effect happens once, with the
full batch's values, as in eager (dynamo's ``SideEffects`` does the same after its graph).

Before::

    def forward(self, x, y):
        loss = F.mse_loss(self.lin(x), y)
        self.stats["loss"] = loss.detach()
        self.history.append(x.mean().detach())
        print("loss", loss.detach())
        return loss

Recorded (``Effects``)::

    SetItem(stats, 'loss', Held(_Out(1)))     # graph outputs: (loss, detach, detach_1)
    Extend(history, Held((_Out(2),)))
    Print(print, Held(('loss', _Out(1))), Held({}))

What cannot be made exact is refused at capture, before anything changes: a Python
number read off a traced value (``loss.item()``), a traced value inside an object that
is not a plain container, a list changed other than by appending, a set or deque
written, the call's own arguments written.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake

from .errors import CaptureError
from .guards import MISSING, Guard, plain, written_guard
from .print_calls import LevelRead, PrintCall, level_guard, prints_recorded
from .python_state import DELETED, Change
from .sources import source_line

__all__ = ["NO_EFFECTS", "Effects", "Extend", "Held", "Print", "SetAttr", "SetItem",
           "map_leaves", "prints_recorded", "record_effects", "replay", "rewiring_refused",
           "tensors_in"]

#: ``item()`` and its kind: a Python number read off a tensor, which a graph output cannot be
_HOST_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "numpy"})


@dataclass(frozen=True)
class _Out:
    """Stands for flat output ``index`` of the compiled call inside a held value."""

    index: int


@dataclass(frozen=True)
class Held:
    """A value an effect writes: ``value`` as forward built it, with each traced value
    replaced by an ``_Out`` (lists, tuples and dicts are rebuilt on every replay, so no
    two steps share one; a value without traced parts is kept as it is, by identity)."""

    value: Any
    traced: bool = False

    def rebuild(self, flat: Sequence[Any]) -> Any:
        return map_leaves(self.value, lambda o: flat[o.index], _Out) if self.traced else self.value


@dataclass(frozen=True)
class SetAttr:
    """``owner.name = value`` (``value is None`` with ``delete``: ``del owner.name``)."""

    owner: Any
    name: str
    value: Held | None
    where: str

    def apply(self, flat: Sequence[Any]) -> None:
        if self.value is None:
            if self.name in vars(self.owner):
                delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.value.rebuild(flat))


@dataclass(frozen=True)
class SetItem:
    """``owner[key] = value`` (``value is None``: ``del owner[key]``)."""

    owner: Any
    key: Any
    value: Held | None
    where: str

    def apply(self, flat: Sequence[Any]) -> None:
        if self.value is None:
            self.owner.pop(self.key, None)
        else:
            self.owner[self.key] = self.value.rebuild(flat)


@dataclass(frozen=True)
class Extend:
    """``owner.extend(values)``: what forward appended to a list."""

    owner: list[Any]
    values: Held
    where: str

    def apply(self, flat: Sequence[Any]) -> None:
        self.owner.extend(self.values.rebuild(flat))


@dataclass(frozen=True)
class Print:
    """A call forward made to ``print`` (``target``: the real one) or to a logger's
    ``_log`` (``target``: it, bound to the logger and level), with its arguments."""

    target: Callable[..., Any]
    args: Held
    kwargs: Held
    where: str

    def apply(self, flat: Sequence[Any]) -> None:
        self.target(*self.args.rebuild(flat), **self.kwargs.rebuild(flat))


Effect = SetAttr | SetItem | Extend | Print


@dataclass(frozen=True)
class Effects:
    """A capture's effects, in the order they are replayed; ``outputs``: the traced values
    they hold, appended to the graph's outputs (``_Out`` indices count from the first)."""

    records: tuple[Effect, ...] = ()
    outputs: tuple[fx.Node, ...] = field(default=(), compare=False)
    guards: tuple[Guard, ...] = ()  # plain values written over others: see ``written_guard``
    written: frozenset[int] = frozenset()  # ids of the containers and objects written


    def __bool__(self) -> bool:
        return bool(self.records)

    def keys_set(self) -> dict[int, set[Any]]:
        """The keys forward sets, by the id of the dict (or other container) it sets them in,
        and the attributes it sets on objects that are not modules."""
        keys: dict[int, set[Any]] = {}
        for record in self.records:
            if isinstance(record, SetItem) and record.value is not None or isinstance(
                    record, SetAttr) and not isinstance(record.owner, nn.Module):
                keys.setdefault(id(record.owner), set()).add(
                    record.key if isinstance(record, SetItem) else record.name)
        return keys


NO_EFFECTS = Effects()


def replay(effects: Effects, flat: Sequence[Any]) -> None:
    """Apply ``effects`` once, with ``flat`` (the compiled call's flat outputs, extras
    included): called after a successful step, after the state write-back."""
    for effect in effects.records:
        effect.apply(flat)


# --------------------------------------------------------------------------- recording




def map_leaves(value: Any, fn: Callable[[Any], Any], kind: type | tuple[type, ...]) -> Any:
    """``value`` with every leaf of type ``kind`` replaced by ``fn(leaf)``, through tuples
    (named ones too), lists and dicts."""
    if isinstance(value, kind):
        return fn(value)
    if isinstance(value, tuple):
        items = [map_leaves(v, fn, kind) for v in value]
        if hasattr(value, "_fields"):
            return type(value)(*items)
        try:
            return type(value)(items)
        except TypeError:  # a torch.Size holds ints only, not what ``fn`` made of its sizes
            return tuple(items)
    if isinstance(value, list):
        return type(value)(map_leaves(v, fn, kind) for v in value)
    if isinstance(value, dict):
        out = value.copy()
        for k, v in value.items():
            out[k] = map_leaves(v, fn, kind)
        return out
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors ``value`` holds through tuples, lists and dicts, in order."""
    found: list[torch.Tensor] = []
    map_leaves(value, found.append, torch.Tensor)
    return found


class _Recorder:
    """Turns changes and prints into effect records, numbering the traced values."""

    def __init__(self, model_name: str, first_output: int, returned: dict[fx.Node, int]
                 ) -> None:
        self.model_name = model_name
        self.first = first_output
        self.outputs: list[fx.Node] = []
        self.index: dict[fx.Node, int] = dict(returned)

    def held(self, value: Any, what: str) -> Held:
        traced = False

        def out(proxy: fx.Proxy) -> _Out:
            nonlocal traced
            traced = True
            node = proxy.node
            _check_exact(node, what, self.model_name)
            if node not in self.index:
                self.index[node] = self.first + len(self.outputs)
                self.outputs.append(node)
            return _Out(self.index[node])

        mapped = map_leaves(value, out, fx.Proxy)
        _check_no_hidden_proxy(mapped, what, self.model_name)
        texts: list[str] = []
        map_leaves(value, texts.append, str)
        if any(_traced_text(t) for t in texts):
            raise CaptureError(
                f"{self.model_name}.forward writes {what} a string formatted from a traced "
                "value (f\"{loss}\", str(x.dtype) under torch.fx); the string holds no value "
                "to write at each step. Fix: store the tensor or the number itself, and "
                "format it outside forward")
        return Held(mapped, True) if traced else Held(value)


def _traced_text(text: str) -> bool:
    """Text formatted from a traced value: fx's proxy or export's fake tensor, as printed."""
    return "Proxy(" in text or "FakeTensor(" in text


def _check_exact(node: fx.Node, what: str, model_name: str) -> None:
    """A traced Python number (``loss.item()``) has no value a graph output can carry."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_method" and n.target in _HOST_READS:
            raise CaptureError(
                f"{model_name}.forward writes {what} a Python number read off a tensor "
                f"({source_line(n)}: .{n.target}()); the compiled step computes the full "
                "batch's value as a tensor and cannot make it a Python number without "
                "waiting for the device. Fix: store the tensor (loss.detach()) and call "
                ".item() outside forward")
        if n.op == "call_function" and n.target in (int, float, bool):
            todo.extend(n.all_input_nodes)


def _check_no_hidden_proxy(value: Any, what: str, model_name: str) -> None:
    """A traced value (an fx proxy, export's fake tensor) inside an object that is not a
    tuple, list or dict: replayed, the user's state would hold the tracer's object."""
    holder = _traced_holder(value, None, 4, set())
    if holder is not None:
        raise CaptureError(
            f"{model_name}.forward writes {what} a {type(holder).__name__} that holds a traced "
            "tensor; mbcompile replays a write of tensors held in tuples, lists and dicts "
            "only. Fix: store the tensor itself, or a dict of tensors")


def _traced_holder(value: Any, holder: Any, depth: int, seen: set[int]) -> Any:
    """The first object (not a container) holding a traced value in ``value``, ``depth``
    levels down (the value itself where only containers hold it); ``None`` where there is
    none. A module's own tensors are its state."""
    if isinstance(value, fx.Proxy) or (isinstance(value, torch.Tensor) and is_fake(value)):
        return value if holder is None else holder  # in a container: no output mapped it
    if depth == 0 or id(value) in seen or isinstance(value, (torch.Tensor, nn.Module, type,
                                                              types.ModuleType)):
        return None
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    elif hasattr(value, "__dict__") and not callable(value):
        holder, items = value, vars(value).values()
    else:
        return None
    for item in items:
        found = _traced_holder(item, holder, depth - 1, seen)
        if found is not None:
            return found
    return None


def record_effects(changes: Sequence[Change], prints: Sequence[PrintCall | LevelRead],
                   model_name: str, first_output: int = 0,
                   returned: Mapping[fx.Node, int] | None = None) -> Effects:
    """The effects of one trace: ``changes`` (``Snapshot.changes``) and ``prints`` (with the
    logger levels forward asked about, guarded: ``print_calls.level_guard``). Traced
    values become outputs numbered from ``first_output``, except those forward returns
    (``returned``: node -> its output index). Raises ``CaptureError`` for a change that
    cannot be replayed exactly, naming it and the fix."""
    rec = _Recorder(model_name, first_output, dict(returned or {}))
    records: list[Effect] = []
    guards: list[Guard] = []
    for change in changes:
        # a module's attribute path, or a place named in full (an argument, a global)
        what = change.where if change.where.startswith(("<", "the ")) else f"self.{change.where}"
        if change.where.startswith("<argument"):
            raise CaptureError(
                f"{model_name}.forward writes into {change.where}, an object the caller "
                "passed; the compiled module would write into the example's object, once. "
                "Fix: return the value from forward and store it in the caller")
        if change.kind == "other":
            raise CaptureError(
                f"{model_name}.forward changes {what} other than by appending to a list, "
                "setting a dict key or assigning an attribute (an insert, a pop, a sort, "
                "writing a set or deque); the trace ran it once, on traced values, and "
                "mbcompile cannot replay it exactly. Fix: append to a list (or set a dict "
                "key) in forward, or change the container outside forward")
        value = None if change.value is DELETED else rec.held(change.value, f"to {what}")
        if change.kind != "extend" and (value is None or not value.traced or (
                change.before is DELETED and isinstance(change.value, (list, dict)))) and \
                not isinstance(change.owner, nn.Module):
            # a plain value written into a container or object may be computed from the one
            # it replaces (a counter in a dict): exact only while that one is as traced; so
            # may a list forward put where there was none (``d.setdefault("k", []).append``):
            # while the key is missing (then compiled again, appending to the one there)
            guards.append(written_guard(change.owner, change.key,
                                        MISSING if change.before is DELETED else change.before,
                                        change.kind == "item", what))
        if change.kind == "attr":
            records.append(SetAttr(change.owner, change.key, value, what))
        elif change.kind == "item":
            records.append(SetItem(change.owner, change.key, value, what))
        else:
            assert value is not None
            records.append(Extend(change.owner, value, what))
    written = frozenset(id(c.owner) for c in changes)
    # a module's repr shows its layers, not the attributes forward assigns
    containers = frozenset(id(c.owner) for c in changes if not isinstance(c.owner, nn.Module))
    guards.extend(_unwritten_keys(changes))
    guards.extend(level_guard(r) for r in prints if isinstance(r, LevelRead))
    for call in prints:
        if isinstance(call, LevelRead):
            continue
        shown = (*call.args, *call.kwargs.values())
        if _holds(shown, containers):
            raise CaptureError(
                f"{model_name}.forward prints a container or object it also changes at "
                f"{call.where}; a print is replayed after the step's writes, with the values "
                "the trace held, so it would not show what eager shows there. Fix: print "
                "the values themselves (print('loss', loss.detach())), or print the "
                "container from the training loop")
        if any(isinstance(a, str) and _traced_text(a) for a in shown):
            raise CaptureError(
                f"{model_name}.forward formats a traced tensor into a string it prints at "
                f"{call.where}; the string holds no value to print at each step. Fix: pass "
                "the tensor to print as its own argument (print('loss', loss.detach()))")
        records.append(Print(call.target, rec.held(call.args, f"to print at {call.where}"),
                             rec.held(call.kwargs, f"to print at {call.where}"), call.where))
    return Effects(tuple(records), tuple(rec.outputs), tuple(guards), written)


def _unwritten_keys(changes: Sequence[Change]) -> list[Guard]:
    """Guards on the keys of each dict, and the attributes of each object (not a module's:
    those are guarded as read), that forward writes some of and leaves the others
    (``self.stats["loss"] = ...`` beside ``self.stats["scale"]``): the container's own guard
    is dropped (``guards.unwritten``), so what forward reads of the others would be fixed.
    A plain value is guarded by value, anything else by identity."""
    written: dict[int, set[Any]] = {}
    owners: dict[int, tuple[Any, str]] = {}
    for change in changes:
        written.setdefault(id(change.owner), set()).add(change.key)
        cut = "[" if change.kind == "item" else "."
        what = change.where if change.where.startswith(("<", "the ")) else f"self.{change.where}"
        # a global or closure variable itself (no ``[``) is a slot, guarded as read
        if change.kind in ("attr", "item") and cut in what and (
                isinstance(change.owner, dict) or hasattr(change.owner, "__dict__")) and \
                not isinstance(change.owner, (nn.Module, types.ModuleType)) and \
                not _namespace(change.owner):
            owners[id(change.owner)] = (change.owner, what.rsplit(cut, 1)[0])
    guards = []
    for key, (owner, path) in owners.items():
        item = isinstance(owner, dict)
        for name, value in list((owner if item else vars(owner)).items()):
            if name in written[key]:
                continue
            where = f"{path}[{name!r}]" if item else f"{path}.{name}"
            guards.append(Guard(owner, name, value, item, where, identity=not plain(value)))
    return guards


def _namespace(owner: Any) -> bool:
    """A module's globals (written through ``global``; each guarded as read)."""
    module = sys.modules.get(owner.get("__name__", "")) if isinstance(owner, dict) else None
    return module is not None and vars(module) is owner


def _holds(value: Any, ids: frozenset[int], depth: int = 4) -> bool:
    """Whether ``value`` is, or holds in a tuple, list or dict (``depth`` levels down), an
    object whose ``id`` is in ``ids``."""
    if id(value) in ids:
        return True
    if depth and isinstance(value, (tuple, list)):
        return any(_holds(v, ids, depth - 1) for v in value)
    if depth and isinstance(value, dict):
        return any(_holds(v, ids, depth - 1) for v in value.values())
    return False


def rewiring_refused(rewired: Sequence[str], model_name: str) -> None:
    """A ``CaptureError`` where forward rewired the modules while it was traced (registered
    a hook, added a parameter: ``Snapshot.rewired``). The trace puts that back, while the
    attribute writes beside it are replayed after each step, so the model would be left
    unlike eager's: transformers registers its output-capturing hooks on the first call that
    asks for hidden states or attentions, and sets ``_output_capturing_hooks_installed``,
    which would then stay set on a model without the hooks (every later call, eager ones
    too, returning no hidden states)."""
    if rewired:
        raise CaptureError(
            f"{model_name}.forward rewires modules while it runs: "
            f"{'; '.join(rewired[:3])}{'; ...' if len(rewired) > 3 else ''}. Tracing puts "
            "that back, so the compiled step cannot do what eager's first call does, and "
            "nothing was changed. Fix: make that call once eagerly before compile() (for "
            "transformers' output_hidden_states or output_attentions: one eager call with "
            "them set installs its hooks for good), or register hooks outside forward")

