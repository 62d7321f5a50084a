"""The selection: the cost model of the analysed graph, then the plan chosen with it.

>>> selection = select(request, analysed)
>>> selection.plan.mbs, selection.estimate.memory.peak

``compile()``'s third stage. It reads the request (``mbs``, the system, the FSDP2
sharding, ``recompute``) and the analysis (mode, kept outputs, the cut) and builds
one cost model per graph that may run: plain, as a two-phase step, or with activation
checkpointing per block, each only when it is needed. The search is
``planning/search.py``'s (its ``Choice``); what is decided here is which graph is
costed and which of the plans is kept, and then the one plan of the ``Selection``:
the choice's reasons and warnings joined in with what the request adds
(``plan_notes.py``), and on ranks which system of it this process runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbcompile.analysis import Analysed, recompute_option
from mbcompile.errors import (
    CostModelError,
    DoesNotFitError,
    InputError,
    MixingError,
    TwoPhaseWarning,
)
from mbcompile.passes.fake_probe import holds_no_data
from mbcompile.passes.recompute import checkpoint_blocks
from mbcompile.passes.sources import user_stacklevel
from mbcompile.plan_notes import final_plan
from mbcompile.planning.cost import CostModel, format_bytes, format_seconds
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.planning.estimates import Estimate
from mbcompile.planning.exploration import Choice, Exploration
from mbcompile.planning.fixes import with_recompute_fix, with_recompute_tried
from mbcompile.planning.mbs_policy import MbsPolicy
from mbcompile.planning.measure import HostTimer
from mbcompile.planning.plan import MicrobatchPlan, num_microbatches, plan_for
from mbcompile.planning.search import select_sharded
from mbcompile.planning.systems import SystemSpec
from mbcompile.planning.two_phase_cost import (
    COUPLED_SHARE_WARNING,
    TwoPhaseCostModel,
    analyse_two_phase_cost,
    two_phase_reason,
)
from mbcompile.request import Request

__all__ = ["Selection", "forward_only_choice", "select"]

#: ``Selection.cost_error`` when the request asked for no cost model.
NO_COST_MODEL = "cost_model=False: planned without the memory model"


@dataclass(frozen=True)
class Selection:
    """What ``select`` decided: the one plan, with every reason and warning in it, the
    estimate it was chosen by and what the search evaluated.

    ``plan`` is what the compiled module runs and shows (``cm.plan``); ``rank`` is the
    system of it this process runs on ``backend="torch.distributed"`` (None: one process
    runs them all).
    """

    plan: MicrobatchPlan
    system: SystemSpec
    estimate: Estimate | None
    exploration: Exploration | None
    cost: CostModel | None = field(repr=False, default=None)
    cost_error: str | None = None
    rank: int | None = None


@dataclass
class _Context:
    """One selection's inputs, and the checkpointed graph built when first needed."""

    request: Request
    analysed: Analysed
    progress: bool | None = None
    prior: Selection | None = None  # the first request's, whose cost model a variant reuses
    _checkpointed: list[Any] = field(default_factory=list)

    def checkpointed(self) -> Any:
        """The graph with activation checkpointing per block (None: no repeated blocks)."""
        if not self._checkpointed:
            self._checkpointed.append(checkpoint_blocks(self.analysed.analysis.graph_module))
        return self._checkpointed[0]

    def prior_recomputed(self) -> CostModel | None:
        """The cost model of the checkpointed graph that the prior request's plan was chosen
        with (a variant of a plan that recomputes, on the same capture): nothing to probe
        or checkpoint again."""
        prior = self.prior
        if (prior is None or not prior.plan.recompute or self.analysed.mode != "split"
                or isinstance(prior.cost, TwoPhaseCostModel)):
            return None
        return prior.cost


def select(request: Request, analysed: Analysed, *, progress: bool | None = None,
           prior: Selection | None = None) -> Selection:
    """The plan for ``request`` on ``analysed``'s graph, its estimate and what it evaluated.

    On ranks the process group is checked against the plan first (``check_world``).

    A cost model that cannot run is reported through ``Selection.cost_error`` (see
    ``select_plan``), except that ``compile_only=True`` with ``mbs="auto"`` raises
    ``CostModelError``: a compile-only answer is never an MBS unchecked against memory.
    In ``"unsplit"`` mode only the whole per-system batch is probed and checked.
    ``recompute`` (``"auto"``): activation checkpointing per block is costed only when
    memory stops the MBS from growing. With ``request.options.cost_model`` False nothing is
    probed: the plan is the arithmetic one (``make_plan``), unchecked against memory.

    ``prior``: the selection of the request this one was derived from (a variant for
    another batch size, on the same capture): its cost model answers again, so that
    nothing is probed (nor timed) twice; a forward-only request (``Request.forward_only``:
    eval mode or ``no_grad``) probes nothing at all and runs microbatches of the prior
    plan's MBS (``forward_only_choice``).
    """
    if prior is not None and request.forward_only:
        choice = forward_only_choice(request, prior)
    else:
        choice = _pinned(_select(request, analysed, progress, prior), request)
    rank = None
    if request.options.backend == "torch.distributed":
        from mbcompile.execution.distributed import check_world

        rank = check_world(choice.plan)
        if request.noise_scale is not None:
            raise InputError("measure_noise_scale works with the simulated backend only so far; "
                             "measure on one process, then train on ranks")
    return Selection(final_plan(request, choice), request.system, choice.estimate,
                     choice.exploration, choice.cost, choice.cost_error, rank)


def _pinned(selection: Choice, request: Request) -> Choice:
    """A sharded model's FSDP2 settings that the user pinned (``reshard_after_forward``,
    ``gradient_sync``) reach the plan, and so the runtime, also where no cost model chose
    them (``cost_model=False``, or one that could not run)."""
    plan = selection.plan
    if request.shard is None:
        return selection
    pins: dict[str, Any] = {}
    reshard = request.options.reshard_after_forward
    if plan.reshard_after_forward is None and isinstance(reshard, bool):
        pins["reshard_after_forward"] = reshard
    if plan.gradient_sync is None and request.options.gradient_sync != "auto":
        pins["gradient_sync"] = request.options.gradient_sync
    return replace(selection, plan=replace(plan, **pins)) if pins else selection


def forward_only_choice(request: Request, prior: Selection) -> Choice:
    """The plan of a call that runs no backward (eval mode, ``no_grad``): microbatches of
    at most the prior (training) plan's MBS, as even as the batch allows. Nothing is probed:
    a forward alone keeps less alive than the training step that MBS was checked for (the
    saved activations are freed as it goes), so what fitted then fits now.

    >>> forward_only_choice(request.for_batch(5, call, forward_only=True), cm.selection).plan.mbs
    2
    """
    sizes = request.per_system_batch_sizes
    mbs = -(-sizes[0] // num_microbatches(sizes[0], min(prior.plan.mbs, sizes[0])))
    plan = plan_for(sizes, MbsPolicy("int", mbs))
    choice = Choice(plan, None, None, prior.cost, prior.cost_error)
    return choice.noted(f"a forward-only call (eval mode or no_grad): microbatches of at most "
                        f"the training plan's mbs {prior.plan.mbs}, nothing probed")


def _select(request: Request, analysed: Analysed, progress: bool | None,
            prior: Selection | None = None) -> Choice:
    ctx = _Context(request, analysed, progress, prior)
    recompute = recompute_option(request, analysed)
    unsplit, two_phase = analysed.mode == "unsplit", analysed.mode == "two_phase"
    may_recompute = not (two_phase or unsplit or recompute is False)
    if not request.options.cost_model:
        return _without_cost_model(ctx, recompute is True and may_recompute)
    if recompute is True and may_recompute and (ctx.prior_recomputed() is not None
                                                or ctx.checkpointed() is not None):
        return _with_recompute(ctx, None)
    cost, error = _cost_model(ctx)  # built on the search's first question
    if request.measure and _holds_no_data(request):
        raise InputError(
            "measure=True times real forward and backward passes on this host, "
            f"but {request.name}'s parameters or example inputs hold no data (the meta device, "
            "or a FakeTensorMode): plan it without measure, or measure the materialised model")
    timer = HostTimer(analysed.analysis.graph_module, request.values, request.inputs.in_dims,
                      request.measure, analysed.analysis.loss_outputs or None
                      ) if request.measure and prior is None else None  # a variant: modelled
    try:
        selection = select_sharded(request.per_system_batch_sizes, request.policy, cost,
                                   request.system, reshard=request.options.reshard_after_forward,
                                   sync=request.options.gradient_sync, timer=timer,
                                   progress=progress, cost_error=error, unsplit=unsplit,
                                   choices=request.choices,
                                   compile_only=request.options.compile_only)
    except DoesNotFitError as exc:
        if two_phase and isinstance(cost, TwoPhaseCostModel):
            raise _two_phase_too_big(ctx, cost, exc) from exc
        if may_recompute and ctx.checkpointed() is not None:  # the other way to save memory
            try:
                return _with_recompute(ctx, exc)
            except DoesNotFitError as checkpointed:
                raise with_recompute_tried(exc, checkpointed) from exc
        if recompute is False and not (two_phase or unsplit) and ctx.checkpointed() is not None:
            try:  # not tried because the user said so: name it when it would fit
                other = _with_recompute(ctx, None)
            except DoesNotFitError:
                raise exc from None
            assert other.estimate is not None
            raise with_recompute_fix(exc, other.plan.mbs, other.estimate.memory.peak) from exc
        raise
    if two_phase and isinstance(cost, TwoPhaseCostModel) and selection.estimate is not None:
        selection = _two_phase_selection(selection, cost)
    elif two_phase:  # no cost model to size its terms with: still say what runs
        selection = selection.noted("two-phase step (a loss that couples samples; its "
                                    "memory unchecked: the cost model could not run)")
    selection = _sharded_selection(selection)
    mode = request.policy.mode
    if may_recompute and _may_gain(selection, mode) and ctx.checkpointed() is not None:
        try:  # the second knob: a larger MBS that only fits with activation checkpointing
            other = _with_recompute(ctx, None, asked=False)
        except DoesNotFitError:
            return selection
        selection = _joint(selection, other, mode)
    return selection


def _holds_no_data(request: Request) -> bool:
    """Whether the model or its example inputs are shapes only (meta or fake tensors)."""
    tensors = [*request.inner.parameters(), *request.inner.buffers(),
               *(t for t in pytree.tree_leaves(request.values) if isinstance(t, torch.Tensor))]
    return any(map(holds_no_data, tensors))


def _cost_model(ctx: _Context) -> tuple[CostModel | None, str | None]:
    """The cost model of the graph as it runs, or why it could not be built (a variant's:
    the prior selection's, when it was built for the same kind of step). A plain step's
    model is probed on the search's first question, which plans without it when that
    fails (``select_plan``)."""
    request, analysed = ctx.request, ctx.analysed
    if (ctx.prior is not None and analysed.mode == "split"
            and not isinstance(ctx.prior.cost, TwoPhaseCostModel)
            and (ctx.prior.cost is not None or ctx.prior.cost_error is not None)):
        return ctx.prior.cost, ctx.prior.cost_error
    values, in_dims = request.values, request.inputs.in_dims
    try:
        if analysed.mode == "two_phase":
            return analyse_two_phase_cost(analysed.analysis, values, in_dims, pbs=request.pbs,
                                          name=request.name, cut=analysed.cut,
                                          shard=request.shard,
                                          precision=request.precision), None
        return analyse_cost(analysed.analysis, values, in_dims, pbs=request.pbs,
                            name=request.name, fit=analysed.mode != "unsplit",
                            kept_outputs=analysed.kept, fused=analysed.fused,
                            shard=request.shard, precision=request.precision,
                            pinned=request.choices.pinned, variants=_may_vary(request),
                            lazy=True, block_run=analysed.block_run), None
    except CostModelError as exc:
        return None, str(exc)


def _may_vary(request: Request) -> bool:
    """Whether the module may train at other batch sizes (``variants.for_batch``), whose
    figures a pinned cost model then fits from the size below the MBS, probed at compile:
    a variant probes nothing."""
    return request.options.batch_sizes == "any" and not request.options.planning_only


def _without_cost_model(ctx: _Context, recompute: bool) -> Choice:
    """``cost_model=False``: the plan as asked (an int or ``"none"``), nothing probed."""
    request = ctx.request
    plan = plan_for(request.per_system_batch_sizes, request.policy)
    if recompute and ctx.checkpointed() is not None:
        plan = replace(plan, recompute=True)
    selection = Choice(plan, None, None, None, NO_COST_MODEL)
    if plan.recompute:
        selection = selection.noted("activation checkpointing per block (recompute=True)")
    if ctx.analysed.mode == "two_phase":
        selection = selection.noted("two-phase step (a loss that couples samples; its memory "
                                    "unchecked: cost_model=False)")
    return selection


def _sharded_selection(selection: Choice) -> Choice:
    """The plan says what sharding costs and saves per rank (unsharded: as it is)."""
    e, shard = selection.estimate, getattr(selection.cost, "shard", None)
    if e is None or shard is None:
        return selection
    grads = ("one unit's gradient shard" if e.num_microbatches == 1
             else "gradients accumulated as shards" if shard.gradient_sync == "microbatch"
             else "gradients accumulated unsharded")
    note = (f"sharded with FSDP2 over {shard.world} ranks: parameters and optimizer "
            f"state are one rank's shards ({format_bytes(e.memory.params)} of parameters), "
            f"{grads} at the peak ({format_bytes(e.memory.grads)}), {format_bytes(shard.gathered)} "
            f"gathered (the root and {'the largest' if shard.reshard_after_forward else 'all'}"
            f" of {len(shard.unit_bytes) - 1} units) and "
            f"{format_bytes(e.memory.gathered - shard.gathered)} of FSDP's flat buffers, "
            "all-gathers "
            f"{format_seconds(e.time.allgather)} per step")
    return selection.noted(note)


def _may_gain(selection: Choice, mode: str) -> bool:
    """Whether activation checkpointing could give a faster plan: ``explore`` shows both;
    ``auto`` only when memory, not the batch, stopped the MBS from growing (at the same
    MBS, recomputing only costs time)."""
    x = selection.exploration
    if x is None or mode not in ("auto", "explore"):
        return False
    return mode == "explore" or not x.candidate(max(c.mbs for c in x.candidates)).fits


def _joint(plain: Choice, ticked: Choice, mode: str) -> Choice:
    """One selection over (MBS, recompute): the faster plan, and every candidate seen."""
    px, tx = plain.exploration, ticked.exploration
    assert px is not None and tx is not None and plain.estimate is not None \
        and ticked.estimate is not None
    candidates = tuple(sorted([*px.candidates,
                               *(replace(c, recompute=True) for c in tx.candidates)],
                              key=lambda c: (c.mbs, c.recompute)))
    faster = ticked.estimate.time.step < plain.estimate.time.step
    chosen = ticked if faster else plain
    other = plain if faster else ticked
    note = (f"{'with' if faster else 'without'} activation checkpointing per block it is "
            f"faster: modelled step {format_seconds(chosen.estimate.time.step)} at mbs "
            f"{chosen.plan.mbs}, against {format_seconds(other.estimate.time.step)} at mbs "
            f"{other.plan.mbs} {'without' if faster else 'with'} it")
    exploration = replace(px, mode=mode, candidates=candidates, best=chosen.plan.mbs,
                          best_recompute=faster, seconds=px.seconds + tx.seconds)
    if mode == "explore":
        note += f"; pin it with mbs={chosen.plan.mbs}, recompute={faster}"
    return replace(chosen, exploration=exploration).noted(note)


def _with_recompute(ctx: _Context, without: DoesNotFitError | None,
                    asked: bool = True) -> Choice:
    """The plan with activation checkpointing per block, its cost probed as it runs
    (``asked``: recompute=True; else chosen beside the plan without it)."""
    request, analysed = ctx.request, ctx.analysed
    cost = ctx.prior_recomputed()
    if cost is None:
        checkpointed = ctx.checkpointed()
        assert checkpointed is not None
        cost = analyse_cost(replace(analysed.analysis, graph_module=checkpointed),
                            request.values, request.inputs.in_dims, pbs=request.pbs,
                            name=request.name, kept_outputs=analysed.kept,
                            fused=analysed.fused, shard=request.shard,
                            precision=request.precision, pinned=request.choices.pinned,
                            variants=_may_vary(request))
    selection = select_sharded(request.per_system_batch_sizes, request.policy, cost,
                               request.system, reshard=request.options.reshard_after_forward,
                               sync=request.options.gradient_sync, progress=ctx.progress,
                               choices=request.choices)
    why = (f"activation checkpointing per block{' (recompute=True)' if asked else ''}"
           if without is None else
           f"activation checkpointing per block: without it even mbs {without.mbs} needs "
           f"{format_bytes(without.needed)} of {format_bytes(without.available)}")
    peak = selection.estimate.memory.peak if selection.estimate is not None else 0.0
    selection = replace(selection, plan=replace(selection.plan, recompute=True))
    return _sharded_selection(selection.noted(
        f"{why}; with it the modelled peak is {format_bytes(peak)}"))


def _two_phase_selection(selection: Choice, cost: TwoPhaseCostModel) -> Choice:
    """The plan says it is two-phase, and warns when the coupled part holds most memory."""
    share = cost.coupled_share(selection.plan.mbs)
    warning = None
    if share > COUPLED_SHARE_WARNING:
        warning = (f"two-phase step: the coupled part holds {share:.0%} of the activation "
                   "memory at the whole batch, so microbatching saves little memory here")
        warnings.warn(warning, TwoPhaseWarning, stacklevel=user_stacklevel())
    return selection.noted(two_phase_reason(cost, selection.estimate), warning)


def _two_phase_too_big(ctx: _Context, cost: TwoPhaseCostModel, exc: DoesNotFitError
                       ) -> MixingError:
    """The rejection, with why a two-phase step does not fit either (the numbers)."""
    analysis, system, pbs = ctx.analysed.analysis, ctx.request.system, ctx.request.pbs
    values, in_dims = ctx.request.values, ctx.request.inputs.in_dims
    rejected = analysis.rejected
    plain_text = ""
    for m in dict.fromkeys(x for x in (exc.mbs, 2) if x <= pbs):  # BatchNorm needs 2 samples
        try:  # what one microbatch of a plain (wrong) split would need, for comparison
            plain = analyse_cost(analysis.graph_module, values, in_dims, pbs=m, fit=False,
                                 precision=ctx.request.precision)
        except CostModelError:
            continue
        plain_peak = plain.memory(pbs, m, num_microbatches(pbs, m), system).peak
        plain_text = (f"; one microbatch of {m} in a plain split would need "
                      f"{format_bytes(plain_peak)}")
        break
    mem = cost.memory(pbs, exc.mbs, num_microbatches(pbs, exc.mbs), system)
    message = (f"{rejected}\n  a two-phase step would run it exactly, but does not fit "
               f"{system.name}: it needs {format_bytes(exc.needed)} at mbs {exc.mbs} (frontier "
               f"and its gradient {format_bytes(mem.frontier)}, the coupled part at the whole "
               f"batch {format_bytes(mem.coupled)}) of {format_bytes(exc.available)}"
               f"{plain_text}")
    err = type(rejected)(message) if rejected is not None else MixingError(message)
    if rejected is not None:
        err.__dict__.update(rejected.__dict__)
    err.two_phase_peak, err.capacity = exc.needed, exc.available  # type: ignore[attr-defined]
    return err
