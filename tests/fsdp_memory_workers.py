"""Worker functions for tests/test_fsdp_memory.py (spawned ranks import them by name): one
rank's live bytes in a training step of an FSDP2-sharded model, measured beside the cost
model's figures, and broken down by what allocated them.

The count is ``tests/models.py``'s ``allocator_peak``, per rank: the bytes live before the
step (this rank's parameter shards, its optimizer state, its share of the batch) plus the
allocator's peak above them during the step (``measure_peak_bytes``: the profiler's
memory events). The same events, read as a tree, say who allocated each block that is
live at the peak (FSDP's record_function scopes name the all-gathers, the gradient
accumulation and the reduce-scatters).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from fsdp_workers import Comms
from torch.profiler import ProfilerActivity, profile, record_function

import mbcompile
from mbcompile.execution import distributed as mbdist
from mbcompile.planning.systems import SystemSpec

#: Wide enough that parameters, optimizer state and activations are megabytes each, so
#: the allocator's small blocks (scalars, bookkeeping) are noise: one block is 2.1 MB of
#: float32 parameters; a microbatch of 64 tokens saves about 0.6 MB of activations per block.
FEATURES, WIDTH, HIDDEN, CLASSES, DEPTH, SEQ = 32, 256, 1024, 32, 4, 16


class FFBlock(nn.Module):
    """Pre-norm residual MLP block (one FSDP unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenMLP(nn.Module):
    """Per-token classifier: projection and head in the root unit, ``DEPTH`` blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(FFBlock() for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def make_net() -> TokenMLP:
    torch.manual_seed(0)
    return TokenMLP()


def make_batch(gbs: int, seed: int = 1, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(gbs, seq, FEATURES, generator=g),
            torch.randint(0, CLASSES, (gbs, seq), generator=g))


def shard(net: TokenMLP, reshard_after_forward: bool) -> TokenMLP:
    """FSDP2 the usual way: each block, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(net)
    return net


def unit_bytes(net: TokenMLP) -> tuple[float, list[float]]:
    """Full (unsharded) parameter bytes of the root's own parameters and of each block."""
    blocks = [float(sum(p.numel() * p.element_size() for p in b.parameters()))
              for b in net.blocks]
    total = float(sum(p.numel() * p.element_size() for p in net.parameters()))
    return total - sum(blocks), blocks


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


# --------------------------------------------------------------------------- #
# Who allocated what: the profiler's memory events as a tree
# --------------------------------------------------------------------------- #

#: (scope name prefix, label) for the scope an allocation was made in: the innermost
#: enclosing scope that matches names it. FSDP2's scopes are the ``record_function``s of
#: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py; gloo's own are "c10d::..."
#: (inside FSDP's) and "gloo:..." (on gloo's worker thread).
MADE_IN = (
    ("FSDP::all_gather_copy_out", "gathered params"),  # the unsharded parameters
    ("FSDP::all_gather", "all-gather buffers"),        # flat output, gloo's flat copy
    ("gloo:all_gather", "all-gather buffers"),         # gloo's worker thread
    ("FSDP::post_backward_reduce", "reduce-scatter buffers"),  # flat input, gloo's clone
    ("Optimizer.step", "optimizer"),
    ("step::loss.backward", "loss.backward"),          # the runtime hands .grad over
    ("autograd::engine::evaluate_function", "backward temporaries"),
    ("step::forward", "activations"),
)


def _scope(node: Any, table: tuple[tuple[str, str], ...] = MADE_IN) -> str:
    parent = node.parent
    while parent is not None:
        for prefix, label in table:
            if parent.name.startswith(prefix):
                return label
        parent = parent.parent
    return "other"


def _freed_by_fsdp(node: Any) -> bool:
    """Freed in FSDP's post-backward: an unsharded gradient handed to the reduce-scatter."""
    return _scope(node, (("FSDP::post_backward", "yes"),)) == "yes"


def profile_step(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` under the profiler: the allocator's peak above the start (as
    ``measure_peak_bytes`` counts it), what is live at that moment by who made it, the
    bytes still live at the end, and frees the profiler missed.

    Labels: where a block was allocated (``MADE_IN``), except that a block autograd made
    in backward and FSDP freed in its post-backward is an "unsharded grads" block (autograd
    accumulates the gathered parameters' .grad there until the reduce-scatter), and a
    reduce-scatter output still live at the end is "sharded grads".

    A block freed on one of gloo's worker threads outside a collective (gloo's work
    object held the last reference) has no free event; the allocator can then hand its
    address out again while the block still counts as live. ``missed`` counts those
    reuses: a step with any is not a clean measurement.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []  # (time, ptr, bytes, node)
    scopes = []  # FSDP's pre/post forward and backward, in time: where the peak falls
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.ptr,
                           node.extra_fields.alloc_size, node))
        elif node.name.startswith(("FSDP::pre_forward (", "FSDP::pre_backward (")):
            scopes.append((node.start_time_ns, node.name))
    events.sort(key=lambda e: e[0])
    scopes.sort()
    # pass 1: pair each allocation with its free, to label it by both
    label: dict[int, str] = {}
    open_: dict[int, int] = {}  # ptr -> index of its live allocation
    missed = 0
    for i, (_, ptr, size, node) in enumerate(events):
        if size > 0:
            if ptr in open_:
                missed += 1
            open_[ptr] = i
            label[i] = _scope(node)
        elif ptr in open_:
            j = open_.pop(ptr)
            if label[j] in ("backward temporaries", "other") and _freed_by_fsdp(node):
                label[j] = "unsharded grads"
    at_end: Counter[str] = Counter()  # clean: the sharded gradients (and scalars) only
    for j in open_.values():
        if label[j] == "reduce-scatter buffers":
            label[j] = "sharded grads"
        at_end[label[j]] += events[j][2]
    # pass 2: the running total (as measure_peak_bytes) and the live set at its peak
    live: dict[int, int] = {}
    total = peak = 0
    at_peak: dict[int, int] = {}
    peak_time = events[0][0] if events else 0
    for i, (t, ptr, size, _) in enumerate(events):
        if size > 0 and ptr in live:  # its free went unrecorded (a gloo thread): gone by now
            total -= events[live[ptr]][2]
        total += size
        if size > 0:
            live[ptr] = i
        else:
            live.pop(ptr, None)
        if total > peak:
            peak, peak_time, at_peak = total, t, dict(live)
    by_label: Counter[str] = Counter()
    for i in at_peak.values():
        by_label[label[i]] += events[i][2]
    before_peak = [name for t, name in scopes if t <= peak_time]
    return {"peak": float(peak), "by_label": dict(by_label), "end": float(total),
            "missed": missed, "at_end": dict(at_end),
            "where": before_peak[-1] if before_peak else "",
            "forwards_before_peak": sum(n.startswith("FSDP::pre_forward") for n in before_peak)}


# --------------------------------------------------------------------------- #
# The worker
# --------------------------------------------------------------------------- #


TRIES = 5  # profiled steps per configuration
SLACK = 512 * 1024  # bytes a clean step may leave besides its sharded gradients (a missed
#                     free leaves a whole unit's buffer: 2.1 MB here)


#: a memory budget that binds nothing here (``measure``'s ``length``: "auto" needs one to
#: model the sharded step over lengths)
AMPLE = SystemSpec("ample", memory_bytes=4e9, peak_flops=1e12, peak_flops_fp32=1e12,
                   memory_bandwidth=1e11, optimizer_bytes_per_param=8)


def measure(rank: int, world: int, gbs: int, mbs: int, reshard_after_forward: bool,
            sync: str = "step", length: int | None = None) -> dict[str, Any]:
    """This rank's measured and modelled peak of one Adam step (after a warm-up step).
    With ``length``: compiled at ``SEQ`` with the length symbolic and ``mbs="auto"``
    (``mbs`` unused), stepped at ``length`` tokens: the model's figure is then its length
    model's at the call's length."""
    net = shard(make_net(), reshard_after_forward)
    example = make_batch(gbs)
    varying = {} if length is None else {"dynamic": {"x": 1, "y": 1}, "system": AMPLE}
    cm = mbcompile.compile(net, gbs, world, mbs if length is None else "auto",
                           example_inputs=example, backend="torch.distributed",
                           reshard_after_forward=reshard_after_forward, gradient_sync=sync,
                           **varying)
    opt = torch.optim.Adam(net.parameters(), foreach=False)
    # this rank's share, as its own tensors (not views of the global batch)
    batch = tuple(t.clone() for t in mbdist.shard(
        make_batch(gbs, seed=2, seq=length or SEQ), cm.plan, rank))
    del example

    def step() -> None:
        with record_function("step::forward"):
            loss = cm(*batch)
        with record_function("step::loss.backward"):
            loss.backward()
        opt.step()

    with Comms() as comms:
        step()  # the optimizer state exists from now on, as in training
    opt.zero_grad(set_to_none=True)
    params = sum(_local(p).nbytes for p in net.parameters())
    state = sum(_local(v).nbytes for s in opt.state.values() for v in s.values()
                if torch.is_tensor(v))
    inputs = sum(t.nbytes for t in batch)
    # A few profiled steps on every rank (each issues collectives, so every rank runs the
    # same number); the lowest peak of the clean ones counts (no missed free: nothing but
    # the new sharded gradients left at the end), else the lowest of all (a missed free
    # only ever adds bytes).
    tries = []
    for _ in range(TRIES):
        tries.append(profile_step(step))
        opt.zero_grad(set_to_none=True)
    clean = [t for t in tries if t["missed"] == 0 and t["end"] - params < SLACK]
    measured = min(clean or tries, key=lambda t: t["peak"])
    m = cm.estimate.memory
    k = len(cm.plan.microbatch_sizes[rank])
    gathers = comms.counts["all_gather"] // k  # per microbatch: 1 + DEPTH, or 1 + 2 * DEPTH
    root, blocks = unit_bytes(net)
    return {
        "gbs": gbs, "mbs": cm.plan.mbs, "k": k, "world": world, "length": length,
        "reshard_after_forward": reshard_after_forward, "gradient_sync": sync,
        "ran_reshard_after_forward": gathers == 1 + 2 * DEPTH,
        "plan_reshard_after_forward": cm.plan.reshard_after_forward,
        "all_gathers": comms.counts["all_gather"],
        "reduce_scatters": comms.counts["reduce_scatter"],
        "root_bytes": root, "block_bytes": blocks,
        "before": {"params": float(params), "optimizer": float(state), "inputs": float(inputs)},
        "step": measured, "clean": bool(clean), "peaks": [t["peak"] for t in tries],
        "measured": float(params + state + inputs) + measured["peak"],
        "model": {f: float(getattr(m, f)) for f in (
            "params", "buffers", "grads", "optimizer", "gathered", "activations", "saved",
            "transient", "inputs", "outputs", "update", "peak")} | {"phase": m.phase},
    }


def live_bytes(rank: int, world: int, out_dir: str,
               configs: list[tuple[Any, ...]]) -> None:
    """``measure`` for each ``(gbs, mbs, reshard_after_forward, gradient_sync[, length])``;
    saves the list."""
    torch.set_num_threads(1)  # two ranks share the cores
    results = [measure(rank, world, *config) for config in configs]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
