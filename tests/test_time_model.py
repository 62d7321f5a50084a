"""The time model's CPU terms: transcendental values, fresh allocations' page faults, the
join of the microbatches' outputs, and ``measure=True`` breaking a flat curve's tie.

Oracles: the element counts of the ops (an exp per element, per attention score), the
bytes of the tensors a model makes, and fake clocks. No wall time is asserted: how
right the figures are on this host is ``benchmarks/bench_auto_time.py``'s question.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.models import make_mlp
from mbcompile.planning import transcendentals
from mbcompile.planning.cost import CostModel
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.planning.plan import make_plan
from mbcompile.planning.plan import per_system_batch_sizes as split
from mbcompile.planning.search import Selector
from mbcompile.planning.systems import SystemSpec

aten = torch.ops.aten
WIDTH, VOCAB = 4, 1000  # the weight (16 KB) below the fresh size, 8 logits (32 KB) at it

#: a CPU-like system whose terms are easy to read: one rate per kind of work
SPEC = SystemSpec("cpu", memory_bytes=64e9, peak_flops=1e11, peak_flops_fp32=1e11,
                  memory_bandwidth=1e10, microbatch_overhead_s=0.0, kernel_overhead_s=0.0,
                  transcendental_rate=1e9, fault_bandwidth=1e9,
                  fresh_allocation_bytes=4 * 8 * VOCAB)  # the logits of 8 samples


class Head(nn.Module):
    """A linear layer to a vocabulary and its cross-entropy: log_softmax over the logits,
    as a language model's head."""

    def __init__(self, vocab: int = VOCAB) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(x)
        return F.cross_entropy(logits, y), logits


def head_cost(outputs: str = "all", vocab: int = VOCAB, pbs: int = 32) -> CostModel:
    torch.manual_seed(0)
    model = Head(vocab)
    batch = (torch.randn(8, WIDTH), torch.randint(0, vocab, (8,)))
    cm = mbcompile.compile(model, pbs, 1, "none", example_inputs=batch, outputs=outputs)
    return analyse_cost(cm.analysis, batch, (0, 0), pbs=pbs,
                        kept_outputs=None if outputs == "all" else frozenset({0}))


@pytest.fixture(scope="module")
def head() -> CostModel:
    return head_cost()


def _ops(cost: CostModel, m: int, name: str) -> np.ndarray:
    p = cost._timed(m)
    return np.array([op.startswith(f"aten.{name}.") for op in p.ops])


# ------------------------------------------------------------------ transcendentals
def test_transcendental_counts_are_element_counts() -> None:
    x = torch.randn(4, 10)
    assert transcendentals.count(aten._log_softmax.default, (x, -1, False), {}, None) == 40
    assert transcendentals.count(aten.exp.default, (x,), {}, x) == 40
    assert transcendentals.count(aten.add.Tensor, (x, x), {}, x) == 0  # priced by bytes
    # a square is a multiply; a square root or a 1.7th power goes through exp and log
    assert transcendentals.count(aten.pow.Tensor_Scalar, (x, 2), {}, x) == 0
    assert transcendentals.count(aten.pow.Tensor_Scalar, (x, 0.5), {}, x) == 40
    q = torch.randn(2, 3, 16, 8)  # (batch, heads, queries, dim): an exp per score
    flash = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert transcendentals.count(flash, (q, q, q), {}, None) == 2 * 3 * 16 * 16
    assert transcendentals.count(flash, (q, q, q, 0.0, True), {}, None) == 2 * 3 * 16 * 8


def test_log_softmax_is_counted_per_element_forward_and_backward(head) -> None:
    for m in (1, 5):
        p = head._timed(m)
        values = p.arrays()["transcendental"]
        assert values[_ops(head, m, "_log_softmax")].sum() == m * VOCAB
        assert values[_ops(head, m, "_log_softmax_backward_data")].sum() == m * VOCAB
        assert values.sum() == 2 * m * VOCAB  # nothing else in the head computes one


def test_a_log_softmax_heavy_model_is_modelled_slower_with_the_rate(head) -> None:
    without = replace(SPEC, transcendental_rate=None)
    t = head.microbatch_seconds(4, SPEC)[0]
    assert t > head.microbatch_seconds(4, without)[0]
    slow = replace(SPEC, transcendental_rate=1e6)
    # at a slow rate the two softmax ops take their exps' time, whatever their bytes
    compute, _, _ = head._op_seconds(head._timed(4), slow)
    softmax = _ops(head, 4, "_log_softmax") | _ops(head, 4, "_log_softmax_backward_data")
    assert compute[softmax].tolist() == [4 * VOCAB / 1e6] * 2
    assert head.microbatch_seconds(4, slow)[0] > 2 * 4 * VOCAB / 1e6 > 100 * t


# ------------------------------------------------------------- fresh allocations
def test_the_main_allocation_of_each_op_is_recorded(head) -> None:
    for m in (3, 8):
        p = head._timed(m)
        mm = _ops(head, m, "addmm") & ~p.backward
        assert p.arrays()["allocated"][mm].tolist() == [4 * m * VOCAB]  # the logits


def test_page_faults_are_charged_from_the_fresh_allocation_size_on(head) -> None:
    without = replace(SPEC, fault_bandwidth=None)

    def faults(m: int) -> float:
        return head.microbatch_seconds(m, SPEC)[0] - head.microbatch_seconds(m, without)[0]

    assert faults(8) == 0.0  # the logits of 8 samples: at the mmap threshold, reused
    fresh = head._timed(16).arrays()["allocated"]
    fresh = fresh[fresh >= 2 * SPEC.fresh_allocation_bytes].sum()
    assert fresh >= 3 * 4 * 16 * VOCAB  # logits, log_softmax, their gradients
    # from twice the threshold on (glibc's trim threshold) every one is fresh
    assert faults(16) == pytest.approx(fresh / SPEC.fault_bandwidth)
    assert faults(32) == pytest.approx(2 * faults(16))
    # in between, in proportion: 12 samples are half way
    assert faults(12) == pytest.approx(0.5 * 12 / 16 * faults(16))


# ------------------------------------------------------------------------ the join
def test_the_join_scales_with_the_kept_outputs(head) -> None:
    def join(cost: CostModel, gbs: int, mbs: int) -> float:
        return cost.estimate(gbs, 1, mbs, SPEC).time.join

    logits = 4 * VOCAB  # bytes per sample
    assert join(head, 16, 16) == 0.0  # one microbatch: nothing to join
    assert join(head, 16, 4) == pytest.approx(2 * 16 * logits / SPEC.memory_bandwidth
                                              + 16 * logits / SPEC.fault_bandwidth)
    assert join(head, 32, 4) == pytest.approx(2 * join(head, 16, 4))
    e = head.estimate(16, 1, 4, SPEC).time
    assert e.step == pytest.approx(e.compute + e.overhead + e.accumulate + e.join
                                   + e.optimizer)
    assert join(head_cost("loss", pbs=16), 16, 4) == 0.0  # the loss alone: no logits kept


# ---------------------------------------------------------- measure=True's tie-break
#: every MBS costs the same on it (the FLOPs, the same per sample, are all there is to
#: wait for): the modelled curve is flat
FLAT = SystemSpec("flat", memory_bytes=1e12, peak_flops=1e6, peak_flops_fp32=1e6,
                  memory_bandwidth=1e18, microbatch_overhead_s=0.0, kernel_overhead_s=0.0)
#: a second per microbatch: the fewest microbatches win by far
STEEP = replace(FLAT, name="steep", microbatch_overhead_s=1.0)


def _mlp_cost() -> tuple[CostModel, Any]:
    model, batch = make_mlp(8)
    cm = mbcompile.compile(model, 8, 1, "none", example_inputs=batch)
    return analyse_cost(cm.analysis, batch, (0, 0), pbs=16), batch


@pytest.mark.parametrize("clock,fastest", [
    (lambda m: 1.0, 16),   # a fixed cost per microbatch: the fewest microbatches
    (lambda m: m * m, 1),  # cost grows faster than the samples: the smallest
])
def test_measure_breaks_the_tie_of_a_flat_curve(clock, fastest) -> None:
    cost, _ = _mlp_cost()
    modelled = make_plan(16, 1, "auto", chooser=Selector(cost, FLAT, split(16, 1)).auto)
    timed = make_plan(16, 1, "auto",
                      chooser=Selector(cost, FLAT, split(16, 1), timer=clock).auto)
    assert timed.mbs == fastest
    assert f"mbs={fastest} was fastest" in timed.reason
    assert "was fastest" not in modelled.reason


def test_measure_leaves_a_clear_modelled_winner_alone() -> None:
    cost, _ = _mlp_cost()
    plan = make_plan(16, 1, "auto", chooser=Selector(
        cost, STEEP, split(16, 1), timer=lambda m: m * m).auto)
    assert plan.mbs == 16 and "was fastest" not in plan.reason
