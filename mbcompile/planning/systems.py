"""System specs: the numbers the memory and time model needs about one system.

A ``SystemSpec`` is a frozen dataclass; ``compile(..., system=...)`` takes one, or
the name of a preset:

==============  ==========================================================
``"host"``      this machine, derived from ``/proc`` and the CPU flags
                (see :func:`host_spec`); the default
``"wafer-sim"`` a *simulated* wafer-scale system with weights streamed
                from off-chip memory: a model to explore the trade-offs
                with, not a claim about any product
``"a100-80gb"`` NVIDIA A100 80 GB SXM
``"a100-40gb"`` NVIDIA A100 40 GB SXM
``"h100-80gb"`` NVIDIA H100 80 GB SXM
==============  ==========================================================

Each preset's ``source`` field says where its numbers come from.  A user-defined
system is just another instance::

    >>> spec = SystemSpec("my-card", memory_bytes=24e9, peak_flops=165e12,
    ...                   peak_flops_fp32=82e12, memory_bandwidth=1.0e12)
    >>> get_system(spec) is spec
    True
    >>> get_system("a100-80gb").memory_bytes / 1e9
    80.0

:func:`measure_host` times a matmul, a copy and a small op on this machine and
returns the measured spec; it is how the ``"host"`` calibration constants below
were obtained, and is never called by ``compile()``: a plan must not depend on
timing (docs/mbs.md, its opening lines), so every preset is pure data.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from mbcompile.errors import ArgumentTypeError, PlanError

__all__ = [
    "PRESETS",
    "TEXT_FIELDS",
    "SystemSpec",
    "get_system",
    "host_spec",
    "measure_host",
    "system_names",
]

_GB = 1e9
_MiB = 2**20
#: The ``SystemSpec`` fields that are words, not figures.
TEXT_FIELDS = ("name", "source", "reserved_note", "optimizer_source")
_OPTIONAL_FIELDS = ("weight_bandwidth", "cache_bandwidth", "devices_per_node",
                    "inter_node_bandwidth", "inter_node_latency_s")


@dataclass(frozen=True)
class SystemSpec:
    """One system (a chip, a card, a wafer, a CPU host) as the cost model sees it.

    Rates are per second and per system; memory in bytes.

    - ``memory_bytes``: memory a training step may use on one system.
    - ``peak_flops``: dense 16-bit (bf16/fp16) peak; ``peak_flops_fp32``: fp32 peak
      (ops are charged at the rate of their dtype).
    - ``memory_bandwidth``: device memory bandwidth (the roofline's slope).
    - ``interconnect_bandwidth`` / ``interconnect_latency_s``: one direction of one
      system's link, used by the ring all-reduce of the gradients across systems.
    - ``microbatch_overhead_s``: fixed cost of one microbatch (loop, split views,
      starting backward); ``kernel_overhead_s``: fixed cost of each kernel (launch
      or eager dispatch); both make many small microbatches slower.
    - ``optimizer_bytes_per_param``: optimizer state per trainable parameter
      (8 for Adam's two fp32 moments, 0 for plain SGD); ``compile(optimizer=...)``
      replaces it with the optimizer's own layout (``planning/optimizer_state.py``) and
      says so in ``optimizer_source`` (empty: the system's assumption).
    - ``reserved_bytes``: memory a training step cannot use: the CUDA context and library
      workspaces, communication buffers (NCCL), the allocator's fragmentation; what is
      left, ``usable_bytes``, is what the plan must fit in. ``reserved_note`` says what it
      holds and where the figures come from.
    - ``weight_bandwidth``: ``None`` when weights, gradients and optimizer state
      live in device memory; a rate when they live off-chip and are streamed in
      every microbatch (weight streaming): they then cost time at this rate and
      no device memory.
    - ``cache_bytes`` / ``cache_bandwidth``: a last-level cache; an op whose
      inputs and outputs fit in it moves them at the cache's rate instead of
      ``memory_bandwidth`` (0 / None: not modelled).  It is what makes very large
      microbatches slower per sample on a CPU.
    - ``devices_per_node`` / ``inter_node_bandwidth`` / ``inter_node_latency_s``: the
      topology. Systems ``0 .. devices_per_node - 1`` share a node and its
      ``interconnect_bandwidth`` (NVLink); a collective over more systems than one node
      holds crosses the inter-node links (one direction of one system's share of the
      node's network), and a ring is as slow as the slowest link it crosses. ``None``:
      every system is on one node (one kind of link).
    """

    name: str
    memory_bytes: float
    peak_flops: float
    peak_flops_fp32: float
    memory_bandwidth: float
    interconnect_bandwidth: float = 25e9
    interconnect_latency_s: float = 10e-6
    microbatch_overhead_s: float = 50e-6
    kernel_overhead_s: float = 5e-6
    optimizer_bytes_per_param: float = 8.0
    weight_bandwidth: float | None = None
    cache_bytes: float = 0.0
    cache_bandwidth: float | None = None
    source: str = "user-defined"
    reserved_bytes: float = 0.0
    reserved_note: str = ""
    optimizer_source: str = ""
    devices_per_node: int | None = None
    inter_node_bandwidth: float | None = None
    inter_node_latency_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ArgumentTypeError(f"SystemSpec.name must be a non-empty str, got {self.name!r}")
        for f in fields(self):
            if f.name in TEXT_FIELDS:
                continue
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL_FIELDS:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ArgumentTypeError(
                    f"SystemSpec({self.name!r}).{f.name} must be a number, got {value!r}")
            positive = f.name in ("memory_bytes", "peak_flops", "peak_flops_fp32",
                                  "memory_bandwidth", "interconnect_bandwidth",
                                  "weight_bandwidth", "cache_bandwidth", "devices_per_node",
                                  "inter_node_bandwidth")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                need = "positive" if positive else "non-negative"
                raise PlanError(f"SystemSpec({self.name!r}).{f.name} must be finite and "
                                f"{need}, got {value!r}")
        if self.devices_per_node is not None and not isinstance(self.devices_per_node, int):
            raise ArgumentTypeError(f"SystemSpec({self.name!r}).devices_per_node must be an "
                                    f"int, got {self.devices_per_node!r}")
        if self.reserved_bytes >= self.memory_bytes:
            raise PlanError(f"SystemSpec({self.name!r}).reserved_bytes "
                            f"({self.reserved_bytes:.4g}) leaves nothing of memory_bytes "
                            f"({self.memory_bytes:.4g}): it must be smaller")

    @property
    def usable_bytes(self) -> float:
        """Memory a training step may use: ``memory_bytes - reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    def node_of(self, system: int) -> int:
        """The node that system ``system`` (0-based) is on (0 when all share one)."""
        return 0 if self.devices_per_node is None else system // self.devices_per_node

    def ring_link(self, num_csx: int) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a ring over ``num_csx`` systems: the slowest link it
        crosses; the inter-node link as soon as the systems span more than one node."""
        if self.node_of(num_csx - 1) == 0:
            return self.interconnect_bandwidth, self.interconnect_latency_s
        inter = self.inter_node_bandwidth or self.interconnect_bandwidth
        latency = self.inter_node_latency_s
        return (min(inter, self.interconnect_bandwidth),
                max(self.interconnect_latency_s,
                    self.interconnect_latency_s if latency is None else latency))

    @property
    def weight_streaming(self) -> bool:
        """True when weights live off-chip and are streamed in every microbatch."""
        return self.weight_bandwidth is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line: the figures that matter, in readable units."""
        weights = (f", weights streamed at {self.weight_bandwidth / _GB:.0f} GB/s"
                   if self.weight_bandwidth is not None else "")
        if self.cache_bytes and self.cache_bandwidth:
            weights += (f", {self.cache_bytes / 2**20:.0f} MiB cache at "
                        f"{self.cache_bandwidth / _GB:.0f} GB/s")
        return (f"{self.name}: {self.memory_bytes / _GB:.1f} GB, "
                f"{self.peak_flops / 1e12:.3g} TFLOP/s 16-bit / "
                f"{self.peak_flops_fp32 / 1e12:.3g} fp32, "
                f"{self.memory_bandwidth / _GB:.0f} GB/s memory, "
                f"{self.interconnect_bandwidth / _GB:.0f} GB/s link{weights}{self._topology()}"
                f"{self._reserved()}")

    def _topology(self) -> str:
        if self.devices_per_node is None:
            return ""
        inter = self.inter_node_bandwidth or self.interconnect_bandwidth
        return f", {self.devices_per_node} per node, {inter / _GB:.0f} GB/s between nodes"

    def _reserved(self) -> str:
        return (f", {self.reserved_bytes / _GB:.2f} GB reserved" if self.reserved_bytes else "")


# --------------------------------------------------------------------------- #
# Presets
# --------------------------------------------------------------------------- #

#: Eager PyTorch on a GPU pays a few microseconds of CPU dispatch and launch per
#: kernel; small kernels are bound by it.  10 us is the usual order of magnitude
#: (PyTorch performance tuning guide: "CPU overhead" / CUDA graphs motivation).
_GPU_KERNEL_OVERHEAD_S = 10e-6
#: One microbatch on a GPU: the Python loop, the split views and starting backward.
_GPU_MICROBATCH_OVERHEAD_S = 100e-6

#: What a GPU training step cannot use, per device (``SystemSpec.reserved_bytes``):
#: the CUDA context with its loaded kernels and the cuBLAS/cuDNN workspaces (about
#: 0.5 GiB with lazy module loading, PyTorch's default since CUDA 11.7);
_CUDA_CONTEXT_BYTES = 0.5 * 2**30
#: NCCL's buffers: ``NCCL_BUFFSIZE`` (4 MiB) per channel and peer, up to 32 channels on
#: NVLink, plus NVLink SHARP's buffers on Hopper: of the order of 1 GiB;
_NCCL_BUFFER_BYTES = 1.0 * 2**30
#: and the caching allocator's fragmentation: blocks reserved but not allocated, a few
#: percent of the device in steady training (5% taken here).
_FRAGMENTATION = 0.05


def _gpu(name: str, mib: int, **figures: Any) -> SystemSpec:
    """A GPU preset: ``mib`` the memory ``nvidia-smi`` reports; the reserved bytes above."""
    total = mib * _MiB
    reserved = _CUDA_CONTEXT_BYTES + _NCCL_BUFFER_BYTES + _FRAGMENTATION * total
    note = (f"CUDA context and workspaces {_CUDA_CONTEXT_BYTES / _GB:.2f} GB + NCCL buffers "
            f"{_NCCL_BUFFER_BYTES / _GB:.2f} GB + allocator fragmentation "
            f"{_FRAGMENTATION:.0%} of {total / _GB:.1f} GB (typical figures, not measured: "
            "see mbcompile/planning/systems.py)")
    return SystemSpec(name, memory_bytes=float(total), reserved_bytes=reserved,
                      reserved_note=note, microbatch_overhead_s=_GPU_MICROBATCH_OVERHEAD_S,
                      kernel_overhead_s=_GPU_KERNEL_OVERHEAD_S, devices_per_node=8,
                      interconnect_latency_s=10e-6, inter_node_latency_s=10e-6, **figures)


_PRESETS: dict[str, SystemSpec] = {
    "a100-80gb": _gpu(
        "a100-80gb", 81920,
        peak_flops=312e12,  # dense BF16/FP16 Tensor Core
        peak_flops_fp32=19.5e12,  # FP32 (no TF32: PyTorch's default for matmul)
        memory_bandwidth=2039e9,  # HBM2e, SXM
        interconnect_bandwidth=300e9,  # NVLink 3: 600 GB/s total, 300 GB/s each way
        inter_node_bandwidth=25e9,  # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU
        source="NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column; memory as nvidia-smi "
               "reports it, 81920 MiB); 8 per node with a 200 Gb/s NIC each (DGX A100 "
               "datasheet); overheads: typical eager PyTorch figures, not measured",
    ),
    "a100-40gb": _gpu(
        "a100-40gb", 40536,
        peak_flops=312e12,
        peak_flops_fp32=19.5e12,
        memory_bandwidth=1555e9,  # HBM2, SXM
        interconnect_bandwidth=300e9,
        inter_node_bandwidth=25e9,
        source="NVIDIA A100 Tensor Core GPU datasheet (40GB SXM column; memory as nvidia-smi "
               "reports it, 40536 MiB); 8 per node with a 200 Gb/s NIC each (DGX A100 "
               "datasheet); overheads: typical eager PyTorch figures, not measured",
    ),
    "h100-80gb": _gpu(
        "h100-80gb", 81559,
        peak_flops=989e12,  # dense BF16 Tensor Core (the datasheet's 1979 is with sparsity)
        peak_flops_fp32=67e12,
        memory_bandwidth=3350e9,  # HBM3, SXM5
        interconnect_bandwidth=450e9,  # NVLink 4: 900 GB/s total
        inter_node_bandwidth=50e9,  # DGX H100: one 400 Gb/s NDR InfiniBand port per GPU
        source="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column; memory as nvidia-smi "
               "reports it, 81559 MiB); 8 per node with a 400 Gb/s NIC each (DGX H100 "
               "datasheet); overheads: typical eager PyTorch figures, not measured",
    ),
    "wafer-sim": SystemSpec(
        "wafer-sim",
        memory_bytes=40 * _GB,
        peak_flops=1e15,
        peak_flops_fp32=0.25e15,
        memory_bandwidth=20e15,
        interconnect_bandwidth=150e9,
        interconnect_latency_s=50e-6,
        microbatch_overhead_s=1e-3,
        kernel_overhead_s=0.0,
        weight_bandwidth=150e9,
        reserved_note="none modelled (a model of a dataflow system, no runtime in its memory)",
        source="a MODEL of a wafer-scale system, not a claim about any product: on-chip "
               "memory (40 GB), its bandwidth (20 PB/s) and the I/O (1.2 Tb/s = 150 GB/s) "
               "are of the order of public Cerebras CS-2 figures; weights, gradients and "
               "optimizer state are assumed to stream from off-chip memory at the I/O rate "
               "every microbatch (weight streaming); the FLOP/s (1 PFLOP/s 16-bit) and the "
               "1 ms per-microbatch overhead are round assumptions; a dataflow machine has "
               "no per-kernel launch cost",
    ),
}

#: Read-only view of the named presets other than ``"host"`` (which is derived).
PRESETS: dict[str, SystemSpec] = dict(_PRESETS)


# --------------------------------------------------------------------------- #
# The host
# --------------------------------------------------------------------------- #

#: Calibrated on the project's 2-core AMD EPYC (Zen 4) VM, 2026-11.  Bandwidth:
#: :func:`measure_host` gave 173-185 GFLOP/s fp32 matmul and 34-40 GB/s copy with
#: 2 threads, so about 18 GB/s per core.  Overheads: a least-squares fit of the
#: process CPU time of compiled training steps (the MLP, CNN and tiny GPT of
#: ``mbcompile.models``, gbs 64, MBS 1 to 64, one torch thread) to
#: ``microbatches x (overhead + kernels x per-kernel) + roofline``: about 100 us
#: per microbatch and 30 us per kernel (eager dispatch and autograd included;
#: views are not counted as kernels, so their cost lands here too).
HOST_BANDWIDTH_PER_CORE = 18e9
#: Copies whose source and destination fit in the last-level cache ran at about
#: 90 GB/s on one core (1-4 MB buffers), against 8-18 GB/s from DRAM.
HOST_CACHE_BANDWIDTH_PER_CORE = 90e9
HOST_KERNEL_OVERHEAD_S = 30e-6
HOST_MICROBATCH_OVERHEAD_S = 100e-6


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _host_memory_bytes() -> float:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            return float(line.split()[1]) * 1024
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GB  # no way to know: a laptop-sized guess, said in the source field


def _host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _host_cpu() -> tuple[float, set[str]]:
    """(clock in Hz, CPU flags) from /proc/cpuinfo; (2.5 GHz, {}) where unknown."""
    mhz, flags = 0.0, set()
    for line in _read("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "cpu MHz" and not mhz:
            mhz = float(value)
        elif key == "flags" and not flags:
            flags = set(value.split())
    max_khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
    if max_khz.isdigit():
        mhz = max(mhz, int(max_khz) / 1000)
    return (mhz or 2500.0) * 1e6, flags


def _cpu_count(cpu_list: str) -> int:
    """How many CPUs a sysfs list such as ``0-3,8`` names."""
    count = 0
    for part in cpu_list.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            count += int(b) - int(a) + 1
        elif part.strip().isdigit():
            count += 1
    return count


def _host_cache_bytes() -> float:
    """One core's share of the last-level cache, from sysfs; 0 where unknown.

    A shared cache divided by the CPUs that share it: with every core busy (or
    other processes on the machine) that is what one core's working set gets.
    """
    best = 0.0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = os.listdir(base)
    except OSError:
        return 0.0
    for entry in entries:
        size = _read(f"{base}/{entry}/size").strip().upper()
        if not size or _read(f"{base}/{entry}/type").strip() == "Instruction":
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            sharing = max(1, _cpu_count(_read(f"{base}/{entry}/shared_cpu_list")))
            best = max(best, float(digits) * scale / sharing)
    return best


def _flops_per_cycle(flags: set[str]) -> int:
    # fp32 FLOPs per cycle per core: two FMA pipes of the widest vector unit
    # (FMA = 2 FLOPs).  AVX-512 counts as 2 x 256-bit here, which is what
    # AMD Zen 4 has and what most Intel client parts reach in practice.
    if "avx512f" in flags or ("avx2" in flags and "fma" in flags):
        return 32
    if "avx" in flags:
        return 16
    return 8


@functools.lru_cache(maxsize=1)
def host_spec() -> SystemSpec:
    """``"host"``: this machine, derived from ``/proc`` with no timing at all.

    Memory is ``MemTotal``; fp32 peak is cores x clock x FLOPs per cycle (from
    the vector flags); 16-bit peak is twice that with ``avx512_bf16`` or AMX,
    else the same; the cache is one core's share of the last-level cache of
    sysfs (see ``_host_cache_bytes``); bandwidths and
    overheads are the calibration constants above, scaled by the core count.
    The interconnect is memory itself: simulated systems share this process.
    """
    cores = _host_cores()
    hz, flags = _host_cpu()
    fp32 = cores * hz * _flops_per_cycle(flags)
    bf16 = fp32 * (2 if ("avx512_bf16" in flags or "amx_bf16" in flags) else 1)
    bandwidth = cores * HOST_BANDWIDTH_PER_CORE
    return SystemSpec(
        "host",
        memory_bytes=_host_memory_bytes(),
        peak_flops=bf16,
        peak_flops_fp32=fp32,
        memory_bandwidth=bandwidth,
        interconnect_bandwidth=bandwidth / 2,  # an in-memory all-reduce reads and writes
        interconnect_latency_s=5e-6,
        microbatch_overhead_s=HOST_MICROBATCH_OVERHEAD_S,
        kernel_overhead_s=HOST_KERNEL_OVERHEAD_S,
        cache_bytes=_host_cache_bytes(),  # per core: each op runs on all of them
        cache_bandwidth=cores * HOST_CACHE_BANDWIDTH_PER_CORE,
        reserved_note=("none: MemTotal is the limit, shared with the OS and other processes "
                       "(a plan that fits may still swap on a busy host)"),
        source=(f"derived for this machine ({platform.machine()}, {cores} cores at "
                f"{hz / 1e9:.2f} GHz, {_flops_per_cycle(flags)} fp32 FLOP/cycle, MemTotal, "
                "a core's share of the last-level cache from sysfs); bandwidths "
                f"({HOST_BANDWIDTH_PER_CORE / 1e9:.0f} GB/s DRAM, "
                f"{HOST_CACHE_BANDWIDTH_PER_CORE / 1e9:.0f} GB/s cache per core) and overheads "
                "calibrated on a 2-core EPYC VM (see mbcompile/planning/systems.py)"),
    )


def system_names() -> tuple[str, ...]:
    """Every preset name, ``"host"`` first."""
    return ("host", *_PRESETS)


def get_system(system: str | SystemSpec | None) -> SystemSpec:
    """The spec for ``system``: a preset name, a ``SystemSpec``, or None (``"host"``)."""
    if system is None:
        return host_spec()
    if isinstance(system, SystemSpec):
        return system
    if isinstance(system, str):
        key = system.strip().lower()
        if key == "host":
            return host_spec()
        if key in _PRESETS:
            return _PRESETS[key]
        raise PlanError(f"unknown system {system!r}; presets are "
                        f"{', '.join(map(repr, system_names()))}, or pass a "
                        "mbcompile.SystemSpec(...) for your own")
    raise ArgumentTypeError(f"system must be a preset name, a SystemSpec or None, got "
                            f"{system!r} of type {type(system).__name__}")


# --------------------------------------------------------------------------- #
# Measuring (benchmarks and calibration only; compile() never calls it)
# --------------------------------------------------------------------------- #


def _best_of(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_host(reps: int = 3) -> SystemSpec:
    """``host_spec()`` with peak FLOP/s, bandwidth and kernel overhead measured here.

    Takes about a second.  Uses the default torch thread count.
    """
    import torch

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _best_of(lambda: a @ b, reps)
    x = torch.randn(32 * 2**20 // 4)
    y = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / _best_of(lambda: y.copy_(x), reps)
    s = torch.randn(8)
    per_op = _best_of(lambda: [s + 1 for _ in range(1000)], reps) / 1000
    base = host_spec()
    return replace(base, peak_flops_fp32=flops,
                   peak_flops=flops * base.peak_flops / base.peak_flops_fp32,
                   memory_bandwidth=bandwidth, interconnect_bandwidth=bandwidth / 2,
                   kernel_overhead_s=2 * per_op,  # forward plus its autograd share
                   source="measured on this machine by mbcompile.planning.systems.measure_host()")
