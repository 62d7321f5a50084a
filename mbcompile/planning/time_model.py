"""The time half of the cost model: one microbatch, the gradient collective, the update.

>>> cost.microbatch_seconds(4, get_system("host"))   # (total, roofline, overhead, bound)

**Time** (per system, the slowest one sets the step)::

    microbatch(m) = microbatch_overhead + kernels x kernel_overhead
                    + max(sum over ops of op(m), streamed weight bytes / weight_bandwidth)
                    + gradient accumulation (every microbatch but the first)
    op(m) = max(flops / peak, bytes / bandwidth, transcendentals / transcendental_rate)
            + fresh bytes / fault_bandwidth   (its main output, when at least
                                               fresh_allocation_bytes: a CPU's page faults;
                                               from twice that on, all of it: _fresh_share)
    step = max over systems of the sum of its microbatches
           + joining the microbatches' kept outputs (several microbatches only):
             2 x outputs / bandwidth, + their fresh bytes / fault_bandwidth
           + ring all-reduce: 2 (n-1)/n x gradient bytes / link + 2 (n-1) x latency
             (link: the slowest the ring crosses, the inter-node one once the systems
             span nodes; SystemSpec.ring_link), less what overlaps the last
             microbatch's backward: every bucket but the last (the runtime launches
             each bucket as its gradients become final)
           + optimizer update (parameters, gradients and state read and written once)

The roofline is applied per op (a memory-bound LayerNorm next to a
compute-bound matmul; docs/mbs.md, "The cost model"), not to the whole step; the
per-op ``bytes`` include the parameters each op reads, so weights are re-read
every microbatch.  ``bandwidth`` is the cache's for an op whose inputs and
outputs fit in the system's modelled cache (the host's), else memory's: that
is what makes a too-large microbatch slower per sample on a CPU, as do the page
faults of tensors too large for the allocator to reuse (on the host, the logits
from about two samples of a 32000-word vocabulary on).  Transcendental values
(``transcendentals.py``: softmax's exps, GELU's erf) are charged at their own rate,
which no FLOP counter covers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mbcompile.planning import buckets
from mbcompile.planning.estimates import StaticFigures
from mbcompile.planning.probe import Probe
from mbcompile.planning.systems import SystemSpec

__all__ = ["TimeModel"]


class TimeModel:
    """The time formulas of ``CostModel`` (which supplies ``static``, ``shard`` and
    ``_timed``, the probe that times a microbatch size)."""

    static: StaticFigures
    shard: Any

    def _timed(self, m: int) -> Probe:
        raise NotImplementedError

    def microbatch_seconds(self, m: int, spec: SystemSpec) -> tuple[float, float, float, str]:
        """``(total, roofline, overhead, bound)`` of one microbatch of ``m`` samples."""
        return self.probe_seconds(self._timed(m), spec)

    def probe_seconds(self, p: Probe, spec: SystemSpec) -> tuple[float, float, float, str]:
        """``(total, roofline, overhead, bound)`` of what probe ``p`` ran."""
        compute, memory, faults = self._op_seconds(p, spec)
        roof = float((np.maximum(compute, memory) + faults).sum())
        stream = 0.0
        if spec.weight_bandwidth is not None:
            s = self.static
            # weights in for forward and again for backward, gradients out
            stream = (2 * s.param_bytes + s.trainable_bytes) / spec.weight_bandwidth
        overhead = spec.microbatch_overhead_s + int(p.kernel.sum()) * spec.kernel_overhead_s
        body = max(roof, stream)
        if stream > roof:
            bound = "weight streaming"
        elif overhead > body:
            bound = "overhead"
        else:
            bound = "compute" if compute.sum() >= memory.sum() + faults.sum() else "memory"
        return body + overhead, body, overhead, bound

    def backward_seconds(self, m: int, spec: SystemSpec) -> float:
        """The backward of one microbatch of ``m`` samples (its ops' roofline and kernel
        overheads): what the gradient all-reduce of the step's last microbatch overlaps."""
        p = self._timed(m)
        compute, memory, faults = self._op_seconds(p, spec)
        roof = float((np.maximum(compute, memory) + faults)[p.backward].sum())
        return roof + int((p.kernel & p.backward).sum()) * spec.kernel_overhead_s

    def _op_seconds(self, p: Probe, spec: SystemSpec
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op: seconds at the compute rate of its dtype (or of its transcendental
        values, when slower), seconds at the rate of the memory its bytes move through
        (the cache's when they fit in it), and seconds of the page faults of a fresh
        allocation (they add to the op's time: the kernel handles them, not the core's
        vector units)."""
        arrays = p.arrays()
        peak = np.where(p.fp32, spec.peak_flops_fp32, spec.peak_flops)
        compute = p.flops / peak
        if spec.transcendental_rate:
            compute = np.maximum(compute, arrays["transcendental"] / spec.transcendental_rate)
        moved = p.act_bytes if spec.weight_streaming else p.act_bytes + p.weight_bytes
        bandwidth = np.full_like(moved, spec.memory_bandwidth)
        if spec.cache_bytes > 0 and spec.cache_bandwidth:
            # an op whose inputs and outputs all fit in the cache moves them at its rate
            bandwidth[p.act_bytes + p.weight_bytes <= spec.cache_bytes] = spec.cache_bandwidth
        faults = np.zeros_like(moved)
        if spec.fault_bandwidth:
            fresh = arrays["allocated"]
            faults = fresh * _fresh_share(fresh, spec.fresh_allocation_bytes) / \
                spec.fault_bandwidth
        return compute, moved / bandwidth, faults

    def join_seconds(self, pbs: int, num_microbatches: int, spec: SystemSpec) -> float:
        """Joining the microbatches' kept per-sample outputs (the logits) into the step's:
        each piece read once, the whole written once into a fresh tensor (its page faults
        too, when the allocator maps it afresh). Nothing to join for one microbatch."""
        out = self.static.output_bytes_per_sample * pbs
        if num_microbatches <= 1 or out <= 0:
            return 0.0
        seconds = 2 * out / spec.memory_bandwidth
        if spec.fault_bandwidth:
            seconds += out * float(_fresh_share(np.array(out), spec.fresh_allocation_bytes)) \
                / spec.fault_bandwidth
        return seconds

    def _accumulate_seconds(self, spec: SystemSpec) -> float:
        if spec.weight_streaming or not self.static.training:
            return 0.0
        s = self.static
        return 3 * s.trainable_bytes / spec.memory_bandwidth + \
            s.num_param_tensors * spec.kernel_overhead_s

    def allreduce_seconds(self, num_csx: int, spec: SystemSpec) -> float:
        """A ring all-reduce of the gradients over ``num_csx`` systems, on the slowest link
        it crosses (``SystemSpec.ring_link``: the inter-node one once it spans nodes)."""
        if num_csx <= 1 or not self.static.training:
            return 0.0
        n = num_csx
        bandwidth, latency = spec.ring_link(n)
        return 2 * (n - 1) / n * self.static.trainable_bytes / bandwidth + 2 * (n - 1) * latency

    def hidden_seconds(self, reduce: float, last_backward: float) -> float:
        """How much of the gradient collective (``reduce`` seconds) runs while the step's
        last backward (``last_backward`` seconds) is still computing: all of it but the
        last bucket, which holds the first parameters and is final only when the backward
        ends (the runtime's ``OverlappedReduce``; FSDP2's reduce-scatters likewise)."""
        total = self.static.trainable_bytes
        if reduce <= 0 or total <= 0:
            return 0.0
        bucket = buckets.bucket_cap(total)  # the runtime's, read when the plan is made
        return min(reduce * max(0.0, 1 - bucket / total), last_backward)

    def optimizer_seconds(self, spec: SystemSpec) -> float:
        if spec.weight_streaming or not self.static.training:
            return 0.0  # streamed systems update off-chip, overlapped
        s = self.static
        state = spec.optimizer_bytes_per_param * s.num_trainable
        return (2 * s.trainable_bytes + s.trainable_bytes + 2 * state) / spec.memory_bandwidth


def _fresh_share(size: np.ndarray, threshold: float) -> np.ndarray:
    """The expected share of an allocation of ``size`` bytes that gets fresh pages: none
    below ``threshold`` (glibc's mmap threshold: reused from the heap), all from twice
    it on (glibc's trim threshold: the heap never keeps that much free, so it is mapped
    afresh every time), and in between in proportion (reused when the heap's free top
    happens to hold it: half of such allocations faulted on this host)."""
    if threshold <= 0:
        return np.ones_like(size, dtype=float)
    return np.clip((size - threshold) / threshold, 0.0, 1.0)
