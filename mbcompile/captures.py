"""The captures of one compile, kept for its variants: each made once, decided per request.

>>> captures = Captures(gbs=7)
>>> first = captures.analysed(request)                           # captured and analysed
>>> again = captures.analysed(request.for_batch(3, call))        # the same capture, cut for 3

A capture and its batch facts depend on what the call hands the graph (the inputs by
name, their batch dims and their shapes besides the batch dim, the values fixed at
compile time), on the model's train/eval mode, on what fills its parameter, buffer and
submodule slots, on their dtypes and devices, on its hooks, and on the Python values
forward read (the capture's guards, ``passes/guards.py``). Those are the key; the batch
size is not: the batch dim is symbolic and the facts hold at any batch of two or more
samples (``analysis.reusable`` says where not). So another batch size, or a train/eval
mode seen before, needs only the decisions (``analyse(..., found=)``: mode, kept
outputs, the cut at its batch), a plan and a lowering. A sequence length made symbolic
can join the key the same way (leave its dim out of the shapes).

A train/eval mode not seen before reuses a capture made in the other mode where the
graph is the same (``_in_other_mode``): its trace read no ``training`` flag that changed
(each flag a trace reads is one of its guards), and the layers it calls as single nodes
whose mode changed are torch's own, which read their mode when they run and compute
the same shapes in both. Then only the batch facts are found again, on a copy of the
graph (``analysis.in_current_mode``): milliseconds, where a capture and its shape pass
take a third of a second on the tiny GPT. A trace that read a changed flag (export runs
``nn.Dropout``'s forward, ``F.dropout(x, training=self.training)``) is captured again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn as nn

from mbcompile.analysis import Analysed, analyse, find, in_current_mode, reusable
from mbcompile.errors import UnsupportedOpError
from mbcompile.guard_cache import GuardCache
from mbcompile.inputs import input_layout
from mbcompile.integrations.transformers import install_output_hooks
from mbcompile.mode_key import key_of, slots
from mbcompile.passes.guards import failed_guard
from mbcompile.passes.rules import lookup_rule
from mbcompile.passes.rules.registry import MODE_FREE_RULES
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.request import Request

__all__ = ["Captures", "capture_key"]

_MODE = 4  #: the place of the modules' train/eval flags in ``capture_key``


def capture_key(request: Request) -> tuple[Any, ...]:
    """What ``request``'s capture depends on besides the batch size and the guards."""
    inputs = request.inputs
    modules = tuple(request.inner.modules())
    concrete = tuple((name, repr(value)) for name, value in inputs.concrete.items())
    # then the compiled module's mode key of the same modules (training flags at ``_MODE``)
    return (inputs.names, inputs.in_dims, concrete, input_layout(inputs, request.values),
            *key_of(modules, slots(modules), frozenset()))


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
        see ``analyse``), on an earlier capture where one serves. A transformers model
        asked for outputs its layers' hooks record (by the call, or by its config since)
        gets those hooks first, as eager's call installs them (``install_output_hooks``):
        the key and any trace see the model as eager's call leaves it."""
        install_output_hooks(request.inner, request.example)
        key = capture_key(request)
        found, _ = self._cache.find(key)
        if found is None:
            found = self._in_other_mode(key, request)
            if found is not None:
                self._cache.put(key, found)
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

    def _in_other_mode(self, key: tuple[Any, ...], request: Request) -> Analysed | None:
        """A capture of ``key`` but for the train/eval flags, whose graph holds in the
        current mode too, analysed in it; None where there is none (module docstring)."""
        modules = tuple(request.inner.modules())
        rest = key[:_MODE] + key[_MODE + 1:]
        for other, entries in self._cache.items():
            if other[:_MODE] + other[_MODE + 1:] != rest:
                continue
            changed = {id(m) for m, was, now in zip(modules, other[_MODE], key[_MODE])
                       if was != now}
            for entry in entries:
                # a guard on a flag that changed fails here: that trace branched on it
                if failed_guard(entry.guards) is not None:
                    continue
                layers = _layers_called(entry.state.graph_module, changed)
                if not all(map(_torch_layer, layers.values())):
                    continue  # a user's layer kept whole: its shapes may follow the mode
                if not any(_facts_read_mode(node, m) for node, m in layers.items()):
                    # the same graph and facts; what a step keeps and the cut are this
                    # mode's (``analysed`` keeps them for the mode's next batch sizes)
                    return dataclasses.replace(entry, kept=None, cut=None)
                derived = in_current_mode(entry, request)
                # an op without a rule: capture="auto" may export instead (analysis.py)
                if not isinstance(derived.rejected, UnsupportedOpError):
                    return derived
        return None

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

def _layers_called(gm: fx.GraphModule, changed: set[int]) -> dict[fx.Node, nn.Module]:
    """The layers whose mode ``changed`` that ``gm`` calls as single nodes (in the parts it
    calls too), by node."""
    found: dict[fx.Node, nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, fx.GraphModule):
                found.update(_layers_called(module, changed))
            elif id(module) in changed:
                found[node] = module
    return found


def _torch_layer(module: nn.Module) -> bool:
    """One of torch's own layers (``nn.Dropout``, ``nn.BatchNorm1d``): it reads its mode
    when it runs, with the same shapes in both. A user's layer kept whole
    (``mbcompile.trust_module``) may return other shapes in another mode: its graph is
    captured again."""
    return type(module).__module__.startswith("torch.nn.")


def _facts_read_mode(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``module``'s batch fact may differ by mode (BatchNorm mixes samples in
    training only; a rule a user registered may read the mode too)."""
    return lookup_rule(node, module) not in MODE_FREE_RULES
