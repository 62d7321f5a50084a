"""Tensors forward writes into Python state, under torch.export: extra outputs of the trace.

torch.export traces forward on fake tensors, then puts back every module attribute it saw
assigned (with only a warning for a tensor), so ``self.last = loss.detach()`` left no
trace of itself: the step ran and the attribute kept its old value. Under ``capture="fx"``
such a write is replayed once per step (``side_effects.py``), the traced value being one
more graph output. This pass gives export the same: the exported forward
(``keyword_view``'s) calls the model, and then, still inside the trace, asks the
snapshot what forward changed; every change (and every recorded ``print``) that holds a
traced tensor is kept, and its tensors are returned beside the model's output. After the
export they are graph nodes, handed to ``record_effects`` as proxies of those nodes, as
the fx capture hands its own.

Before (``forward``: ``self.last = loss.detach(); self.stats["acc"] = acc``)::

    exported forward returns  loss                   # self.last: put back, lost

After (``export(keyword_view(model, names, after=writes))``)::

    exported forward returns  (loss, (detach, acc))   # SetAttr(last, _Out(1)), SetItem(...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError
from .legacy_weights import legacy_weights
from .print_calls import LevelRead, PrintCall
from .python_state import Change, Snapshot
from .side_effects import map_leaves, tensors_in

__all__ = ["TensorWrites", "export_warning_dropped", "refuse_tensors"]


class TensorWrites:
    """Called at the end of the traced forward: the tensors its recorded changes and prints
    hold, in a fixed order (``__call__``); after the export, those changes and prints with
    each tensor replaced by a proxy of the node that computes it (``as_proxies``)."""

    def __init__(self, snapshot: Snapshot, prints: list[PrintCall | LevelRead]) -> None:
        self.snapshot = snapshot
        self.prints = prints
        # set after each step by their own record (``legacy_weights.SetLegacyWeight``)
        self.legacy = legacy_weights(module for module, *_ in snapshot.modules)
        self.changes: list[Change] = []
        self.calls: list[PrintCall] = []
        self.tensors: list[torch.Tensor] = []
        # a parameter or buffer itself (``self.snap = self.run``): no output, the model's
        # own tensor at replay (as an output, its write-back's copy_ became the output's)
        self.state: dict[int, tuple[torch.nn.Module, str]] = {}

    def __call__(self) -> tuple[torch.Tensor, ...]:
        self.changes = [c for c in self.snapshot.changes() if tensors_in(c.value)
                        and (id(c.owner), c.key) not in self.legacy]
        self.calls = [p for p in self.prints
                      if isinstance(p, PrintCall) and tensors_in((p.args, p.kwargs))]
        state = {id(t): (m, n) for m, *_ in self.snapshot.modules
                 for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None}
        seen: set[int] = set()
        for t in tensors_in([[c.value for c in self.changes],
                             [(p.args, p.kwargs) for p in self.calls]]):
            if id(t) in state:
                self.state[id(t)] = state[id(t)]
            elif id(t) not in seen:
                seen.add(id(t))
                self.tensors.append(t)
        return tuple(self.tensors)

    def as_proxies(self, nodes: Sequence[Any]) -> tuple[list[Change], list[PrintCall]]:
        """The changes and prints held, each tensor the ``nodes[i]`` the export made of
        ``tensors[i]`` (a proxy of it, as ``record_effects`` reads the fx trace's)."""
        proxy = {id(t): fx.Proxy(n) if isinstance(n, fx.Node) else n
                 for t, n in zip(self.tensors, nodes, strict=True)}
        proxy.update((i, getattr(m, n)) for i, (m, n) in self.state.items())

        def swap(value: Any) -> Any:
            return _mapped(value, proxy)

        changes = [dataclasses.replace(c, value=swap(c.value)) for c in self.changes]
        calls = [dataclasses.replace(p, args=swap(p.args), kwargs=swap(p.kwargs))
                 for p in self.calls]
        return changes, calls

    def merged(self, changes: Sequence[Change], prints: Sequence[PrintCall | LevelRead],
               nodes: Sequence[Any]) -> tuple[list[Change], list[PrintCall | LevelRead]]:
        """``changes`` and ``prints`` as the final snapshot has them, with those that hold a
        tensor replaced by the ones held here, as proxies; a write torch.export put back
        (an attribute assigned) is only held here, and is added."""
        held, calls = self.as_proxies(nodes)
        mine = {_key(c): c for c in held}
        out = [mine.pop(_key(c), c) if tensors_in(c.value) else c for c in changes]
        swapped = dict(zip(map(id, self.calls), calls, strict=True))
        return out + list(mine.values()), [swapped.get(id(p), p) for p in prints]


def _key(change: Change) -> tuple[str, int, Any]:
    return change.kind, id(change.owner), change.key


def _mapped(value: Any, proxy: dict[int, Any]) -> Any:
    """``value`` with every tensor ``proxy`` names replaced, through tuples, lists, dicts."""
    return map_leaves(value, lambda t: proxy.get(id(t), t), torch.Tensor)


def refuse_tensors(changes: Sequence[Change], prints: Sequence[PrintCall | LevelRead],
                   model_name: str, fx_error: BaseException | None = None,
                   tensors: bool = True) -> None:
    """Under torch.export: an effect that holds a symbolic size is refused, and one that
    holds a tensor where ``tensors`` (a trace whose tensors no graph output maps:
    ``export_writes.py`` maps the others). The fix names the fx capture, which replays
    them, unless fx already failed on this forward (``fx_error``): then what made it fail,
    and the way around both."""
    held = [(c.where, c.value) for c in changes] + [
        (f"print at {p.where}", (p.args, p.kwargs)) for p in prints if isinstance(p, PrintCall)]
    for where, value in held:
        found: list[Any] = []
        if tensors:
            map_leaves(value, found.append, torch.Tensor)
        if found:
            raise CaptureError(
                f"{model_name}.forward writes a tensor to {where}; under torch.export mbcompile "
                "cannot replay that write once per step with the full batch's value. "
                + _fx_fix(fx_error, "it replays such writes",
                          "return the value from forward and store it outside"))
        # a size read off an input is symbolic there (the batch dim, a length that varies):
        # replayed as it is, it would leave export's symbol (``s23``) in the user's state
        map_leaves(value, found.append, (torch.SymInt, torch.SymFloat, torch.SymBool))
        if found and not isinstance(found[0], torch.SymInt):  # loss.item(): a float symbol
            raise CaptureError(
                f"{model_name}.forward writes a Python number read off a traced tensor "
                f"({found[0]}: .item(), float(t)) to {where}; the compiled step computes "
                "the full batch's value as a tensor and cannot make it a Python number "
                "without waiting for the device. Fix: store the tensor (loss.detach()) and "
                "call .item() outside forward")
        if found:
            raise CaptureError(
                f"{model_name}.forward writes a size read off an input ({found[0]}) to "
                f"{where}; under torch.export that size is symbolic, and mbcompile cannot "
                "replay it with each call's value. "
                + _fx_fix(fx_error, "it replays x.shape, x.size() and x.shape[0] with the full "
                          "batch's sizes; tuple(x.shape) it cannot trace",
                          "read the size outside forward"))


def _fx_fix(fx_error: BaseException | None, why: str, otherwise: str) -> str:
    """The fix of an effect export cannot replay: the fx capture, or (fx failed) the rest."""
    if fx_error is None:
        return f"Fix: compile with capture='fx' ({why}), or {otherwise}"
    return (f"The torch.fx capture ({why}) failed first on this forward: "
            f"{str(fx_error).splitlines()[0]}. Fix: make forward traceable by torch.fx, or "
            f"{otherwise}")


@contextmanager
def export_warning_dropped() -> Iterator[None]:
    """torch.export warns of each tensor attribute forward assigned (it puts them back);
    the writes are replayed once per step instead, so the warning would mislead."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The tensor attributes? .* assigned during "
                                "export")
        yield
