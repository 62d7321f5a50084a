"""``SystemSpec``: the numbers the memory and time model needs about one system.

A frozen dataclass, checked when it is made; ``systems.py`` holds the named presets
and ``host.py`` derives the one for this machine. A user-defined system is just
another instance::

    >>> spec = SystemSpec("my-card", memory_bytes=24e9, peak_flops=165e12,
    ...                   peak_flops_fp32=82e12, memory_bandwidth=1.0e12)
    >>> spec.usable_bytes / 1e9
    24.0
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from mbcompile.errors import ArgumentTypeError, PlanError

__all__ = ["TEXT_FIELDS", "SystemSpec"]

_GB = 1e9
#: The ``SystemSpec`` fields that are words, not figures.
TEXT_FIELDS = ("name", "source", "reserved_note", "optimizer_source")
_OPTIONAL_FIELDS = ("weight_bandwidth", "cache_bandwidth", "devices_per_node",
                    "inter_node_bandwidth", "inter_node_latency_s", "transcendental_rate",
                    "fault_bandwidth")


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
    - ``transcendental_rate``: elements per second of an exp, log, tanh, erf or sigmoid
      (softmax, SiLU, GELU, attention's scores); an op takes at least its count over this
      rate. ``None``: not modelled (a GPU's special-function units keep such ops
      memory-bound).
    - ``fault_bandwidth`` / ``fresh_allocation_bytes``: an allocation above
      ``fresh_allocation_bytes`` may get fresh pages (a CPU allocator maps large tensors
      and unmaps them when freed), one from twice that size on always does, and writing
      them costs a page fault each, at ``fault_bandwidth`` bytes per second
      (``time_model._fresh_share``). ``None``: not modelled (caching allocators).
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
    transcendental_rate: float | None = None
    fault_bandwidth: float | None = None
    fresh_allocation_bytes: float = 0.0

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
                                  "inter_node_bandwidth", "transcendental_rate",
                                  "fault_bandwidth")
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

