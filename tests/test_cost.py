"""The cost model: per-MBS figures from fake-tensor probes, checked against real runs.

Oracles: torch's FlopCounterMode and saved-tensor hooks on *real* tensors, the
allocator's own peak (profiler memory events), hand-computed FLOPs of a linear
chain, and exact probes for the affine fit.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import allocator_peak
from torch.utils.flop_counter import FlopCounterMode

import mbcompile
from mbcompile.errors import CostModelError
from mbcompile.models import CNN, MLP, TinyGPT, make_cnn, make_mlp, make_tiny_gpt, token_batch
from mbcompile.planning.cost import CostModel, format_bytes
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.planning.probe import EXTRA_FLOPS
from mbcompile.planning.systems import get_system, system_names


def captured(model: nn.Module, batch: tuple[Any, ...], gbs: int) -> Any:
    """The batch analysis of the captured graph, as compile() builds it."""
    cm = mbcompile.compile(model, gbs, 1, "none", example_inputs=batch)
    return cm.analysis


def cost_of(model: nn.Module, batch: tuple[Any, ...], pbs: int) -> CostModel:
    return analyse_cost(captured(model, batch, pbs), batch, (0,) * len(batch), pbs=pbs)


MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "tiny_gpt": make_tiny_gpt}


@pytest.fixture(scope="module")
def costs() -> dict[str, tuple[CostModel, nn.Module, tuple[Any, ...]]]:
    out = {}
    for name, make in MAKERS.items():
        model, batch = make(8)
        out[name] = (cost_of(model, batch, 24), model, batch)
    return out


def real_step(model: nn.Module, batch: tuple[Any, ...], m: int) -> tuple[int, int]:
    """(FLOPs, saved activation bytes) of a real forward+backward on ``m`` samples."""
    args = tuple(t[:m] for t in batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {t.untyped_storage().data_ptr() for t in args}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    counter = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS)
    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = model(*args)
        grads = torch.autograd.grad(loss, [p for p in model.parameters()])
    del grads
    return counter.get_total_flops(), sum(saved.values())


@pytest.mark.parametrize("name", list(MAKERS))
def test_flops_and_saved_bytes_equal_a_real_run(costs, name: str) -> None:
    cost, model, batch = costs[name]
    for m in (1, 3, 8):
        flops, saved = real_step(model, batch, m)
        f = cost.figures(m)
        assert f.flops == flops, (m, f.flops, flops)
        assert f.saved_bytes == saved, (m, format_bytes(f.saved_bytes), format_bytes(saved))


def test_a_linear_chain_costs_what_the_textbook_says() -> None:
    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.b(self.a(x)), y)

    batch = (torch.randn(6, 8), torch.randn(6, 4))
    cost = cost_of(Chain(), batch, 6)
    for m in (1, 5):
        f = cost.figures(m)
        assert f.flops_forward == 2 * m * 8 * 16 + 2 * m * 16 * 4
        # b: grad of its input and of its weight; a: of its weight only (x needs none)
        assert f.flops_backward == 2 * (2 * m * 16 * 4) + 2 * m * 8 * 16


def test_cpu_flash_attention_is_counted_and_causal_costs_half() -> None:
    """torch's counter has no formula for the CPU flash kernel; ours counts it."""
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    dense = 2 * (2 * (2 * 4) * 16 * 16 * 8)  # two batched matmuls: q @ k.T and p @ v
    for causal, expected in ((False, dense), (True, dense // 2)):
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as counter:
            F.scaled_dot_product_attention(q, q, q, is_causal=causal)
        assert counter.get_total_flops() == expected


@pytest.mark.parametrize("name", list(MAKERS))
def test_the_affine_fit_reproduces_exact_probes(costs, name: str) -> None:
    cost, _, _ = costs[name]
    assert cost.fitted, cost.fit_note
    assert "reproduces the exact probe at m=24" in cost.fit_note
    assert cost.probes_run == 3  # m = 1, 2 for the fit, 24 to check it
    assert all(cost.verify_fit([3, 5, 11, 17]).values())
    per_sample = cost.figures(2).flops - cost.figures(1).flops
    assert cost.figures(24).flops == pytest.approx(24 * per_sample)  # no batch-free compute


class SizeOneIsSpecial(nn.Module):
    """An extra op at batch size 1 only: m = 1 needs its own probe."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if x.shape[0] == 1:
            h = h * 1.0
        return h.square().mean()


class GrowsWithBatch(nn.Module):
    """One op per sample: no affine fit holds."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(x.shape[0]):
            h = h * 1.0
        return h.square().mean()


def test_a_size_one_special_case_keeps_its_own_probe() -> None:
    cost = analyse_cost(SizeOneIsSpecial(), (torch.randn(8, 4),), (0,), pbs=8)
    assert cost.fitted and "m=1 differs" in cost.fit_note
    assert cost.figures(1).exact and not cost.figures(5).exact
    assert cost.figures(1).kernels == cost.figures(5).kernels + 2  # the mul and its grad


def test_a_graph_that_is_not_affine_is_probed_at_every_size() -> None:
    cost = analyse_cost(GrowsWithBatch(), (torch.randn(8, 4),), (0,), pbs=8)
    assert not cost.fitted and "probed exactly" in cost.fit_note
    assert cost.figures(5).exact
    assert cost.figures(6).kernels == cost.figures(5).kernels + 2  # one more mul, and its grad


def test_a_model_that_cannot_run_on_fake_tensors_raises_cost_model_error() -> None:
    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum() * float(x.sum().item())

    with pytest.raises(CostModelError, match="fake tensors at microbatch size 1"):
        analyse_cost(ReadsValues(), (torch.randn(8, 4),), (0,), pbs=8)


def test_a_pickled_cost_model_answers_from_its_fit(costs) -> None:
    import pickle

    cost, _, _ = costs["cnn"]
    twin = pickle.loads(pickle.dumps(cost))
    assert twin.figures(13) == cost.figures(13)
    spec = get_system("h100-80gb")
    assert twin.estimate(40, 2, 5, spec) == cost.estimate(40, 2, 5, spec)
    fresh = analyse_cost(GrowsWithBatch(), (torch.randn(8, 4),), (0,), pbs=4)
    with pytest.raises(CostModelError, match="without its graph"):
        pickle.loads(pickle.dumps(fresh)).figures(7)  # no fit: it would need a probe


def test_probes_leave_the_model_untouched(costs) -> None:
    _, model, _ = costs["mlp"]
    assert all(p.grad is None and not p.is_meta and type(p) is nn.Parameter
               for p in model.parameters())


# --------------------------------------------------------------------------- #
# Memory: predicted peak against the allocator's measured peak
# --------------------------------------------------------------------------- #


def _memory_case(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "tiny_gpt":
        return TinyGPT(vocab=128, width=32, depth=2, heads=4, seq=32), token_batch(16, 32, 128)
    if name == "mlp":
        return MLP(features=64, hidden=256, out=8), (torch.randn(32, 64, generator=g),
                                                      torch.randn(32, 8, generator=g))
    return CNN(channels=3, classes=10, width=16), (torch.randn(32, 3, 16, 16, generator=g),
                                                   torch.randint(0, 10, (32,), generator=g))


@pytest.mark.parametrize("name,mbs", [("tiny_gpt", 4), ("mlp", 8), ("cnn", 8)])
def test_predicted_peak_memory_matches_the_allocator(name: str, mbs: int) -> None:
    model, batch = _memory_case(name)
    gbs = batch[0].shape[0]
    cm = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch)
    cost = analyse_cost(cm.analysis, batch, (0, 0), pbs=gbs)
    predicted = cost.estimate(gbs, 1, mbs, get_system("host")).memory
    measured = allocator_peak(cm, model, batch)
    assert predicted.peak == pytest.approx(measured, rel=0.10), (
        f"{name} mbs {mbs}: predicted {format_bytes(predicted.peak)} ({predicted.phase}), "
        f"measured {format_bytes(measured)}")


# --------------------------------------------------------------------------- #
# The estimate's arithmetic
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("system", system_names())
def test_the_breakdown_adds_up_and_time_falls_with_fewer_microbatches(costs, system) -> None:
    cost, _, _ = costs["tiny_gpt"]
    spec = get_system(system)
    times = []
    for mbs in (1, 2, 3, 4, 5, 6, 8, 12, 24):
        e = cost.estimate(48, 2, mbs, spec)
        m = e.memory
        assert m.peak == pytest.approx(m.static + m.inputs + m.outputs + m.activations
                                       + m.update)
        times.append(e.time.step)
    assert times == sorted(times, reverse=True)  # these microbatches all fit in any cache


def test_a_microbatch_that_outgrows_the_cache_is_slower_per_sample(costs) -> None:
    cost, _, _ = costs["tiny_gpt"]
    cached = replace(get_system("host"), cache_bytes=256e3, cache_bandwidth=1e12,
                     memory_bandwidth=1e9)
    small, large = (cost.microbatch_seconds(m, cached)[1] for m in (1, 24))
    assert large > 24 * small  # the roofline part: per sample, large costs more
    flat = replace(cached, cache_bytes=0.0)
    small, large = (cost.microbatch_seconds(m, flat)[1] for m in (1, 24))
    assert large < 24 * small


def test_all_reduce_is_a_ring_over_the_gradients(costs) -> None:
    cost, _, _ = costs["mlp"]
    spec = get_system("a100-80gb")
    assert cost.allreduce_seconds(1, spec) == 0
    grads = cost.static.trainable_bytes
    expected = 2 * 3 / 4 * grads / spec.interconnect_bandwidth + 6 * spec.interconnect_latency_s
    assert cost.allreduce_seconds(4, spec) == pytest.approx(expected)
    assert cost.estimate(48, 4, 3, spec).time.allreduce == pytest.approx(expected)


def test_uneven_microbatches_are_summed_size_by_size(costs) -> None:
    cost, _, _ = costs["cnn"]
    spec = get_system("a100-40gb")
    e = cost.estimate(10, 3, 2, spec)  # systems 4, 3, 3; 2 microbatches: (2, 2) and (2, 1)
    t2 = cost.microbatch_seconds(2, spec)[0]
    accumulate = 3 * cost.static.trainable_bytes / spec.memory_bandwidth \
        + cost.static.num_param_tensors * spec.kernel_overhead_s
    assert e.time.step == pytest.approx(2 * t2 + accumulate + e.time.allreduce
                                        + e.time.optimizer)
    assert e.num_microbatches == 2


def test_weight_streaming_keeps_weights_off_the_device(costs) -> None:
    cost, _, _ = costs["tiny_gpt"]
    streamed = cost.estimate(24, 1, 4, get_system("wafer-sim")).memory
    assert streamed.params == streamed.grads == streamed.optimizer == 0
    local = cost.estimate(24, 1, 4, replace(get_system("wafer-sim"), weight_bandwidth=None))
    assert local.memory.params == cost.static.param_bytes
    # streaming every microbatch makes small microbatches costlier than on-chip weights
    ratio = cost.estimate(24, 1, 1, get_system("wafer-sim")).time.step / \
        cost.estimate(24, 1, 24, get_system("wafer-sim")).time.step
    assert ratio > 2


def test_outputs_kept_for_the_caller_are_counted(costs) -> None:
    cost, _, batch = costs["tiny_gpt"]
    logits = 16 * 64 * 4  # seq x vocab floats per sample
    assert cost.static.output_bytes_per_sample == logits
    assert cost.static.input_bytes_per_sample == sum(t[0].nbytes for t in batch)
    m = cost.estimate(24, 1, 3, get_system("host")).memory
    assert m.outputs >= (24 - 3) * logits


def test_a_model_without_a_single_loss_keeps_every_microbatch() -> None:
    class TwoLosses(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.tanh(self.lin(x))
            return h.mean(), h.square().mean()

    batch = (torch.randn(12, 8),)
    cost = cost_of(TwoLosses(), batch, 12)
    assert not cost.static.fused
    e = cost.estimate(12, 1, 3, get_system("host"))
    assert e.memory.saved == pytest.approx(cost.figures(12).saved_bytes)
