"""The named systems: ``compile(..., system=...)`` takes a preset's name or a ``SystemSpec``.

A ``SystemSpec`` (``system_spec.py``) is a frozen dataclass of the numbers the memory
and time model needs about one system; the presets are:

==============  ==========================================================
``"host"``      this machine, derived from ``/proc`` and the CPU flags
                (``host.py``'s :func:`host_spec`); the default
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

Every preset is pure data: a plan must not depend on timing (docs/mbs.md, its
opening lines); ``host.py``'s ``measure_host`` is how the host's constants were
calibrated, and ``compile()`` never calls it.
"""


from __future__ import annotations

from typing import Any

from mbcompile.errors import ArgumentTypeError, PlanError
from mbcompile.planning.host import host_spec
from mbcompile.planning.system_spec import TEXT_FIELDS, SystemSpec

__all__ = ["PRESETS", "TEXT_FIELDS", "SystemSpec", "get_system", "host_spec", "system_names"]

_GB = 1e9
_MiB = 2**20


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

