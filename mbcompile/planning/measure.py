"""Measuring on the host: real forward+backward time per microbatch size, and peak bytes.

Reported beside the cost model's figures (``compile(measure=True)``, the benchmarks);
the plan itself never depends on timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from mbcompile.planning.probe import backward_root

__all__ = ["HostTimer", "measure_peak_bytes"]


def _tile(value: Any, dim: int | None, m: int) -> Any:
    """``value`` with ``m`` samples along ``dim``, repeating its samples as needed."""
    if dim is None:
        return value

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        index = torch.arange(m, device=t.device) % t.shape[dim]
        return t.index_select(dim, index)
    return pytree.tree_map(one, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostTimer:
    """Times real forward+backward of one microbatch of ``m`` samples, best of ``reps``.

    Runs ``module`` (the captured graph) on the example inputs tiled to ``m``
    samples and takes gradients with ``torch.autograd.grad``, so the user's
    ``.grad`` slots are never touched.  One warm-up run per size.
    """

    def __init__(self, module: torch.nn.Module, values: Sequence[Any],
                 in_dims: Sequence[int | None], reps: int = 3,
                 loss_leaves: tuple[int, ...] | None = None) -> None:
        self.module = module
        self.values = list(values)
        self.in_dims = list(in_dims)
        self.reps = max(1, int(reps))
        self.loss_leaves = loss_leaves  # the trained loss (the batch analysis's loss_outputs)
        self.params = [p for p in module.parameters() if p.requires_grad]
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._cache: dict[int, float] = {}

    def _once(self, args: Sequence[Any]) -> float:
        _sync(self.device)
        start = time.perf_counter()
        out = self.module(*args)
        loss = backward_root(pytree.tree_leaves(out), self.loss_leaves)
        if loss is not None and self.params:
            torch.autograd.grad(loss, self.params, allow_unused=True)
        _sync(self.device)
        return time.perf_counter() - start

    def __call__(self, m: int) -> float:
        if m not in self._cache:
            args = [_tile(v, d, m) for v, d in zip(self.values, self.in_dims)]
            self._once(args)
            self._cache[m] = min(self._once(args) for _ in range(self.reps))
        return self._cache[m]


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    """Peak bytes the allocator handed out while ``fn`` ran, above what was live before.

    CUDA: ``torch.cuda.max_memory_allocated``.  CPU: the allocator's events
    recorded by ``torch.profiler`` with ``profile_memory=True`` (every
    allocation and free, in order), so it is the allocator's own count, not an
    estimate.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        total += e.nbytes()
        peak = max(peak, total)
    return float(peak)
