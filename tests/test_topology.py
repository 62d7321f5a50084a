"""Topology: systems on nodes, the gradient all-reduce priced on the links it crosses and
overlapped with the last backward as the runtime does it."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from mbcompile.execution.distributed import OverlappedReduce
from mbcompile.models import make_mlp
from mbcompile.planning import buckets
from mbcompile.planning.cost_analysis import analyse_cost
from mbcompile.planning.systems import SystemSpec, get_system

NODE = SystemSpec("node-of-4", memory_bytes=1e12, peak_flops=1e14, peak_flops_fp32=1e13,
                  memory_bandwidth=1e12, interconnect_bandwidth=100e9,
                  interconnect_latency_s=2e-6, devices_per_node=4,
                  inter_node_bandwidth=10e9, inter_node_latency_s=8e-6)


@pytest.fixture(scope="module")
def mlp():
    model, batch = make_mlp(8)
    return analyse_cost(model, batch, (0, 0), pbs=8)


def _ring(cost, n: int, bandwidth: float, latency: float) -> float:
    return 2 * (n - 1) / n * cost.static.trainable_bytes / bandwidth + 2 * (n - 1) * latency


def test_a_ring_within_a_node_runs_at_the_node_link(mlp) -> None:
    assert NODE.ring_link(4) == (100e9, 2e-6)
    assert mlp.allreduce_seconds(4, NODE) == pytest.approx(_ring(mlp, 4, 100e9, 2e-6))


def test_a_ring_over_nodes_is_bounded_by_the_inter_node_link(mlp) -> None:
    assert NODE.ring_link(5) == (10e9, 8e-6)
    assert mlp.allreduce_seconds(8, NODE) == pytest.approx(_ring(mlp, 8, 10e9, 8e-6))
    assert mlp.allreduce_seconds(8, NODE) > 5 * mlp.allreduce_seconds(4, NODE)
    assert [NODE.node_of(i) for i in (0, 3, 4, 9)] == [0, 0, 1, 2]


def test_without_a_topology_every_system_shares_one_link(mlp) -> None:
    flat = replace(NODE, devices_per_node=None)
    assert flat.ring_link(64) == (100e9, 2e-6)
    assert mlp.allreduce_seconds(64, flat) == pytest.approx(_ring(mlp, 64, 100e9, 2e-6))


def test_gpu_presets_are_eight_per_node_with_a_nic_each(mlp) -> None:
    h100 = get_system("h100-80gb")
    assert h100.devices_per_node == 8 and h100.ring_link(8)[0] == 450e9
    assert h100.ring_link(16)[0] == h100.inter_node_bandwidth == 50e9
    assert "8 per node" in h100.describe()


@pytest.mark.parametrize("width", [64, 700])
def test_the_hidden_share_is_all_but_the_runtimes_last_bucket(width: int) -> None:
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    params = list(model.parameters())
    reduce = OverlappedReduce(params)  # the runtime's layout (no process group needed)
    total = sum(p.numel() * p.element_size() for p in params)
    last = sum(params[i].numel() * params[i].element_size() for i in reduce.buckets[-1])
    cost = analyse_cost(nn.Sequential(model), (torch.randn(4, width),), (0,), pbs=4)
    hidden = cost.hidden_seconds(1.0, last_backward=10.0)  # a backward longer than it
    # the model's last bucket is the runtime's cap; the runtime's holds whole tensors
    assert hidden == pytest.approx(1 - min(1.0, buckets.bucket_cap(total) / total))
    assert abs(hidden - (1 - last / total)) <= max(p.numel() * 4 for p in params) / total
    if width == 64:  # a gradient under 1 MiB is one bucket, sent when the backward ends
        assert len(reduce.buckets) == 1 and hidden == 0


#: bucket settings a user may choose (``mbcompile.buckets``), and the hidden share each gives
#: 16 layers of 256 KiB weights (4.2 MB of gradients): by default 1 MiB buckets hide 3/4.
SETTINGS = {
    "default": ({}, 0.75),
    "two-buckets": ({"MIN_BUCKETS": 2}, 0.5),
    "half-mib-cap": ({"BUCKET_BYTES": 2**19, "FIRST_BUCKET_BYTES": 2**18}, 0.875),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_changed_bucket_settings_reach_the_plan_and_the_run_alike(monkeypatch, setting) -> None:
    """The plan is made after the user sets ``mbcompile.buckets``: its hidden share of the
    all-reduce is the one the runtime's layout leaves, under every setting."""
    changes, share = SETTINGS[setting]
    for name, value in changes.items():
        monkeypatch.setattr(buckets, name, value)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(16)))
    params = list(model.parameters())
    reduce = OverlappedReduce(params)
    total = sum(p.numel() * p.element_size() for p in params)
    sizes = [sum(params[i].numel() * params[i].element_size() for i in b)
             for b in reduce.buckets[1:]]  # after the small first one: cut at the cap
    hidden = analyse_cost(model, (torch.randn(4, 256),), (0,), pbs=4).hidden_seconds(
        1.0, last_backward=10.0)
    assert hidden == pytest.approx(share, abs=0.01)  # the setting took effect in the plan
    cap = (1 - hidden) * total  # the bucket the plan prices as the last one
    assert cap - 256 * 257 * 4 < max(sizes) <= cap + 1  # the run's cap, to one tensor


def test_the_step_pays_only_the_all_reduce_the_last_backward_does_not_hide(mlp) -> None:
    big = copy.copy(mlp)  # the same graph, with a 100 MiB gradient to reduce
    big.static = replace(mlp.static, trainable_bytes=100 * 2**20)
    for link in (1e9, 1e13):  # slower than the backward, and faster
        spec = replace(NODE, inter_node_bandwidth=link, interconnect_bandwidth=link)
        e = big.estimate(16, 8, 2, spec)
        t = e.time
        backward = big.backward_seconds(2, spec)
        assert t.allreduce == pytest.approx(big.allreduce_seconds(8, spec))
        assert t.allreduce_hidden == pytest.approx(min(0.75 * t.allreduce, backward))
        assert t.step == pytest.approx(t.compute + t.overhead + t.accumulate + t.allreduce
                                       - t.allreduce_hidden + t.optimizer)
        assert 0 < t.allreduce_hidden <= t.allreduce
