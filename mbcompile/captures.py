"""The captures of one compile, kept for its variants: each made once, decided per request.

>>> captures = Captures(gbs=7)
>>> first = captures.analysed(request)                           # captured and analysed
>>> again = captures.analysed(request.for_batch(3, call))        # the same capture, cut for 3

A capture and its batch facts depend on what the call hands the graph (the inputs by
name, their batch dims and their shapes besides the batch dim, the values fixed at
compile time), on the model's train/eval mode, on what fills its parameter, buffer
and submodule slots, on its hooks, and on the Python values forward read (the
capture's guards, ``passes/guards.py``). Those are the key; the batch size is not:
the batch dim is symbolic and the facts hold at any batch of two or more samples
(``analysis.reusable`` says where not). So another batch size, or a train/eval mode
seen before, needs only the decisions (``analyse(..., found=)``: mode, kept outputs,
the cut at its batch), a plan and a lowering. A sequence length made symbolic can join
the key the same way (leave its dim out of the shapes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mbcompile.analysis import Analysed, analyse, find, reusable
from mbcompile.guard_cache import GuardCache
from mbcompile.inputs import input_layout
from mbcompile.mode_key import hooks_key, slots
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.request import Request

__all__ = ["Captures", "capture_key"]


def capture_key(request: Request) -> tuple[Any, ...]:
    """What ``request``'s capture depends on besides the batch size and the guards."""
    inputs = request.inputs
    modules = tuple(request.inner.modules())
    concrete = tuple((name, repr(value)) for name, value in inputs.concrete.items())
    return (inputs.names, inputs.in_dims, concrete, input_layout(inputs, request.values),
            tuple(m.training for m in modules), slots(modules),
            hooks_key(modules, frozenset()))


class Captures:
    """The analysed captures of one compile by ``capture_key``, each valid while its guards
    hold (a ``GuardCache``); shared by the compiled module and its variants."""

    def __init__(self, gbs: int) -> None:
        self._cache = GuardCache()
        self.gbs = gbs  #: the batch facts are found at (the first request's, when it is 2+)
        #: (captured graph's id, symbolic dims, adopt) -> (the graph, the proved bounds)
        self._proved: dict[Any, tuple[Any, Any]] = {}

    def analysed(self, request: Request, plan: MicrobatchPlan | None = None) -> Analysed:
        """``request``'s graph analysed and decided (``plan``: the plan it is decided for,
        see ``analyse``), on an earlier capture where one serves."""
        key = capture_key(request)
        found, _ = self._cache.find(key)
        if found is not None and reusable(found, request.gbs):
            decided = analyse(request, plan=plan, found=found)
            if found.cut is None and decided.cut is not None:  # its body serves the next
                self._keep(key, found, decided)
            return decided
        if found is not None or self.gbs < 2 or request.gbs == self.gbs:
            fresh = find(request)  # for this batch only, or at the batch of the others
        else:  # a new key's capture serves every batch: its facts at the first request's
            fresh = find(dataclasses.replace(request, gbs=self.gbs))
        if found is None:  # one that holds at this batch only stays out of the cache
            self._cache.put(key, fresh)
        if not reusable(fresh, request.gbs):
            return analyse(request, plan=plan)
        decided = analyse(request, plan=plan, found=fresh)
        if found is None and decided.cut is not None:
            self._keep(key, fresh, decided)
        return decided

    def _keep(self, key: Any, entry: Analysed, decided: Analysed) -> None:
        """``decided`` in place of ``entry``: the same capture, with a cut to start from."""
        entries = self._cache[key]
        entries[next(i for i, e in enumerate(entries) if e is entry)] = decided

    def proved(self, request: Request, graph: Any, prove: Callable[[Request], Request],
               adopt: bool = True) -> Request:
        """``request`` with its symbolic dims as ``prove`` (``checked_symbolic``, which
        compiles again at other lengths) bounds them, proved once per captured ``graph``:
        a variant on the same capture (another batch size or keyword set) takes the first
        verdict. A refusal is not kept (it raises, and each try proves again)."""
        if not request.inputs.symbolic:
            return request
        key = (id(graph), _frozen(request.inputs.symbolic), adopt)
        kept = self._proved.get(key)
        if kept is None or kept[0] is not graph:  # the id of a graph since collected
            kept = self._proved[key] = (graph, prove(request).inputs.symbolic)
        return dataclasses.replace(request, inputs=dataclasses.replace(request.inputs,
                                                                       symbolic=kept[1]))

    def __getstate__(self) -> dict[str, Any]:
        # graphs do not pickle (fx re-traces them): a copy captures again on first use
        return {"_cache": GuardCache(), "gbs": self.gbs, "_proved": {}}


def _frozen(symbolic: Any) -> tuple[Any, ...]:
    """Symbolic dims (input -> dim -> bounds) as a key."""
    return tuple(sorted((name, tuple(sorted(dims.items()))) for name, dims in symbolic.items()))
