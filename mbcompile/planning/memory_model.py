"""The memory half of the cost model: the peak of one system's step.

>>> cost.memory(pbs=8, mbs=3, num_microbatches=3, spec=get_system("host")).peak

**Memory** (per system; docs/mbs.md, "The cost model")::

    static      = parameters + buffers + gradients + optimizer state
                  (only buffers on device for weight-streaming systems)
    inputs      = the system's share of the batch
    activations = peak live bytes of one microbatch's forward+backward
                = saved for backward + the largest transient on top of them
                  (probed as a later microbatch: each new gradient a temporary until
                  it is added in; with one microbatch, the first's, whose gradients
                  are made while its activations are freed: Probe.first_live)
    outputs     = per-sample outputs (logits) kept for the caller
    peak        = static + inputs + the largest of
                    outputs of the earlier microbatches + activations  (the loop:
                      the last microbatch of each size, MemoryModel._loop_peak)
                    2 x outputs                  (joining the microbatches' pieces)
                    outputs + 2 x largest parameter   (an Adam-like update)

The outputs and update terms are in docs/mbs.md's formula because a model that
returns logits keeps ``pbs * seq * vocab`` floats alive whatever the MBS (on a
GPT-sized vocabulary as much as the activations), and for a small model the
optimizer's temporaries can set the peak.
"""

from __future__ import annotations

from typing import Any

from mbcompile.planning.estimates import MemoryEstimate, MicrobatchFigures, StaticFigures
from mbcompile.planning.probe import Probe
from mbcompile.planning.systems import SystemSpec

__all__ = ["MemoryModel", "split_counts"]


def split_counts(size: int, k: int) -> list[tuple[int, int]]:
    """``(microbatch size, how many)`` for ``size`` samples over ``k`` microbatches.

    >>> split_counts(5, 3)
    [(2, 2), (1, 1)]
    """
    q, r = divmod(size, k)
    return [(s, c) for s, c in ((q + 1, r), (q, k - r)) if s > 0 and c > 0]


class MemoryModel:
    """The memory formulas of ``CostModel`` (which supplies ``static``, ``shard``, the
    exact probes ``_exact`` and ``figures``, one microbatch size's figures)."""

    static: StaticFigures
    shard: Any
    _exact: dict[int, Probe]

    def figures(self, m: int) -> MicrobatchFigures:
        raise NotImplementedError

    def memory(self, pbs: int, mbs: int, num_microbatches: int, spec: SystemSpec
               ) -> MemoryEstimate:
        """Peak memory of a system running ``pbs`` samples in microbatches of ``mbs``."""
        s = self.static
        f = self.figures(mbs)
        on_device = not spec.weight_streaming
        trained = on_device and s.training
        params = s.param_bytes if on_device else 0.0
        grads = s.trainable_bytes if trained else 0.0
        optimizer = spec.optimizer_bytes_per_param * s.num_trainable if trained else 0.0
        gathered = 0.0
        if self.shard is not None and on_device:  # one rank's shards, units gathered
            w = self.shard.world
            params, optimizer = params / w, optimizer / w
            grads, gathered = self.shard.held(grads, num_microbatches)
        # autocast's copies of the weights: made in the first microbatch, cached to the end
        casts = max((p.casts for p in self._exact.values()), default=0.0) if on_device else 0.0
        static = params + s.buffer_bytes + grads + optimizer + casts
        inputs = s.input_bytes_fixed + s.input_bytes_per_sample * pbs
        saved, act = f.saved_bytes, f.activation_peak_bytes
        earlier, pending = s.output_bytes_per_sample * (pbs - mbs), 0.0
        if not s.fused and s.training and num_microbatches > 1:
            # no single loss: one backward makes the gradients (its peak the first
            # microbatch's, before some exist), and autograd keeps every microbatch's
            # saved activations until then
            kept = self.figures(pbs).saved_bytes - saved
            act, pending = f.first_peak_bytes + kept, f.first_grads_pending
            saved += kept
        elif self.shard is None:
            earlier, act, pending = self._loop_peak(pbs, num_microbatches)
        out_all = s.output_bytes_per_sample * pbs
        # (phase, outputs, activations, update temporaries, gradients not made yet) alive
        # at each candidate peak
        phases = [("microbatch loop", earlier, act, 0.0, pending)]
        if num_microbatches > 1:  # the pieces and their concatenation, briefly
            phases.append(("joining outputs", 2 * out_all, 0.0, 0.0, 0.0))
        if trained and spec.optimizer_bytes_per_param > 0:
            # An Adam-like update makes two temporaries the size of the parameter it
            # updates (sqrt of the second moment, then the step); torch's for-loop
            # implementation does it one tensor at a time.  (foreach implementations
            # batch all parameters and need up to twice the gradient bytes.)
            phases.append(("optimizer update", out_all, 0.0, 2 * s.largest_param_bytes, 0.0))
        phase, outputs, activations, update, pending = max(
            phases, key=lambda p: p[1] + p[2] + p[3] - p[4])
        grads -= pending
        static -= pending
        return MemoryEstimate(
            params=params, buffers=s.buffer_bytes, grads=grads, optimizer=optimizer,
            inputs=inputs, outputs=outputs, activations=activations, update=update,
            saved=saved, transient=max(0.0, act - saved),
            peak=static + inputs + outputs + activations + update + gathered,
            capacity=spec.usable_bytes, phase=phase, gathered=gathered, casts=casts)

    def _loop_peak(self, pbs: int, k: int) -> tuple[float, float, float]:
        """``(earlier microbatches' outputs, activations, gradients not made yet)`` at the
        loop's peak: the first microbatch (it makes the gradients as it goes:
        ``Probe.first_live``) or the last of each size after it (every gradient alive),
        larger ones first as the plan runs them. Without per-sample outputs a smaller
        microbatch cannot set the peak after a larger one, so no other size is probed."""
        per_sample = self.static.output_bytes_per_sample
        sizes = split_counts(pbs, k)
        first = self.figures(sizes[0][0])
        peaks = [(0.0, first.first_peak_bytes, first.first_grads_pending)]
        done = 0
        for i, (size, count) in enumerate(sizes):
            done += size * count
            if count - (i == 0) <= 0 or (per_sample == 0 and len(peaks) > 1):
                continue
            later = (per_sample * (done - size), self.figures(size).activation_peak_bytes, 0.0)
            peaks.append(later)
        return max(peaks, key=lambda p: p[0] + p[1] - p[2])
