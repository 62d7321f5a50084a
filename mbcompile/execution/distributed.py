"""The collectives of a step on ``torch.distributed`` ranks (``mbcompile.distributed``).

With ``compile(..., backend="torch.distributed")`` inside a process group of
``num_csx`` ranks, rank ``r`` is system ``r`` and is called with its own share of
the global batch (``plan.per_system_batch_sizes[r]`` samples; ``shard`` cuts it).
Per step there are four kinds of collective, never one per microbatch, issued
by every rank in this order:

0. before the first forward, one all-reduce of the trained loss's count (the tokens
   that are not ``ignore_index``), when the inputs give it: every microbatch's
   backward is seeded with eager's ``g / N`` (``seeding.py``);
1. the gradient all-reduce, bucketed like DDP's: each bucket is launched
   asynchronously as the last microbatch's backward makes its gradients final
   (``OverlappedReduce``), and ``loss.backward()`` waits for all of them once;
2. a status all-reduce after the local loop, so that a rank whose microbatch
   raised ends the step with an error on *every* rank instead of a hang;
3. one all-reduce of the packed partial sums (loss sums, token counts, ...) per
   dtype, so denominators and the loss are global on every rank.

Everything here is a no-op for the simulated backend, which sums systems in
process (``passes.ops.accumulate_sum``). The loop that issues them is ``runtime.py``,
which imports this module (never the other way round); the backend's bindings are
``ranks.py``.
``OVERLAP`` lives here, where it is read, so setting ``mbcompile.distributed.OVERLAP``
takes effect; the bucket sizes are ``mbcompile.buckets``' (``planning/buckets.py``),
which the cost model reads too. Users reach the rank
helpers they call with the collectives from here too: ``shard``, ``PlanSampler``,
``check_world`` and ``rank_slice`` (``rank_shares.py``) and ``launch``
(``launcher.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from mbcompile.execution.launcher import free_port, launch
from mbcompile.execution.rank_shares import PlanSampler, check_world, rank_slice, shard
from mbcompile.passes.errors import InputError, MicrobatchError
from mbcompile.planning import buckets

__all__ = [
    "OVERLAP",
    "OverlappedReduce",
    "PlanSampler",
    "all_reduce_gradients",
    "all_reduce_sparse",
    "all_reduce_sums",
    "bucket_indices",
    "check_world",
    "free_port",
    "gradient_buckets",
    "launch",
    "rank_slice",
    "shard",
    "step_status",
]

#: False: all-reduce the step's gradient in ``loss.backward()``, after every microbatch's
#: backward, bucket by bucket (``all_reduce_gradients``; the path before the overlap,
#: kept as the reference the tests compare the overlapped gradients with bit for bit).
OVERLAP = True


def step_status(error: BaseException | None, checks: torch.Tensor | None = None,
                failed_locally: torch.Tensor | None = None, *,
                read: Callable[[torch.Tensor], list[float]]) -> list[float] | None:
    """All ranks learn whether any rank's microbatches failed; all raise if one did.

    ``checks`` is the rank's packed step checks (``runtime._StepChecks``) and
    ``failed_locally`` a device bool saying they already show a failure (a
    non-finite loss): the status is all-reduced on the device and read together
    with the checks, so the step costs one device-to-host read: ``read``, the loop's
    (``runtime.read_host``, which the tests count). Returns the checks as floats when
    no other rank failed (the caller raises for its own).
    """
    device = checks.device if checks is not None else torch.device("cpu")
    world = dist.get_world_size()
    bit = 1 << dist.get_rank()
    # a call a rank refused (its share, its length: ``StepChannels.refused``) in a plane of
    # its own, so the other ranks name it as that (int64: up to 31 ranks; beyond, a failure)
    planes = world <= 31
    plane = world if planes and getattr(error, "call_refused", False) else 0
    flag = torch.full((1,), bit << plane if error is not None else 0, dtype=torch.int64,
                      device=device)
    if failed_locally is not None:
        flag.add_(failed_locally.to(torch.int64) * bit)
    dist.all_reduce(flag)
    packed = flag if checks is None else torch.cat([flag.double(), checks.double()])
    values = read(packed)
    status = int(values[0])
    failed = [r for r in range(world) if status >> r & 1]
    refused = [r for r in range(world) if planes and status >> (world + r) & 1]
    if error is not None:
        raise error
    if refused:
        raise InputError(
            f"rank(s) {refused} refused their call (their error says why: a batch that is "
            f"not the rank's share of the plan, a length no split fits); this rank "
            f"({dist.get_rank()}) stops the step too, with parameters and gradients as they were")
    if failed and not status & bit:
        raise MicrobatchError(
            f"rank(s) {failed} failed in their microbatches; this rank ({dist.get_rank()}) "
            "stops the step too, with parameters and gradients as they were")
    return values[1:] if checks is not None else None


class _AllReduceSums(torch.autograd.Function):
    """Sum each tensor over ranks; the gradient of the total passes to the local part."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor | None] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idx in by_dtype.values():  # one call per dtype: loss sums and counts together
            flat = _flatten_dense_tensors([tensors[i].detach() for i in idx]).clone()
            dist.all_reduce(flat)
            for i, t in zip(idx, _unflatten_dense_tensors(flat, [tensors[i] for i in idx])):
                out[i] = t
        return tuple(out)  # type: ignore[arg-type]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


def all_reduce_sums(*values: Any) -> tuple[Any, ...]:
    """Global totals of per-rank partial sums (Python ints become tensors)."""
    tensors = [v if isinstance(v, torch.Tensor) else torch.tensor(v) for v in values]
    return _AllReduceSums.apply(*tensors)


def all_reduce_gradients(grads: Sequence[torch.Tensor | None],
                         bucket_bytes: int | None = None) -> int:
    """Sum gradients over ranks in place, in buckets (sparse ones after them, on their own:
    ``all_reduce_sparse``); returns the number of bucket calls made."""
    present = [g for g in grads if g is not None and not g.is_sparse]
    calls = 0
    for bucket in gradient_buckets(present, bucket_bytes or buckets.BUCKET_BYTES):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)
        calls += 1
    sparse = [g for g in grads if g is not None and g.is_sparse]
    if sparse:
        all_reduce_sparse(sparse, sparse)
    return calls


def all_reduce_sparse(grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> None:
    """Sum gradients that may be sparse (``nn.Embedding(sparse=True)``'s) over ranks, each
    on its own and in place, as DistributedDataParallel keeps them out of its buckets.

    A sparse gradient's sum is the ranks' entries side by side: the indices and values
    of every rank, gathered in rank order (one gather of the counts for all of them, then
    two per gradient, padded to the longest), left uncoalesced as eager's embedding
    backward leaves them; the optimizer (``SparseAdam``, SGD) sums repeated rows. So
    only dense collectives run, on gloo and NCCL alike (NCCL has no sparse all-reduce).
    A dense one (a weight tied to a dense head) is all-reduced alone; one that never
    arrived (None, ``like`` gives its parameter) joins with no entries and stays None.
    """
    device = like[0].device if like else torch.device("cpu")
    mine = [g for g in grads if g is None or g.is_sparse]
    counts = torch.tensor([0 if g is None else g._nnz() for g in mine], dtype=torch.int64,
                          device=device)
    everyone = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    if mine:
        dist.all_gather(everyone, counts)
    k = 0
    for g, p in zip(grads, like):
        if g is not None and not g.is_sparse:
            dist.all_reduce(g)
            continue
        nnz = [int(c[k]) for c in everyone]
        k += 1
        sparse_dim = 1 if g is None else g.sparse_dim()
        indices = p.new_zeros((sparse_dim, 0), dtype=torch.int64) if g is None else g._indices()
        values = p.new_zeros((0, *p.shape[sparse_dim:])) if g is None else g._values()
        parts = [_gather_padded(indices, max(nnz), 1), _gather_padded(values, max(nnz), 0)]
        if g is not None:
            g.copy_(torch.sparse_coo_tensor(
                torch.cat([t[:, :n] for t, n in zip(parts[0], nnz)], 1),
                torch.cat([t[:n] for t, n in zip(parts[1], nnz)]), g.shape))


def _gather_padded(t: torch.Tensor, length: int, dim: int) -> list[torch.Tensor]:
    """Every rank's ``t``, padded with zeros along ``dim`` to ``length`` for the gather."""
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    padded = torch.cat([t, t.new_zeros(shape)], dim).contiguous()
    out = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(out, padded)
    return out


def gradient_buckets(tensors: Sequence[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive tensors of one dtype grouped up to ``cap`` bytes (one all-reduce each)."""
    for bucket in bucket_indices(tensors, cap):
        yield [tensors[i] for i in bucket]


def bucket_indices(tensors: Sequence[torch.Tensor], cap: int, first_cap: int | None = None
                   ) -> list[list[int]]:
    """Positions of consecutive tensors of one dtype, grouped up to ``cap`` bytes
    (``first_cap`` for the first group)."""
    buckets: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        limit = first_cap if first_cap is not None and len(buckets) == 1 else cap
        if not buckets or size + nbytes > limit or t.dtype != tensors[buckets[-1][0]].dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


class OverlappedReduce:
    """One step's gradient all-reduce, started while the last microbatch's backward runs.

    The layout is DDP's Reducer's at its first iteration: parameters in reverse
    order (roughly the order backward makes their gradients final), cut into
    buckets, the first one small; unlike DDP's, a small model's gradient is cut into
    ``buckets.MIN_BUCKETS`` (a 14 MiB one into 8, not one of 1 MiB and one of 13). ``arm()``
    before the last microbatch's backward puts a post-accumulate-grad hook on every
    parameter; when the last gradient of bucket k is final and buckets 0..k-1 are
    launched, bucket k is flattened and ``all_reduce(async_op=True)`` starts on it. ``wait()`` (in
    ``loss.backward()``) waits once for all of them and writes the sums back.

    Every rank issues the same collectives in the same order, whatever happens:
    launches follow the bucket index, never the order hooks fire, and a rank
    whose step failed before its buckets were all launched calls ``flush(failed=True)``
    before the status all-reduce, joining the remaining all-reduces with zeros.
    So the status all-reduce always comes after the K bucket all-reduces on every
    rank; it tells everyone the step failed, and every rank drops the sums
    (``discard()``): the user's ``.grad`` was set aside and is never touched.
    Starting the buckets only once every rank is known good would need a second
    status round (and a second host read) after the last forward, and would still
    have to cover a failure inside the last backward in this same way.

    The sums are exactly those of ``all_reduce_gradients``: each element is the sum
    of the ranks' same element. Gloo's ring sums three or more ranks in an order that
    depends on the element's place in its bucket, so beyond two ranks the layout
    (not the overlap) can change the last bit; ``OVERLAP = False`` reduces this
    step's gradients the old way for comparison.

    Parameters in ``sparse`` (``sparse_grads.sparse_gradient_params``: their gradient may be
    sparse) stay out of the buckets, as DistributedDataParallel keeps them: ``wait(step)``
    reduces them after the buckets (``all_reduce_sparse``), once every rank is known good.
    """

    def __init__(self, params: Sequence[torch.Tensor], cap: int | None = None,
                 first_cap: int | None = None, *, sparse: Sequence[torch.Tensor] = ()) -> None:
        alone = {id(p) for p in sparse}
        self.alone = [i for i, p in enumerate(params) if id(p) in alone]  # of ``params``
        self.sparse = [params[i] for i in self.alone]
        params = [p for p in params if id(p) not in alone]
        total = sum(p.numel() * p.element_size() for p in params)
        cap = cap or buckets.bucket_cap(total)
        order = list(reversed(range(len(params))))
        self.params = params
        self.buckets = [[order[i] for i in b] for b in bucket_indices(
            [params[i] for i in order], cap, min(cap, first_cap or buckets.FIRST_BUCKET_BYTES))]
        self.bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self.pending = [len(b) for b in self.buckets]
        self.launched: list[tuple[Any, torch.Tensor, list[torch.Tensor | None]]] = []
        self.hooks: list[Any] = []

    def arm(self) -> None:
        """Launch buckets as the coming backward (the step's last) makes gradients final."""
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self._ready(i))
                      for i, p in enumerate(self.params)]

    def _ready(self, index: int) -> None:
        self.pending[self.bucket_of[index]] -= 1
        while len(self.launched) < len(self.buckets) and not self.pending[len(self.launched)]:
            self._launch(len(self.launched))

    def _launch(self, k: int, zeros: bool = False) -> None:
        grads = [None if zeros else self.params[i].grad for i in self.buckets[k]]
        flat = _flatten_dense_tensors([
            g if g is not None else p.new_zeros(p.shape)
            for g, p in zip(grads, (self.params[i] for i in self.buckets[k]))])
        self.launched.append((dist.all_reduce(flat, async_op=True), flat, grads))

    def flush(self, failed: bool = False) -> None:
        """Launch what the backward left (gradients that never arrived: zeros), in order;
        ``failed``: this rank's step failed, it only joins the other ranks' all-reduces."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        while len(self.launched) < len(self.buckets):
            self._launch(len(self.launched), zeros=failed)

    def wait(self, step: Sequence[torch.Tensor | None] = ()) -> None:
        """Wait for every bucket once; the step's gradients become the sums over ranks.
        ``step``: the step's gradients of the parameters given (those left out of the
        buckets are reduced from there)."""
        for k, (work, flat, grads) in enumerate(self.launched):  # launched in bucket order
            work.wait()
            members = [self.params[i] for i in self.buckets[k]]
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, members)):
                if g is not None:  # a gradient that never arrived stays None, as before
                    g.copy_(reduced)
        self.launched = []
        if self.alone:
            all_reduce_sparse([step[i] for i in self.alone], self.sparse)

    def discard(self) -> None:
        """The step failed on some rank: let the all-reduces finish and drop their sums."""
        for work, _, _ in self.launched:
            work.wait()
        self.launched = []
