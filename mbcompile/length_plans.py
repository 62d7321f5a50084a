"""A call's split from its length: the compiled module's side of ``planning/length_split.py``.

>>> split = call_split(request, selection, lowered)   # at compile (None: nothing varies)
>>> split.mbs_for(values)                              # per call, microseconds
(4, 16)
>>> for_split(cm, 4, 16)(*args)                        # the module of that split, made once

A module whose sequence length is symbolic, compiled with ``mbs="auto"`` or a token budget
(``mbs={"tokens": n}``), chooses each call's MBS from the call's length; a split other
than its own plan's runs in a module lowered for it from the same capture and analysis
(no capture, no probe: a plan and a lowering), made once per MBS and kept. The length
model (``planning/length_cost.py``) is built once per cost model and kept with it, so the
module's variants (another batch size) reuse it.

On ranks (``backend="torch.distributed"``) each rank chooses the split of its own call, at
its own length: ranks may run different numbers of microbatches in one step. That is
exact because a step's collectives never depend on the split: one all-reduce of the
trained loss's count before the first forward (a scalar per rank), the gradient
all-reduce once, from the last microbatch's backward (buckets laid out by parameters), the
status all-reduce and one all-reduce of the packed partial sums after the loop (one
accumulated value per sum, whatever the number of microbatches that made it); a two-phase
step joins its frontier over its own microbatches before it gathers it over ranks. A call that
one rank refuses (its length fits no split) cannot simply raise there, since the others are
in the step already: the rank runs the step's collectives with the example's split and
raises in it (``StepChannels.refused``), so every rank stops the step and changes nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mbcompile.errors import CostModelError, CostModelWarning, DoesNotFitError, PlanError
from mbcompile.passes.recompute import checkpoint_blocks
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.cost import CostModel
from mbcompile.planning.estimates import Estimate, MemoryEstimate
from mbcompile.planning.length_cost import LengthCost, length_cost, size_along
from mbcompile.planning.length_split import LengthSplit, auto_split, tokens_split
from mbcompile.planning.mbs_policy import MbsPolicy
from mbcompile.planning.microbatch_plan import MicrobatchPlan
from mbcompile.planning.plan import num_microbatches, plan_for
from mbcompile.planning.systems import SystemSpec
from mbcompile.planning.two_phase_cost import TwoPhaseCostModel

if TYPE_CHECKING:  # the compiled module imports this module
    from mbcompile.lowering import Lowered
    from mbcompile.request import Request
    from mbcompile.selection import Selection

__all__ = ["CallSplit", "call_split", "for_length", "last_run", "split_selection"]

#: why a pinned MBS does not follow the length, by policy mode
_PINNED = {"int": "mbs={!r} is samples per microbatch at every length",
           "none": "mbs={!r}: one microbatch per system at every length",
           "explore": "mbs={!r} reports one MBS to pin"}

#: length models by cost model (a module's variants share its cost model) and dims
_LENGTHS: weakref.WeakKeyDictionary[CostModel, dict[Any, LengthCost | str]] = \
    weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class CallSplit:
    """A module's ``LengthSplit`` and where a call's length is read: ``dims`` (input
    position, dim, example size) of the symbolic dims (``"auto"``: the example's length
    plus the most any of them grew), or ``tokens`` (input position, dim) of the token ids'
    length (``"tokens"``)."""

    rule: LengthSplit | None  # None: made on first use, by ``pending``
    dims: tuple[tuple[int, int, int], ...]
    tokens: tuple[int, int] | None
    model: LengthCost | None = dataclasses.field(default=None, repr=False, compare=False)
    #: what makes ``rule``, ``model`` and ``dims`` where they were left to the first use (a
    #: ``compile_only`` module: its length model is asked for by its report, if at all)
    pending: Callable[[], tuple[LengthSplit, LengthCost | None, Any]] | None = \
        dataclasses.field(default=None, repr=False, compare=False)
    #: the selections shown for (mbs, length) (``for_length``)
    shown: dict[tuple[int, int], Selection] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)
    #: the last call's length (None: no call yet); set as calls come
    last_length: int | None = dataclasses.field(default=None, compare=False)
    #: on ranks, the ``StepChannels`` the last call's refusal was left in (None: none)
    refused_in: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def split(self) -> LengthSplit:
        """How a call's split follows its length (made now if it was left to this use)."""
        if self.rule is None:
            self._make()
        assert self.rule is not None
        return self.rule

    @property
    def lengths(self) -> LengthCost | None:
        """The cost model over lengths (None: the split does not follow a memory model)."""
        if self.rule is None:
            self._make()
        return self.model

    def _make(self) -> None:
        assert self.pending is not None
        rule, model, dims = self.pending()
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "dims", dims)
        object.__setattr__(self, "pending", None)  # its closure holds the graphs

    def __getstate__(self) -> dict[str, Any]:
        if self.rule is None:  # a copy cannot make it: it has no graphs
            self._make()
        return dict(self.__dict__)

    def estimate_at(self, length: int, selection: Selection, mbs: int) -> Estimate | None:
        """The modelled memory and time of ``selection``'s batch at ``mbs`` for a call of
        ``length`` (None: no model over lengths)."""
        if self.lengths is None:
            return None
        return self.lengths.at_length(length).estimate(
            selection.plan.gbs, selection.plan.num_csx, mbs, selection.system)

    def length(self, values: Sequence[Any]) -> int:
        """The call's length (``values``: its inputs in placeholder order)."""
        if self.split.mode == "tokens" and self.tokens is not None:
            index, dim = self.tokens
            return int(values[index].shape[dim])
        return self.dims[0][2] + max(size_along(values[i], d) - size for i, d, size in self.dims)

    def mbs_for(self, values: Sequence[Any]) -> tuple[int, int]:
        """``(mbs, length)`` of the call: raises ``DoesNotFitError`` (auto: no MBS fits the
        call's length) or ``PlanError`` (a token budget one sample exceeds), before
        anything ran."""
        length = self.length(values)
        return self.split.mbs_at(length), length


def call_split(request: Request, selection: Selection, lowered: Lowered) -> CallSplit | None:
    """How calls of ``request``'s module (planned as ``selection``, lowered as ``lowered``)
    split by their length (an int MBS, or ``"auto"`` without a memory budget: the example's
    split at every length, its plan shown at the call's length); None where nothing
    follows it (no symbolic dim, a graph run unsplit). A forward-only variant (eval, or
    ``no_grad``, of another batch size) follows the training step's rule at its batch
    size: a forward keeps less alive than the step that rule was checked for. On ranks each
    rank chooses its own call's split (why that is exact: the module's docstring)."""
    symbolic, policy, plan = request.inputs.symbolic, request.policy, selection.plan
    if not symbolic or lowered.graph_module is lowered.original_graph_module:
        return None
    names = request.inputs.names
    dims = tuple((names.index(n), d, size_along(request.example[n], d))
                 for n, ds in symbolic.items() for d in ds)
    common = dict(supported=plan.supported_mbs, pbs=plan.pbs, example_mbs=plan.mbs)
    tokens = _token_ids(request)
    if policy.tokens is not None and tokens is None:
        return None
    if policy.tokens is not None:
        index, dim = tokens
        length = int(request.values[index].shape[dim])
        return CallSplit(tokens_split(policy.tokens, example_length=length, **common), dims,
                         tokens)
    length = dims[0][2]
    if policy.mode != "auto":
        note = _PINNED.get(policy.mode, "").format(policy.request)
    elif request.options.system is None:
        note = ("no memory budget given (system=None plans for this host, whose memory does "
                "not bind): give system= to cut each call by memory")
    else:  # a length model: its probes are most of a 70B plan's, so compile_only leaves it
        made = functools.partial(_by_memory, request, selection, lowered, dims)
        if request.options.compile_only:  # to the report that asks for it, if one does
            return CallSplit(None, dims, tokens, pending=made)
        rule, model, dims = made()
        return CallSplit(rule, dims, tokens, model)
    return CallSplit(_fixed(plan, length, note), dims, tokens)


def _fixed(plan: MicrobatchPlan, length: int, note: str) -> LengthSplit:
    """The example's split at every length, and why."""
    return LengthSplit("fixed", plan.pbs, plan.supported_mbs, plan.mbs, length, note=note)


def _by_memory(request: Request, selection: Selection, lowered: Lowered,
               dims: tuple[tuple[int, int, int], ...]
               ) -> tuple[LengthSplit, LengthCost | None, tuple[tuple[int, int, int], ...]]:
    """``"auto"``'s split by memory at every length, its length model and the dims a
    call's length is read in: the model's example's sizes (a variant of another example,
    a short batch first seen at a long length, reads the model in the model's frame, each
    dim apart); the example's split where no length model holds (a ``CostModelWarning``
    says why)."""
    plan, symbolic = selection.plan, request.inputs.symbolic
    lengths = _length_model(request, selection, lowered)
    if isinstance(lengths, str):  # asked to cut by memory, and it cannot: say so
        warnings.warn(f"{request.name}'s split cannot follow the sequence length under "
                      f"{request.system.name}'s memory ({lengths}): every call runs the "
                      f"example's plan (mbs {plan.mbs}); compile with an example of the "
                      "longest rows so that they fit", CostModelWarning,
                      stacklevel=user_stacklevel())
        return _fixed(plan, dims[0][2], lengths), None, dims
    names = request.inputs.names
    framed = tuple((i, d, lengths.sizes.get((names[i], d), size)) for i, d, size in dims)
    anchor = framed[0][2]  # the model's example's length: a call's, in its frame
    length = anchor + max(size - at for (_, _, size), (_, _, at) in zip(dims, framed))
    memory = _Memory(lengths, plan.pbs, selection.system)
    shortest = anchor + max(max(low or 1, 1) - size for (_, _, size), (low, _) in
                            zip(framed, _bounds(symbolic)))
    highs = [high - size for (_, _, size), (_, high) in zip(framed, _bounds(symbolic))
             if high is not None]
    split = auto_split(memory.fits, memory.peak,
                       example_length=length, shortest=shortest,
                       longest=anchor + min(highs) if highs else None,
                       capacity=memory.system.usable_bytes, system=memory.system.name,
                       note=lengths.note, recompute=plan.recompute,
                       supported=plan.supported_mbs, pbs=plan.pbs, example_mbs=plan.mbs)
    return split, lengths, framed


@dataclass(frozen=True)
class _Memory:
    """The modelled memory of a split at a length (picklable, as the module is)."""

    lengths: LengthCost
    pbs: int
    system: SystemSpec

    def estimate(self, length: int, mbs: int) -> MemoryEstimate:
        return self.lengths.at_length(length).memory(
            self.pbs, mbs, num_microbatches(self.pbs, mbs), self.system)

    def fits(self, length: int, mbs: int) -> bool:
        return bool(self.estimate(length, mbs).fits)

    def peak(self, length: int, mbs: int) -> float:
        return float(self.estimate(length, mbs).peak)


def _bounds(symbolic: Any) -> list[tuple[int | None, int | None]]:
    return [bounds for ds in symbolic.values() for bounds in ds.values()]


def _token_ids(request: Request) -> tuple[int, int] | None:
    """(input position, dim) of the token ids' length: ``inputs.tokens_per_sample``'s input."""
    inputs = request.inputs
    for i, (name, d) in enumerate(zip(inputs.names, inputs.in_dims)):
        value = request.example[name]
        if (d is not None and isinstance(value, torch.Tensor) and not value.is_floating_point()
                and value.dim() == 2):
            return i, 1 - d
    return None


def _length_model(request: Request, selection: Selection, lowered: Lowered
                  ) -> LengthCost | str:
    """The cost model of ``selection`` over lengths (built once per cost model and dims), or
    why there is none: the plan at the example's length then serves every length."""
    cost = selection.cost
    if cost is None:
        return f"no cost model ({selection.cost_error})"
    key = repr(sorted((n, sorted(ds.items())) for n, ds in request.inputs.symbolic.items()))
    known = _LENGTHS.setdefault(cost, {})
    if key not in known:
        # with activation checkpointing, the graph its cost model probed: checkpointed
        gm = lowered.analysis.graph_module
        gm = checkpoint_blocks(gm) if selection.plan.recompute else gm
        if isinstance(cost, TwoPhaseCostModel):  # its P, whose outputs are the frontier
            gm = lowered.graph_module.body
        try:
            known[key] = length_cost(cost, gm, request.inputs.names,
                                     request.inputs.symbolic, request.example, request.pbs)
        except CostModelError as exc:
            known[key] = f"no model of memory over lengths: {exc}"
            if isinstance(cost, TwoPhaseCostModel):
                known[key] = f"a two-phase step with {known[key]}"
        except Exception as exc:  # noqa: BLE001 - a probe at another length crashed
            known[key] = (f"no model of memory over lengths: probing another length failed "
                          f"({type(exc).__name__}: {exc})")
    return known[key]


def split_selection(selection: Selection, split: CallSplit, mbs: int, length: int
                    ) -> Selection:
    """The selection of the module that runs ``mbs`` for ``split``'s calls (first made for
    a call of ``length``): the plan of that MBS, why, and its estimate at that length."""
    plan = selection.plan
    cut = plan_for(plan.per_system_batch_sizes, MbsPolicy("int", mbs))
    estimate = split.estimate_at(length, selection, mbs)  # None: no model over lengths
    new = dataclasses.replace(plan, mbs=cut.mbs, num_microbatches=cut.num_microbatches,
                              microbatch_sizes=cut.microbatch_sizes,
                              reason=_per_call(split.split, mbs))
    return dataclasses.replace(selection, plan=new, estimate=estimate, exploration=None)


def _per_call(rule: LengthSplit, mbs: int) -> str:
    """Why a call of another length than the example's runs ``mbs``: ``plan.reason``."""
    if rule.mode == "tokens":
        return (f"mbs={{'tokens': {rule.budget}}}, per call: {mbs} samples per microbatch, "
                f"the most whose tokens fit {rule.budget} at the call's length")
    return (f"auto, per call: mbs {mbs} is the largest whose modelled peak fits "
            f"{rule.system} at the call's length"
            + (f" (the example's mbs {rule.cap}, chosen for time, at most)"
               if rule.cap is not None else ""))


def for_length(cm: nn.Module, values: Sequence[Any]) -> nn.Module:
    """The module that runs ``cm``'s call of ``values`` (its inputs in placeholder order):
    ``cm`` itself where the call's length chooses ``cm``'s own MBS, else the module lowered
    for that MBS (once: ``Recompile.split``); ``cm.plan`` then shows it, at this length."""
    split = cm._split
    if split.refused_in is not None:  # a refusal the last call left, if it never ran
        split.refused_in.refused = None
        object.__setattr__(split, "refused_in", None)
    try:
        mbs, length = split.mbs_for(values)
    except (DoesNotFitError, PlanError) as exc:
        if isinstance(exc, DoesNotFitError) and not (torch.is_grad_enabled()
                                                     and cm._inner.training):
            # a forward-only call (eval, no_grad) holds neither activations saved for a
            # backward nor gradients, which the training model's peak does: the least MBS
            mbs, length = split.split.supported[0], split.length(values)
        elif cm.rank is None:
            raise
        else:  # the other ranks are in this step already: this one joins its collectives
            # with the example's split and raises there, so every rank stops it
            channels = cm._compiled().channels
            channels.refused = exc
            object.__setattr__(split, "refused_in", channels)
            return cm
    key = (mbs, length)
    shown = split.shown.get(key)
    target = cm if mbs == cm._selection.plan.mbs else cm._variants.get(("split", mbs))
    if target is None:
        selection = split_selection(cm._selection, split, mbs, length)
        policy = MbsPolicy("int", mbs, request=cm._request.policy.request)
        target = cm._recompile.split(dataclasses.replace(cm._request, policy=policy), selection)
        cm._variants[("split", mbs)] = target
    if shown is None:
        if len(split.shown) > 1024:
            split.shown.clear()
        own = target._selection
        tokens = None if own.plan.tokens_per_sample is None or split.tokens is None else \
            int(values[split.tokens[0]].shape[split.tokens[1]])
        estimate = split.estimate_at(length, own, mbs)  # the figures at this call's length
        if estimate is None:  # no model over lengths: the plan's own
            estimate = own.estimate
        reason = own.plan.reason  # at the example's length, or a split of its own, its own
        if target is cm and length != split.split.example_length and split.split.mode in (
                "tokens", "auto"):
            reason = _per_call(split.split, mbs)
        shown = split.shown[key] = dataclasses.replace(own, plan=dataclasses.replace(
            own.plan, tokens_per_sample=tokens, reason=reason), estimate=estimate)
    object.__setattr__(split, "last_length", length)
    object.__setattr__(cm, "_ran", (target, shown))
    return target


def last_run(cm: nn.Module) -> tuple[nn.Module, CallSplit | None, int | None]:
    """The module whose plan the last call of ``cm`` showed (through the variants a call
    went on to: other keywords, a length made symbolic), the ``CallSplit`` that says how
    the split follows the length, and the last call's length (None: not known). A call at
    the example's own length of a module whose length became symbolic later ran the
    module itself: the split is its symbolic variant's."""
    module = cm
    while module._ran is not None and module._ran[1] is None and module._ran[0] is not module:
        module = module._ran[0]
    if module._split is not None:
        return module, module._split, module._split.last_length
    shaped = [v for k, v in module._variants.items() if isinstance(k, tuple) and k
              and k[0] == "shapes" and v._split is not None]
    if not shaped:
        return module, None, None
    return module, shaped[-1]._split, shaped[-1]._split.split.example_length
