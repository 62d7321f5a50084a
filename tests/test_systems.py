"""System specs: presets and their sources, the derived host, validation, lookup."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mbcompile.errors import ArgumentTypeError, MbcompileError, PlanError
from mbcompile.planning import host, systems
from mbcompile.planning.systems import PRESETS, SystemSpec, get_system, host_spec, system_names


def test_the_presets_the_issue_names_exist() -> None:
    names = system_names()
    assert names[0] == "host"
    assert {"wafer-sim", "a100-80gb", "a100-40gb"} <= set(names)
    assert get_system("a100-80gb").memory_bytes == 81920 * 2**20  # as nvidia-smi reports it
    assert get_system("a100-40gb").memory_bytes == 40536 * 2**20


@pytest.mark.parametrize("name", ["a100-80gb", "a100-40gb", "h100-80gb"])
def test_gpu_presets_reserve_context_buffers_and_fragmentation(name: str) -> None:
    spec = get_system(name)
    reserved = systems._CUDA_CONTEXT_BYTES + systems._NCCL_BUFFER_BYTES \
        + systems._FRAGMENTATION * spec.memory_bytes
    assert spec.reserved_bytes == pytest.approx(reserved)
    assert spec.usable_bytes == spec.memory_bytes - spec.reserved_bytes
    for part in ("CUDA context", "NCCL", "fragmentation"):
        assert part in spec.reserved_note
    assert "reserved" in spec.describe()


def test_reserved_bytes_must_leave_some_memory() -> None:
    with pytest.raises(PlanError, match="reserved_bytes"):
        SystemSpec("bad", memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=5e11,
                   memory_bandwidth=1e11, reserved_bytes=1e9)
    spec = SystemSpec("ok", memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=5e11,
                      memory_bandwidth=1e11, reserved_bytes=2.5e8)
    assert spec.usable_bytes == 7.5e8


@pytest.mark.parametrize("name", system_names())
def test_every_preset_says_where_its_numbers_come_from(name: str) -> None:
    spec = get_system(name)
    assert spec.name == name
    assert len(spec.source) > 30 and spec.source != "user-defined"
    json.dumps(spec.to_dict())  # reports serialise it
    assert spec.describe().startswith(name)


def test_the_wafer_scale_preset_is_named_as_a_model_not_a_claim() -> None:
    spec = get_system("wafer-sim")
    assert "sim" in spec.name
    assert "MODEL" in spec.source and "not a claim" in spec.source
    assert spec.weight_streaming  # weights stream in every microbatch
    assert not get_system("a100-80gb").weight_streaming


def test_gpu_presets_are_datasheet_figures() -> None:
    a100 = get_system("a100-80gb")
    assert (a100.peak_flops, a100.peak_flops_fp32, a100.memory_bandwidth) == \
        (312e12, 19.5e12, 2039e9)
    assert "datasheet" in a100.source


def test_host_is_derived_from_this_machine_without_timing(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(host.time, "perf_counter", lambda: calls.append(1) or 0.0)
    derive = host._host_spec.__wrapped__  # bypass the cache: derive it again, here
    spec = derive(host._host_cores())
    assert calls == []  # a plan must not depend on timing
    assert spec == derive(host._host_cores())  # deterministic
    assert spec.name == "host" and "derived" in spec.source
    assert spec.memory_bytes > 1e8
    assert spec.peak_flops_fp32 > 1e9 and spec.peak_flops >= spec.peak_flops_fp32
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    assert spec.memory_bytes == total * 1024


def test_host_rates_follow_torchs_threads(monkeypatch) -> None:
    """With one torch thread (OMP_NUM_THREADS=1) a step runs on one core: the host's
    peak, bandwidth and transcendental rate are one core's, its overheads unchanged."""
    import torch

    monkeypatch.setattr(host.os, "sched_getaffinity", lambda _: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    four = host_spec()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = host_spec()
    assert four.peak_flops_fp32 == pytest.approx(4 * one.peak_flops_fp32)
    assert four.memory_bandwidth == pytest.approx(4 * one.memory_bandwidth)
    assert four.transcendental_rate == pytest.approx(4 * one.transcendental_rate)
    assert four.kernel_overhead_s == one.kernel_overhead_s
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)  # no more than the cores
    assert host_spec() == four


def test_none_and_host_name_the_same_spec() -> None:
    assert get_system(None) is get_system("host") is get_system(" HOST ")


def test_a_user_spec_passes_through_and_is_frozen() -> None:
    spec = SystemSpec("mine", memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=5e11,
                      memory_bandwidth=1e11)
    assert get_system(spec) is spec
    assert spec.source == "user-defined"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory_bytes = 2e9  # type: ignore[misc]


def test_unknown_names_list_the_presets() -> None:
    with pytest.raises(PlanError) as info:
        get_system("a100")
    for name in system_names():
        assert repr(name) in str(info.value)
    assert "SystemSpec" in str(info.value)
    with pytest.raises(ArgumentTypeError):
        get_system(80e9)  # type: ignore[arg-type]


@pytest.mark.parametrize("field,value", [
    ("memory_bytes", 0), ("memory_bytes", -1.0), ("peak_flops", math.nan),
    ("memory_bandwidth", math.inf), ("kernel_overhead_s", -1e-6), ("weight_bandwidth", 0.0),
])
def test_bad_numbers_are_rejected_with_the_field_name(field: str, value: float) -> None:
    base = dict(memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=5e11,
                memory_bandwidth=1e11)
    base[field] = value
    with pytest.raises(MbcompileError, match=field):
        SystemSpec("bad", **base)


def test_bools_and_strings_are_not_numbers() -> None:
    with pytest.raises(ArgumentTypeError, match="memory_bytes"):
        SystemSpec("bad", memory_bytes=True, peak_flops=1e12, peak_flops_fp32=5e11,
                   memory_bandwidth=1e11)
    with pytest.raises(ArgumentTypeError, match="name"):
        SystemSpec("", memory_bytes=1e9, peak_flops=1e12, peak_flops_fp32=5e11,
                   memory_bandwidth=1e11)


def test_measure_host_measures_rates() -> None:
    # Structure only: how fast this machine is depends on its load (benchmarks/ measure it).
    spec = host.measure_host(reps=1)
    assert spec.name == "host" and "measured" in spec.source
    for rate in (spec.peak_flops_fp32, spec.memory_bandwidth, spec.kernel_overhead_s):
        assert 0 < rate < math.inf


def test_the_public_dict_is_a_copy(monkeypatch) -> None:
    monkeypatch.delitem(PRESETS, "a100-80gb")
    assert get_system("a100-80gb").name == "a100-80gb"
