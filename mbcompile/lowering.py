"""The lowering: the analysed graph rewritten for the selected plan and bound to a backend.

>>> lowered = lower(request, analysed, selection)
>>> lowered.graph_module.print_readable()   # split -> loop(body) -> accumulate, bound

``compile()``'s fourth stage, a function of the three results before it: the
microbatch rewrite (``passes/microbatch_rewrite.py``) cuts the batch into the plan's
slices (on ranks, this process's system only), the backend binds the loop and
collective ops (``execution/``), and what the runtime needs from compile time travels
in one typed ``StepConfig``. A graph whose plan runs one microbatch, and that the
analysis marks ``"unsplit"``, runs as it was captured. The compiled module
(``compiled_module.py``) only calls the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from mbcompile.analysis import Analysed
from mbcompile.execution import StepChannels, bindings
from mbcompile.execution.joint import joint_step
from mbcompile.execution.seeding import step_seed
from mbcompile.execution.step_config import StepConfig
from mbcompile.passes import ops
from mbcompile.passes.attr_shortcuts import shortcut_attrs
from mbcompile.passes.autocast_regions import Region
from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.capture import OutputSpec
from mbcompile.passes.draws import is_draw
from mbcompile.passes.errors import InputError
from mbcompile.passes.graph_code import code_now
from mbcompile.passes.guards import Guard
from mbcompile.passes.microbatch_rewrite import microbatch_rewrite
from mbcompile.passes.norm_values import one_value_refused
from mbcompile.passes.penalties import takes_gradients
from mbcompile.passes.side_effects import NO_EFFECTS, Effects
from mbcompile.passes.state_updates import StateUpdates
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.request import Request
from mbcompile.selection import Selection

__all__ = ["Lowered", "lower"]


@dataclass(frozen=True)
class Lowered:
    """One graph ready to run: what the compiled module calls for one train/eval mode."""

    graph_module: fx.GraphModule  # rewritten, its loop ops bound to the backend
    original_graph_module: fx.GraphModule
    output_spec: OutputSpec
    retains_activations: bool  # training keeps several microbatches' activations alive
    channels: StepChannels  # what its loop reports: noise scale, last counts
    analysis: BatchAnalysis  # what the batch analysis decided for this graph
    state: StateUpdates  # which graph outputs are state to write back, and where
    guards: tuple[Guard, ...] = ()  # the plain attributes its capture read, and their values
    effects: Effects = NO_EFFECTS  # forward's side effects: replayed after each step
    autocast_regions: tuple[Region, ...] = ()  # forward's own autocast regions
    values_fixed: bool = False  # holds the example's numbers inside inputs (torch.export)


def lower(request: Request, analysed: Analysed, selection: Selection) -> Lowered:
    """``analysed``'s graph rewritten into split -> loop -> accumulate for
    ``selection.plan`` (the slices of ``selection.rank``'s system on ranks, of every system
    otherwise) and bound to ``request``'s backend; the captured graph as it is when the
    analysis says so (``"unsplit"``, or ``unsplit_at_one`` and the plan runs one
    microbatch)."""
    plan, rank = selection.plan, selection.rank
    captured = analysed.captured
    gm = captured.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_dims = request.inputs.in_dims
    if plan.gbs == 1:  # eager's check of a batch norm, which torch.export traces away
        one_value_refused(gm, 1, {p.name: d for p, d in zip(placeholders, in_dims)})
    if analysed.mode == "unsplit" or (analysed.unsplit_at_one
                                      and plan.num_nonempty_microbatches <= 1):
        # one system, one microbatch: nothing is split, so nothing can mix; the captured
        # graph runs as it is
        return Lowered(code_now(gm), gm, captured.output_spec, False,
                       StepChannels(noise=request.noise_scale), analysed.analysis,
                       analysed.state, captured.guards, captured.effects,
                       captured.autocast_regions, captured.method == "export")
    systems = plan.microbatch_slices if rank is None else plan.microbatch_slices[rank:rank + 1]
    offset = 0 if rank is None else sum(plan.per_system_batch_sizes[:rank])  # rank-local rows
    slices = [(a - offset, b - offset) for system in systems for a, b in system if b > a]
    rewritten = microbatch_rewrite(
        analysed.analysis, slices=slices, systems=[sum(1 for a, b in s if b > a) for s in systems],
        in_dims={p.target: d for p, d in zip(placeholders, in_dims)}, keep=analysed.kept,
        recompute=plan.recompute and analysed.training, cut=analysed.cut,
        rows=None if rank is None else (offset, plan.gbs))  # on ranks: draws at the gbs
    if plan.recompute and analysed.training and _draws(rewritten.body) and (
            request.torch_compile or {}).get("backend") == "eager":
        raise InputError(
            "recompute with torch_compile's backend 'eager' and random draws in the body "
            "(dropout): that backend ignores activation checkpointing's replay of the RNG "
            "(pytorch/pytorch#160773), so the recomputed forward would draw other masks "
            "than the first and the gradients would not be the forward's. Fix: "
            "torch_compile={'backend': 'aot_eager'} (or inductor), or recompute=False")
    channels = StepChannels(noise=request.noise_scale,
                            config=_step_config(request, plan, analysed, rewritten, slices))
    # the code of the step and its body, made once, here (fx would have made the body's
    # with each module around it: the cut's, the rewrite's, bind's)
    bound = code_now(ops.bind(rewritten, bindings(request.options.backend, channels,
                                                  plan.per_system_batch_sizes)))
    if request.torch_compile is not None:
        _torch_compile_parts(bound, {**_static(request), **request.torch_compile})
    else:  # each microbatch reads its layers and parameters without __getattr__ hops
        shortcut_attrs(bound, {id(m) for m in (*request.model.modules(),
                                               *request.inner.modules())})
    splits = plan.num_nonempty_microbatches > 1
    return Lowered(bound, gm, captured.output_spec, splits and not analysed.analysis.fused,
                   channels, analysed.analysis, analysed.state, captured.guards, captured.effects,
                   captured.autocast_regions, captured.method == "export")


def _step_config(request: Request, plan: MicrobatchPlan, analysed: Analysed,
                 rewritten: fx.GraphModule, slices: Sequence[tuple[int, int]]) -> StepConfig:
    """What the runtime needs from compile time for this graph: FSDP2 units' setting (the
    plan's choice), a two-phase step's frontier shapes on ranks (a rank whose phase 1 fails
    still joins the gather, with zeros this shape), the body's joint training step."""
    template = None
    if analysed.mode == "two_phase" and request.options.backend == "torch.distributed":
        from mbcompile.execution.two_phase import frontier_template

        template = frontier_template(rewritten.body, request.values, request.inputs.in_dims,
                                     [b - a for a, b in slices])
    joint = None
    if request.torch_compile is not None:  # what a training step runs per microbatch
        joint = joint_step(rewritten.body, {**_static(request), **request.torch_compile})
    return StepConfig(plan.reshard_after_forward, template, joint, plan.gradient_sync,
                      step_seed(rewritten, analysed.analysis.loss_outputs),
                      request.options.nonfinite, lengths_vary=bool(request.inputs.symbolic)
                      or request.options.dynamic == "auto",
                      replayable=not analysed.state.targets)


def _draws(body: fx.GraphModule) -> bool:
    """Whether the body draws random numbers: a random op in its graph or its blocks'
    (``recompute`` splits it into one graph per block), or a layer that draws."""
    return any(isinstance(m, (torch.nn.modules.dropout._DropoutNd, torch.nn.RReLU)) or (
        isinstance(m, fx.GraphModule) and any(map(is_draw, m.graph.nodes)))
        for m in body.modules())


def _static(request: Request) -> dict[str, Any]:
    """torch.compile's ``dynamic``: static shapes, but automatic (a dim that changes is
    made dynamic at its first recompile) where dims vary between calls (``dynamic=``)."""
    return {"dynamic": None if request.inputs.symbolic else False}


def _torch_compile_parts(gm: fx.GraphModule, options: Mapping[str, Any]) -> None:
    """Compile the parts that run per microbatch (the body) and once (the coupled part).

    The plan holds at most two microbatch sizes per system, each known now, so every
    part is compiled for static shapes (``dynamic=False``): one graph per size (and per
    grad mode, for a two-phase body), compiled on the first step and never again. A hand
    loop over ``torch.compile(model)`` with a short last microbatch recompiles, or goes
    dynamic, instead.
    """
    kwargs = {"dynamic": False, **options}
    for name in ("body", "coupled"):
        part = getattr(gm, name, None)
        if isinstance(part, fx.GraphModule) and not takes_gradients(part):  # no double backward
            setattr(gm, name, torch.compile(part, **kwargs))
