"""``"host"``: this machine as a ``SystemSpec``, derived from ``/proc`` and the CPU flags.

>>> host_spec().name
'host'

:func:`host_spec` reads no clock: its bandwidths and overheads are the calibration
constants below. :func:`measure_host` times a matmul, a copy and a small op on this
machine and returns the measured spec; it is how those constants were obtained, and
is never called by ``compile()``: a plan must not depend on timing (docs/mbs.md, its
opening lines).
"""

from __future__ import annotations

import functools
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace

from mbcompile.planning.system_spec import SystemSpec

__all__ = ["HOST_BANDWIDTH_PER_CORE", "HOST_CACHE_BANDWIDTH_PER_CORE",
           "HOST_FAULT_BANDWIDTH_PER_CORE", "HOST_FRESH_ALLOCATION_BYTES",
           "HOST_KERNEL_OVERHEAD_S", "HOST_MICROBATCH_OVERHEAD_S",
           "HOST_TRANSCENDENTAL_RATE_PER_CORE", "host_spec", "measure_host"]

_GB = 1e9

# --------------------------------------------------------------------------- #
# Derived from /proc and sysfs
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
#: ``torch.exp`` (and sigmoid, SiLU, GELU, log) over 64-256 Ki floats in cache ran at
#: 0.9-1.4 ns per element on one core (2026-12, :func:`measure_host`), against 0.24 ns
#: for an add: a vectorised polynomial per element, which no FLOP counter counts.
HOST_TRANSCENDENTAL_RATE_PER_CORE = 1e9
#: Writing a tensor the allocator has just mapped cost 2.3-3.5 us per 4 KiB page
#: (the kernel's page fault and zeroing; 8-131 MB tensors, :func:`measure_host`):
#: about 1.4 GB/s, a tenth of the copy bandwidth.
HOST_FAULT_BANDWIDTH_PER_CORE = 1.4e9
#: glibc serves an allocation above this with a fresh mapping, unmapped when it is freed
#: (its largest dynamic mmap threshold, ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit), unless
#: its heap has that much free; it trims the heap's top beyond twice this (the trim
#: threshold), so from there on every such tensor's pages fault again. Smaller ones are
#: reused from the heap.
HOST_FRESH_ALLOCATION_BYTES = 32 * 2**20


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
    """The cores a step runs on: those this process may use, and no more than torch's
    intra-op threads (``OMP_NUM_THREADS=1`` runs every kernel on one core)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    import torch

    return max(1, min(cores, torch.get_num_threads()))


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


def host_spec() -> SystemSpec:
    """``"host"``: this machine, derived from ``/proc`` with no timing at all.

    Memory is ``MemTotal``; fp32 peak is cores x clock x FLOPs per cycle (from
    the vector flags), the cores being those torch runs its kernels on
    (``torch.get_num_threads()``, at most the cores this process may use); 16-bit
    peak is twice that with ``avx512_bf16`` or AMX, else the same; the cache is one
    core's share of the last-level cache of sysfs (see ``_host_cache_bytes``);
    bandwidths, rates and overheads are the calibration constants above, scaled by
    the core count. The interconnect is memory itself: simulated systems share this
    process.
    """
    return _host_spec(_host_cores())


@functools.lru_cache(maxsize=4)
def _host_spec(cores: int) -> SystemSpec:
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
        transcendental_rate=cores * HOST_TRANSCENDENTAL_RATE_PER_CORE,
        fault_bandwidth=cores * HOST_FAULT_BANDWIDTH_PER_CORE,
        fresh_allocation_bytes=HOST_FRESH_ALLOCATION_BYTES,
        reserved_note=("none: MemTotal is the limit, shared with the OS and other processes "
                       "(a plan that fits may still swap on a busy host)"),
        source=(f"derived for this machine ({platform.machine()}, {cores} cores at "
                f"{hz / 1e9:.2f} GHz, {_flops_per_cycle(flags)} fp32 FLOP/cycle, MemTotal, "
                "a core's share of the last-level cache from sysfs); bandwidths "
                f"({HOST_BANDWIDTH_PER_CORE / 1e9:.0f} GB/s DRAM, "
                f"{HOST_CACHE_BANDWIDTH_PER_CORE / 1e9:.0f} GB/s cache per core), rates of "
                "transcendentals and page faults, and overheads calibrated on a 2-core EPYC VM "
                "(see mbcompile/planning/host.py)"),
    )



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
    """``host_spec()`` with peak FLOP/s, bandwidth, the transcendental and page-fault rates
    and the kernel overhead measured here.

    Takes about a second.  Uses the default torch thread count.
    """
    import torch

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3 / _best_of(lambda: a @ b, reps)
    x = torch.randn(32 * 2**20 // 4)
    y = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / _best_of(lambda: y.copy_(x), reps)
    small = torch.randn(2**16)
    out = torch.empty_like(small)
    transcendental = small.numel() / _best_of(lambda: torch.exp(small, out=out), reps)
    # a fresh tensor over the allocator's mmap threshold against the same bytes rewritten
    fresh = torch.empty(2 * HOST_FRESH_ALLOCATION_BYTES // 4)
    rewrite = _best_of(lambda: fresh.fill_(1.0), reps)
    first = _best_of(lambda: torch.empty_like(fresh).fill_(1.0), reps)
    faults = fresh.nbytes / max(first - rewrite, 1e-9)
    s = torch.randn(8)
    per_op = _best_of(lambda: [s + 1 for _ in range(1000)], reps) / 1000
    base = host_spec()
    return replace(base, peak_flops_fp32=flops,
                   peak_flops=flops * base.peak_flops / base.peak_flops_fp32,
                   memory_bandwidth=bandwidth, interconnect_bandwidth=bandwidth / 2,
                   transcendental_rate=transcendental, fault_bandwidth=faults,
                   kernel_overhead_s=2 * per_op,  # forward plus its autograd share
                   source="measured on this machine by mbcompile.planning.systems.measure_host()")
