"""Building a cost model from a graph: its static figures, its probes and their fit.

>>> model, batch = make_mlp(8)
>>> cost = analyse_cost(model, batch, (0, 0), pbs=8)   # three fake probes, one fit
>>> cost.estimate(16, 2, 4, get_system("host")).memory.peak

The model itself (its formulas for memory and time) is ``cost.py``'s; the probes are
``probe.py``'s and the fit ``fit.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.shape_prop import BlockRun
from mbcompile.planning.cost import CostModel
from mbcompile.planning.estimates import ShardSpec, StaticFigures
from mbcompile.planning.precision import Precision
from mbcompile.planning.probe import Prober, nbytes

__all__ = ["analyse_cost", "static_figures"]


def _input_bytes(values: Sequence[Any], in_dims: Sequence[int | None]) -> tuple[float, float]:
    per_sample = fixed = 0.0
    for value, d in zip(values, in_dims):
        for t in pytree.tree_leaves(value):
            if not isinstance(t, torch.Tensor):
                continue
            if d is None:
                fixed += nbytes(t)
            elif t.shape[d] > 0:
                per_sample += nbytes(t) / t.shape[d]
    return per_sample, fixed


def static_figures(gm: nn.Module, values: Sequence[Any], in_dims: Sequence[int | None],
                   fused: bool) -> StaticFigures:
    """What does not depend on the microbatch size: parameters, buffers, input bytes."""
    seen: set[int] = set()
    param_bytes = trainable = largest = 0.0
    n_params = n_train = n_tensors = 0
    for p in gm.parameters():  # parameters() already skips tied duplicates
        if id(p) in seen:
            continue
        seen.add(id(p))
        n_tensors += 1
        param_bytes += nbytes(p)
        n_params += p.numel()
        if p.requires_grad:
            trainable += nbytes(p)
            n_train += p.numel()
            largest = max(largest, float(nbytes(p)))
    per_sample, fixed = _input_bytes(values, in_dims)
    static = StaticFigures(
        param_bytes=param_bytes, trainable_bytes=trainable, num_params=n_params,
        num_trainable=n_train, num_param_tensors=n_tensors, largest_param_bytes=largest,
        buffer_bytes=float(sum(nbytes(b) for b in gm.buffers())),
        input_bytes_per_sample=per_sample, input_bytes_fixed=fixed,
        output_bytes_per_sample=0.0, fused=fused, training=n_train > 0)
    return static


def analyse_cost(gm: nn.Module | BatchAnalysis, values: Sequence[Any],
                 in_dims: Sequence[int | None], *, pbs: int | None = None,
                 name: str | None = None, fit: bool = True,
                 kept_outputs: frozenset[int] | None = None, fused: bool | None = None,
                 shard: ShardSpec | None = None, precision: Precision | None = None,
                 pinned: int | None = None, variants: bool = False, lazy: bool = False,
                 block_run: BlockRun | None = None) -> CostModel:
    """Build the cost model of ``gm``: best the batch analysis of the captured graph
    (it says which outputs are trained losses and whether backward runs per
    microbatch), or any module (assumed to return one scalar loss first).

    ``values`` are example inputs in ``forward``'s order (any batch size; only
    their shapes and dtypes are used) and ``in_dims`` their batch dims.  Runs the
    fake probes and the fit check for per-system batch size ``pbs`` (default 4;
    see :meth:`CostModel.build_fit`): three probes in the common case.  With
    ``fit=False`` it probes ``m = pbs`` only: for a plan that runs the whole
    per-system batch as one microbatch (a graph the batch analysis rejected,
    run unsplit), where smaller sizes may not even run. ``kept_outputs``: the output
    leaves a training step returns (``compile(outputs=...)``); the others are not counted
    as kept across microbatches. ``fused``: backward runs per microbatch (default: the
    analysis's word, or True for a module); ``shard``: the FSDP2 sharding it is costed with.
    ``pinned``: the MBS a pinned policy (an int or ``"none"``) runs
    (``MbsChoices.pinned``): that one size is probed and the fit is left until another
    size is asked for (``CostModel.pin``); ``variants``: the module may run other batch
    sizes, so the size below it is probed too and other sizes fitted from the two.
    ``lazy``: the probes run on the model's first question (``CostModel.defer``), and a
    ``CostModelError`` they raise is raised there. ``block_run``: the shape pass's run of the
    graph cut to two repeated blocks (``Analysed.block_run``), probed in its fake mode.

    >>> model, batch = make_mlp(8)
    >>> cost = analyse_cost(model, batch, (0, 0), pbs=8)
    >>> cost.figures(4).flops == 4 * cost.figures(1).flops
    True
    """
    if isinstance(gm, BatchAnalysis) and gm.rejected is None:
        loss_leaves, found = gm.loss_outputs or None, gm.fused
        gm = gm.graph_module
    else:  # a module, or a graph run unsplit: one microbatch, whatever its losses
        gm = gm.graph_module if isinstance(gm, BatchAnalysis) else gm
        loss_leaves, found = None, True
    static = static_figures(gm, values, in_dims, found if fused is None else fused)
    pin = pinned is not None and fit and static.fused
    # a pinned MBS chooses nothing: its stacked blocks are not checked against three
    prober = Prober(gm, values, in_dims, loss_leaves, kept_outputs, check_blocks=not pin,
                    block_run=block_run)
    model = CostModel(prober, static, name or type(gm).__name__, shard, precision)
    size = 4 if pbs is None else pbs
    if pinned is not None and pin:
        model.defer("pin variants" if variants else "pin", pinned)
    else:
        model.defer("fit" if fit else "whole", size)
    if not lazy:
        model.ready()
    return model
