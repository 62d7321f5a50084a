"""Cost of a two-phase step: P per microbatch, F and C once, at the whole batch.

A two-phase step (``execution/two_phase.py``) keeps one microbatch of the
per-sample part P alive at a time, plus the frontier F and its gradient for the
whole batch, plus the coupled part C run once at the whole batch (every rank runs C
on the gathered F)::

    peak = static + inputs + outputs + P's microbatch activations
           + 2 x F (F and dL/dF)  +  C's activations at the whole batch
    step = P's forward+backward per microbatch  +  P's forward again (phase 1)
           + C once  +  all-reduce  +  optimizer

P is probed and fitted like any body (``cost.py``); C is probed once, on fake
tensors shaped like F at the full batch. The plan is chosen as any plan: when its
modelled peak fits the system.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from mbcompile.passes.batch_analysis import BatchAnalysis
from mbcompile.passes.facts import SHAPES, ValueInfo
from mbcompile.passes.fake_probe import shaped_like
from mbcompile.passes.microbatch_rewrite import Cut, two_phase_parts
from mbcompile.planning.cost import (
    CostModel,
    Estimate,
    MemoryEstimate,
    Probe,
    ShardSpec,
    format_bytes,
)
from mbcompile.planning.cost_analysis import analyse_cost, static_figures
from mbcompile.planning.precision import Precision, probe_precision
from mbcompile.planning.probe import Prober
from mbcompile.planning.systems import SystemSpec

__all__ = ["TwoPhaseCostModel", "analyse_two_phase_cost"]

#: C's share of the activation memory above which microbatching saves little (a warning).
COUPLED_SHARE_WARNING = 0.5


class _CoupledProber(Prober):
    """Probes C on fake inputs shaped like the joined frontier at the full batch."""

    def __init__(self, coupled: fx.GraphModule, free: Sequence[fx.Node],
                 free_values: Sequence[Any], device: torch.device, loss_index: int | None,
                 grown: int = 0) -> None:
        super().__init__(coupled, [], [], (loss_index,) if loss_index is not None else None)
        self.free_values = list(free_values)
        self.device = device
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []
        names = {n.name for n in free}  # C's copies of the graph's placeholders
        for n in coupled.graph.nodes:
            if n.op == "placeholder" and n.name not in names:
                info = n.meta.get(SHAPES)
                if isinstance(info, ValueInfo) and info.is_tensor:  # at the call's batch
                    self.shapes.append((info.shape_grown(grown), info.dtype or torch.float32))
                else:
                    self.shapes.append(((), torch.float64))  # a count kept as a number

    @property
    def device_type(self) -> str:
        return self.device.type

    def inputs(self, m: int) -> list[Any]:
        with self.fake_probe.mode:
            joined = [torch.zeros(shape, dtype=dtype, device=self.device)
                      .requires_grad_(dtype.is_floating_point) for shape, dtype in self.shapes]
        return [*joined, *(self.fake_probe.fake(v) for v in self.free_values)]


class TwoPhaseCostModel(CostModel):
    """A ``CostModel`` of P (per microbatch) with F and C's whole-batch terms added."""

    def __init__(self, p_model: CostModel, coupled: Probe, frontier_bytes: float,
                 static: Any) -> None:
        super().__init__(p_model._prober, static, p_model.name, p_model.shard,
                         p_model.precision)
        self.__dict__.update({k: v for k, v in p_model.__dict__.items()
                              if k in ("_exact", "_fit", "_fit_from", "fit_note", "probes_run")})
        self.coupled_probe = coupled
        self.frontier_bytes = frontier_bytes

    @property
    def coupled_bytes(self) -> float:
        """C's peak live activations at the whole batch (forward and backward)."""
        return float(self.coupled_probe.live.max(initial=0.0))

    def memory(self, pbs: int, mbs: int, num_microbatches: int, spec: SystemSpec
               ) -> MemoryEstimate:
        base = super().memory(pbs, mbs, num_microbatches, spec)
        frontier, coupled = 2 * self.frontier_bytes, self.coupled_bytes
        return replace(base, frontier=frontier, coupled=coupled,
                       peak=base.peak + frontier + coupled)

    def coupled_share(self, mbs: int) -> float:
        """C's share of the step's activation memory at microbatch size ``mbs``."""
        p = self.figures(mbs).activation_peak_bytes
        total = p + self.coupled_bytes + 2 * self.frontier_bytes
        return self.coupled_bytes / total if total > 0 else 0.0

    def estimate_split(self, sizes: Sequence[int], mbs: int, k: int, spec: SystemSpec
                       ) -> Estimate:
        est = super().estimate_split(sizes, mbs, k, spec)
        gbs = sum(sizes)
        f = est.figures
        share = f.flops_forward / f.flops if f.flops > 0 else 0.5
        t = est.time
        extra = (t.compute + t.overhead) * share  # P's forward once more, per microbatch
        coupled = self.probe_seconds(self.coupled_probe, spec)[0]
        step = t.step + extra + coupled
        time = replace(t, extra_forward=extra, coupled=coupled, step=step,
                       samples_per_second=gbs / step if step > 0 else t.samples_per_second)
        return replace(est, time=time)

    def describe(self) -> str:
        return (super().describe() + f"; two-phase: frontier {format_bytes(self.frontier_bytes)}"
                f" at the whole batch, coupled part {format_bytes(self.coupled_bytes)} of "
                "activations (probed once at the whole batch)")


def analyse_two_phase_cost(analysis: BatchAnalysis, values: Sequence[Any],
                           in_dims: Sequence[int | None], *, pbs: int,
                           name: str | None = None, cut: Cut | None = None,
                           shard: ShardSpec | None = None, precision: Precision | None = None
                           ) -> TwoPhaseCostModel:
    """The cost model of ``analysis``'s graph run as a two-phase step (``cut``: the graph
    cut as the rewrite runs it, when the analysis made it already)."""
    body, coupled, part, free_nodes = two_phase_parts(analysis, cut)
    p_model = analyse_cost(body, values, in_dims, pbs=pbs, name=name, shard=shard,
                           precision=precision)
    placeholders = [n for n in analysis.graph_module.graph.nodes if n.op == "placeholder"]
    by_name = {p.name: v for p, v in zip(placeholders, values)}
    free = [by_name[n.name] if n.name in by_name else shaped_like(n) for n in free_nodes]  # draws
    tensors = [t for v in values for t in ([v] if isinstance(v, torch.Tensor) else [])]
    device = tensors[0].device if tensors else torch.device("cpu")
    grown = _grown(placeholders, values, in_dims)
    prober = _CoupledProber(coupled, free_nodes, free, device, analysis.coupled_loss, grown)
    static = static_figures(analysis.graph_module, values, in_dims, analysis.fused)
    static = replace(static, output_bytes_per_sample=p_model.static.output_bytes_per_sample)
    with probe_precision(precision, prober):
        coupled_probe = prober(1)
    return TwoPhaseCostModel(p_model, coupled_probe, part.frontier_bytes(grown), static)


def _grown(placeholders: Sequence[fx.Node], values: Sequence[Any],
           in_dims: Sequence[int | None]) -> int:
    """How many samples more ``values`` (a batch-size variant's example) hold than the
    analysis's example did: its frontier is sized at that batch, not the analysis's."""
    for node, value, d in zip(placeholders, values, in_dims):
        info = node.meta.get(SHAPES)
        if d is not None and isinstance(value, torch.Tensor) and isinstance(info, ValueInfo) \
                and info.is_tensor and d < len(info.shape_a):
            return int(value.shape[d]) - int(info.shape_a[d])
    return 0


def two_phase_reason(model: TwoPhaseCostModel, est: Estimate) -> str:
    """What ``plan.reason`` says of a two-phase plan: F's bytes, C's share, the extra time."""
    share = model.coupled_share(est.mbs)
    t = est.time
    return (f"two-phase step (a loss that couples samples): frontier "
            f"{format_bytes(model.frontier_bytes)} for the whole batch, the coupled part "
            f"{share:.0%} of activation memory, the extra forward "
            f"{t.extra_forward / t.step if t.step > 0 else 0.0:.0%} of step time")
