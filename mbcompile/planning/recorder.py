"""The recorder a probe runs under: every ATen op's FLOPs, bytes and the storages it makes.

A ``TorchDispatchMode`` inside the probe's ``FakeTensorMode`` (``probe.py``): one row per
op (FLOPs by torch's formulas, activation and weight bytes read and written, whether it
runs at the fp32 rate, does work, runs in backward; transcendental values; the bytes of
its first new storage), the birth and death of each storage it sees made (the
``Timeline`` of the live bytes), and the gradients autograd adds into ``.grad``.

>>> recorder = Recorder(FlopCounterMode(display=False), param_storages, grad_storages)
>>> with fake_mode, recorder:
...     loss = graph(*fake_inputs); recorder.backward = True; loss.backward(); recorder.end()
>>> recorder.rows[0]          # (flops, act bytes, weight bytes, fp32, kernel, backward, ...)
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from mbcompile.planning import transcendentals
from mbcompile.planning.timeline import Timeline

__all__ = ["END", "TAG", "Recorder", "autograd_tag", "nbytes"]


def _autocasting() -> bool:
    """Autocast is on (a weight's cast is then its cached low-precision copy, not a cast the
    model makes itself, as an RMSNorm's ``.to(dtype)`` or FSDP's mixed precision are)."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()



@dataclass(frozen=True)
class _Op:
    """What the recorder reads off an ATen op, read once per op (not per call)."""

    name: str  # ``str(func)``: the probe's op name
    packet: Any  # ``func._overloadpacket``: the key of torch's FLOP formulas
    mutable: bool  # the schema writes an argument


@functools.cache
def _op(func: Any) -> _Op | None:
    """``func``'s ``_Op``; None for an op outside the aten namespace (prim's queries)."""
    if getattr(func, "namespace", "aten") != "aten":
        return None
    return _Op(str(func), func._overloadpacket, bool(func._schema.is_mutable))


def _tensors(value: Any, found: dict[int, torch.Tensor] | None = None
             ) -> dict[int, torch.Tensor]:
    """The tensors in an op's arguments or results by id, in pytree's order (an op's
    arguments nest only tuples, lists and dicts: ``pytree.tree_leaves``, faster). No
    closure: a cycle would keep the tensors, and the storages the timeline watches die,
    alive until the garbage collector runs."""
    found = {} if found is None else found
    if isinstance(value, torch.Tensor):
        found[id(value)] = value
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, found)
    return found


class Recorder(TorchDispatchMode):
    """Records every ATen op's FLOPs, bytes and the live-storage timeline."""

    def __init__(self, counter: FlopCounterMode, param_storages: set[int],
                 grad_storages: set[int] | None = None) -> None:
        super().__init__()
        self.counter = counter
        self.param_storages = param_storages
        self.grad_storages = grad_storages or set()  # the gradients a microbatch adds into
        self.accumulated: list[tuple[int, int, int]] = []  # (op index, bytes, block) each
        self.backward = False
        self.tag = -1  # the repeated block the forward is in (-1: none, or not tracked)
        self.tags: list[int] = []
        self.ops: list[str] = []
        # (flops, activation bytes, weight bytes, fp32, kernel, backward, transcendental
        # values, bytes of its first new storage) per op
        self.rows: list[tuple[float, float, float, bool, bool, bool, float, float]] = []
        self.sizes: list[int] = []  # per storage created here
        self.born: list[int] = []  # op index that created it
        self.died: list[int | None] = []  # ops recorded when it was freed
        self.by_id: dict[int, int] = {}  # id(storage) -> index, while alive
        self._refs: list[weakref.ref[Any]] = []
        self.casts = 0.0  # bytes of the parameters' casts (autocast's weight copies)
        self.block_casts: dict[int, float] = {}  # the same, by the block that made them
        self.autocast = _autocasting()  # read here: a dispatch mode runs with it switched off

    def _track(self, storage: Any) -> None:
        key = id(storage)
        if key in self.by_id or key in self.param_storages:
            return
        index = len(self.sizes)
        self.by_id[key] = index
        self.sizes.append(storage.nbytes())
        self.born.append(len(self.ops))
        self.died.append(None)

        def freed(_: Any, index: int = index, key: int = key) -> None:
            self.died[index] = len(self.ops)
            if self.by_id.get(key) == index:
                del self.by_id[key]

        self._refs.append(weakref.ref(storage, freed))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        op = _op(func)
        if op is None:  # not aten's (a device or layout query): no row
            return func(*args, **kwargs)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and op.mutable and \
                id(target.untyped_storage()) in self.grad_storages:
            # autograd adding a microbatch's gradient into ``.grad``: its time is the cost
            # model's accumulation term, so no row; from the next op on it is accumulated
            self.accumulated.append((len(self.ops), nbytes(target), autograd_tag()))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        # torch's FLOP formulas, called here rather than by entering FlopCounterMode: its
        # module tracker hooks every tensor for backward, which keeps activations that
        # activation checkpointing recomputes alive to the end of the step
        formula = self.counter.flop_registry.get(op.packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        ins = _tensors((args, kwargs))
        outs = _tensors(out)
        if func is torch.ops.aten._to_copy.default and len(ins) == 1 and self.autocast and \
                id(next(iter(ins.values())).untyped_storage()) in self.param_storages:
            for t in outs.values():  # a weight cast by autocast: a weight, not an activation
                if id(t.untyped_storage()) not in self.param_storages:
                    self.param_storages.add(id(t.untyped_storage()))
                    self.casts += nbytes(t)
                    self.block_casts[self.tag] = self.block_casts.get(self.tag, 0) + nbytes(t)
        known = len(self.sizes)
        read = [(t, id(t.untyped_storage())) for t in ins.values()]  # each storage asked once
        seen_before = {key for _, key in read}
        for t in outs.values():
            st = t.untyped_storage()
            if id(st) not in seen_before:
                self._track(st)
        allocates = len(self.sizes) > known
        # the first new storage (the op's main output: a grad_input beside its
        # grad_weight), not the largest, which may change with m and break the fit
        main = float(self.sizes[known]) if allocates else 0.0
        kernel = allocates or op.mutable
        weight = act = 0.0
        if kernel:
            for t, key in read:
                if key in self.param_storages:
                    weight += nbytes(t)
                else:
                    act += nbytes(t)
            act += sum(nbytes(t) for t in outs.values())
        # the first floating tensor's dtype, outputs first
        first = next((t.dtype for t in (*outs.values(), *ins.values()) if t.is_floating_point()),
                     None)
        fp32 = first is None or first in (torch.float32, torch.float64)
        self.ops.append(op.name)
        self.tags.append(autograd_tag() if self.backward else self.tag)
        values = transcendentals.count(func, args, kwargs, out) if kernel else 0
        self.rows.append((float(flops), act, weight, fp32, kernel, self.backward,
                          float(values), main))
        return out

    def end(self) -> None:
        """A row for the end of backward, no work: the gradients autograd adds after the
        last op land on it."""
        self.ops.append(END)
        self.tags.append(-1)
        self.rows.append((0.0, 0.0, 0.0, True, False, True, 0.0, 0.0))

    def timeline(self, saved: set[int], gradients: set[int]) -> Timeline:
        """The storages made, by index (``saved`` and ``gradients`` name some of them), and
        the gradients added, as arrays."""
        n, count = len(self.ops), len(self.sizes)
        index = np.arange(count)
        added = np.array(self.accumulated, dtype=float).reshape(-1, 3)
        return Timeline(
            n=n, sizes=np.array(self.sizes, dtype=float), born=np.array(self.born, dtype=int),
            died=np.array([n if d is None else d for d in self.died], dtype=int),
            saved=np.isin(index, list(saved)), gradient=np.isin(index, list(gradients)),
            added=added[:, 0].astype(int), added_bytes=added[:, 1],
            added_tags=added[:, 2].astype(int), casts=dict(self.block_casts))


#: The probe's last row: the end of backward (``Recorder.end``).
END = "end of backward"

#: The key a probe's autograd nodes carry their repeated block under (``Node.metadata``).
TAG = "mbcompile.block"


def autograd_tag() -> int:
    """The repeated block the backward op now running belongs to: its autograd node's."""
    node = torch._C._current_autograd_node()
    return node.metadata.get(TAG, -1) if node is not None else -1
