"""Measuring on the host: real forward+backward time per microbatch size, and peak bytes.

``LiveBytes`` counts live tensor storages op by op (what the cost model's memory figure
predicts: ``benchmarks/bench_memory_accuracy.py``, ``tests/test_memory_accuracy.py``);
``measure_peak_bytes`` reads the allocator's own events.

Reported beside the cost model's figures (``compile(measure=True)``, the benchmarks);
the plan depends on timing only where ``measure=True`` asks ``"auto"`` to break a flat
modelled curve's tie (``tie_break.py``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from mbcompile.planning.probe import backward_root

__all__ = ["HostTimer", "LiveBytes", "measure_peak_bytes", "training_step_peak"]


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


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages; ``peak`` is the most alive at once.

    Every op's output storages are added the first time they are seen and
    subtracted when the storage is freed (a ``weakref.finalize`` on it), so
    views cost nothing and in-place ops add nothing. ``track(...)`` adds tensors
    that already exist (parameters, inputs) to the count. Kernel-internal
    scratch buffers are not op outputs and are not counted, nor are fake and meta
    tensors: a compile inside the measured code (a module compiled again for a new
    state) runs torch.export and the fake probe through this mode, and their
    tensors hold no memory.

    >>> with LiveBytes() as mem:
    ...     x = torch.ones(1000) + 1  # 4000 bytes, and 4000 more while the sum is made
    >>> mem.peak, mem.live
    (8000, 4000)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _forget(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or is_fake(t):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        weakref.finalize(storage, self._forget, key, nbytes)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def track(self, *values: Any) -> LiveBytes:
        for t in pytree.tree_leaves(values):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return self

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in what a model returns: itself, its ``loss`` entry or its first leaf."""
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else pytree.tree_leaves(out)[0]


def training_step_peak(model: torch.nn.Module, forward: Callable[[], Any],
                       inputs: Any = ()) -> float:
    """Peak live tensor bytes (``LiveBytes``) of one training step of ``model``:
    ``forward()`` (what returns the loss: ``lambda: cm(x, y)``), ``backward()`` and an
    Adam update (torch's one-tensor-at-a-time implementation, as the cost model assumes),
    after a warm-up step, so that Adam's state exists, with the gradients None before it
    as ``zero_grad()`` leaves them. Parameters, buffers, Adam's state and ``inputs``
    count from the start: the figure to set beside ``cm.estimate.memory.peak``.
    """
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)

    def step() -> None:
        _loss_of(forward()).backward()
        opt.step()

    step()
    opt.zero_grad(set_to_none=True)
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    try:
        with LiveBytes() as mem:
            mem.track(list(model.parameters()), list(model.buffers()), inputs, state)
            step()
    finally:
        opt.zero_grad(set_to_none=True)
    return float(mem.peak)
