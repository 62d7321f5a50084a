"""A two-phase step's frontier joined over ranks: the gather ``two_phase.py`` runs on ranks.

Rank ``r`` holds ``shares[r]`` samples. Each per-sample value of the frontier F, joined over
the rank's microbatches, is padded along its batch dim to the largest share, all-gathered,
trimmed and concatenated in batch order, so that the coupled part C reads the whole batch's
F on every rank (gbs 7 on 2 ranks: rows 0-3 from rank 0, 4-6 from rank 1).

Where lengths may vary (a symbolic dim, or ``dynamic="auto"``, where a rank at the
example's length runs the module compiled for it and another rank the one its length made
symbolic), each rank may be called at another length (each collator pads its own batch),
so a rank cannot size what it receives from its own shapes. Such a step first exchanges,
in one small all-gather (and one host read), whether each rank's phase 1 failed (or its
call was refused) and the shape of each value it holds. Every rank then takes the
same decision from the same numbers, before the first value is gathered:

1. a rank failed: every rank stops the step here (it would otherwise join the gather
   with zeros of a shape no one knows at this length);
2. every rank's values have one shape per sample (the ranks share a length, or F holds
   only length-free values such as a loss's partial sums): gathered as above, exactly;
3. otherwise the whole batch's F does not exist: rows of 8 tokens and rows of 40 make no
   tensor that eager computes (the short rows' values at the padding are unknown), so
   the step is refused on every rank, changing nothing, and the error names the fix.

>>> gather = RankGather(shares=(4, 3), rank=0, exchange=True)
>>> rows = gather.agree([(4, 8, 64)], [3], [0], ["logits"], None, read)  # or raises
>>> whole, offset = gather.gather(local, 0, rows[0])                  # (7, 8, 64), 0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from mbcompile.passes.errors import InputError, MicrobatchError

__all__ = ["RankGather", "mark_sent"]


def mark_sent(exc: BaseException) -> BaseException:
    """Mark ``exc`` as known to every rank: the step's status all-reduce is not run for it."""
    exc._mbcompile_status_sent = True  # type: ignore[attr-defined]
    return exc


class RankGather:
    """Joins one rank's frontier values with every other rank's, in batch order.

    ``exchange``: the ranks' shapes may differ (a symbolic dim): ``agree`` exchanges them
    once per step; otherwise each rank's rows are its share times this rank's rows per
    sample, and ``agree`` exchanges nothing.
    """

    def __init__(self, shares: Sequence[int], rank: int, exchange: bool = False) -> None:
        self.shares, self.rank, self.exchange = tuple(shares), rank, exchange

    def agree(self, shapes: Sequence[tuple[int, ...]] | None, ndims: Sequence[int],
              dims: Sequence[int | None], names: Sequence[str], failure: BaseException | None,
              read: Callable[[torch.Tensor], list[float]],
              device: torch.device | str = "cpu", returned: Sequence[bool] = ()
              ) -> list[list[int] | None]:
        """Each value's rows per rank along ``dims`` (None: nothing exchanged; a failed
        rank then joins the gather with zeros), or an error raised on every rank: this
        rank's ``failure``, another rank's, or the values' shapes differing per sample
        (``InputError``). ``shapes``: this rank's values' shapes (None when its phase 1
        failed); ``dims``: each one's batch dim (None: a partial sum, the same shape on
        every rank); ``ndims``: their numbers of dims, as compile time found them (the
        same on every rank, failed or not); ``returned``: per value, whether C only
        returns it (the fix then differs)."""
        if not self.exchange or not any(ndims):  # scalars: one shape at every length
            return [None] * len(dims)
        ok = failure is None and shapes is not None
        mine = [0 if ok else 1]
        for k, n in enumerate(ndims):
            mine.extend(shapes[k] if ok and shapes is not None else (0,) * n)
        width = len(mine)
        local = torch.tensor(mine, dtype=torch.int64, device=device)
        every = [torch.empty_like(local) for _ in self.shares]
        dist.all_gather(every, local)
        flat = [int(v) for v in read(torch.cat(every))]  # the one host read of the exchange
        table = [flat[r * width:(r + 1) * width] for r in range(len(self.shares))]
        failed = [r for r, row in enumerate(table) if row[0]]
        if failed:
            if failure is not None:
                raise mark_sent(failure)
            raise mark_sent(MicrobatchError(
                f"rank(s) {failed} failed in phase 1 of the two-phase step (a microbatch "
                f"raised, or that rank refused its call); this rank ({self.rank}) stops the "
                "step too, with parameters and gradients as they were"))
        rows: list[list[int] | None] = []
        for k, (dim, name) in enumerate(zip(dims, names)):
            start = 1 + sum(ndims[:k])
            per_rank = [tuple(row[start:start + ndims[k]]) for row in table]
            if not _same_per_sample(per_rank, dim, self.shares):
                raise mark_sent(_mismatch(name, per_rank, self.shares, dim is None,
                                          k < len(returned) and returned[k]))
            rows.append(None if dim is None else [s[dim] for s in per_rank])
        return rows

    def gather(self, local: torch.Tensor, dim: int, rows: Sequence[int] | None = None
               ) -> tuple[torch.Tensor, int]:
        """The whole batch's value along ``dim``, and where this rank's rows start.
        ``rows``: each rank's rows (``agree``); None: its share times this rank's rows
        per sample (tokens, views)."""
        if rows is None:
            per_sample = local.shape[dim] // self.shares[self.rank]
            rows = [s * per_sample for s in self.shares]
        padded = local
        if local.shape[dim] < max(rows):
            shape = list(local.shape)
            shape[dim] = max(rows) - local.shape[dim]
            padded = torch.cat([local, local.new_zeros(shape)], dim)
        padded = padded.contiguous()
        pieces = [torch.empty_like(padded) for _ in self.shares]
        dist.all_gather(pieces, padded)
        whole = torch.cat([p.narrow(dim, 0, r) for p, r in zip(pieces, rows)], dim)
        return whole, sum(rows[:self.rank])


def _same_per_sample(shapes: Sequence[tuple[int, ...]], dim: int | None,
                     shares: Sequence[int]) -> bool:
    """Whether every rank's value has one shape per sample: the same dims but ``dim``, and
    along ``dim`` its share times the same rows per sample (``dim`` None: the same shape)."""
    first = shapes[0]
    if dim is None:
        return all(s == first for s in shapes)
    per_sample = first[dim] // shares[0]
    return all(len(s) == len(first) and s[dim] == per_sample * n
               and s[:dim] + s[dim + 1:] == first[:dim] + first[dim + 1:]
               for s, n in zip(shapes, shares))


def _mismatch(name: str, shapes: Sequence[tuple[int, ...]], shares: Sequence[int],
              summed: bool, returned: bool) -> InputError:
    held = ", ".join(f"rank {r} {tuple(s)} ({n} samples)"
                     for r, (s, n) in enumerate(zip(shapes, shares)))
    fix = ("compile with outputs='loss' (or name the outputs to keep) so that it is not "
           "gathered, or pad every rank's batch to one length" if returned else
           "pad every rank's batch to one length")
    what = (f"adds the partial sum '{name}' over ranks" if summed else
            f"gathers the per-sample value '{name}' of the whole batch over ranks")
    return InputError(
        f"the ranks were called at different lengths, and this two-phase step {what} for "
        f"its coupled part: {held}. Rows of different lengths make no batch that eager "
        "computes (the short rows' values at the padding are not known), so the step is "
        f"refused on every rank, changing nothing. Fix: {fix} (a collator's "
        "padding='max_length' with max_length=)")
