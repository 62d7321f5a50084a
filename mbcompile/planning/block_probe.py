"""Probing a repeated block once: a deep model's probe from the graph cut to one and two blocks.

A transformer's N layers are one block repeated (``passes/repeated_blocks.py`` finds them
and cuts the graph to fewer). Every per-op figure of a probe (FLOPs, bytes, the live bytes
after the op) is then affine in the number of blocks:

1. probe the graph cut to one block (P1) and to two (P2), each op tagged with the block
   it ran for (its autograd node's, in backward);
2. P2's ops are P1's plus the second block's (tag 1). P1's ops grow by what the second
   block added to them (the head's live bytes hold one more block's saved activations):
   ``v1 + (N-1) * (v2 - v1)``; the second block's ops are copied N-1 times, copy j
   ``v + j * (v - v0)``, where ``v0`` is the same op of the first block (block j+2 runs
   with j more blocks' activations alive than block 2 does);
3. the result is checked once against an exact probe of the graph cut to three blocks,
   where a fit is built (``check=True``): the search then compares many sizes on it.
   A pinned MBS (``CostModel.pin``) probes one size and chooses nothing, so it trusts the
   structure ``find_blocks`` proved (the blocks run the same ops on the same shapes, each
   reading the one before) as it trusts its smaller microbatch's time scaled from the
   probe, and it runs one probe, P2: P1 is P2 without the second block's ops and what
   its forward made (``first_block``; ``tests/test_block_probe.py`` compares it with a
   probed P1, and both paths with the whole graph's).

The stacked probe lists its ops in another order than a real one (the copies come last),
which no figure depends on: times are sums over ops, memory the largest live value.

For the 80-layer 70B shape, each microbatch size costs three blocks' probing instead of
eighty (the check six, once); the figures equal the whole graph's (``tests/test_block_probe.py``).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch.fx as fx

from mbcompile.passes.repeated_blocks import Blocks, find_blocks, truncate
from mbcompile.passes.shape_prop import BlockRun
from mbcompile.planning.tolerance import close

__all__ = ["MIN_BLOCKS", "BlockProber", "stack"]

#: Fewer blocks than this are probed whole: the cut graphs would cost about as much.
MIN_BLOCKS = 4

#: per-op figures; live and grads last: compared by the peaks they give
_ARRAYS = ("flops", "act_bytes", "weight_bytes", "transcendental", "allocated", "grads",
           "live")
_FLAGS = ("fp32", "kernel", "backward")


class BlockProber:
    """Probes of a graph with repeated blocks, made from its cuts to one and two blocks.

    ``make(part, tags[, shares])`` builds the prober of a cut graph whose ops are tagged
    with ``tags`` (node name -> block index), in the fake mode of the fake probe
    ``shares`` when given. Calling it returns the whole graph's probe at
    ``m``, or None when the blocks do not stack (then probe the graph whole). ``check``:
    check the first stacked probe against three blocks probed exactly (step 3).
    """

    def __init__(self, gm: fx.GraphModule, blocks: Blocks, make: Callable[..., Any],
                 check: bool = True, run: BlockRun | None = None) -> None:
        self.gm, self.blocks, self.make = gm, blocks, make
        if run is not None:  # the shape pass's cut, in its fake mode (``BlockRun``)
            self.two = make(run.cut, blocks.tags(2), run.probe)
        else:
            self.two = make(truncate(gm, blocks, 2), blocks.tags(2))
        self.checked = self.derive = not check

    # Made on first use: a pinned MBS derives P1 from P2 and never probes one block alone.
    @functools.cached_property
    def one(self) -> Any:
        """The prober of the graph cut to one block."""
        return self.make(truncate(self.gm, self.blocks, 1), self.blocks.tags(1))

    @classmethod
    def of(cls, gm: Any, make: Callable[..., Any], check: bool = True,
           run: BlockRun | None = None) -> BlockProber | None:
        """The block prober of ``gm``, or None when it has fewer than ``MIN_BLOCKS``.
        ``run``: the shape pass's cut of ``gm`` (its blocks, cut and fake mode), taken
        while it holds."""
        if not isinstance(gm, fx.GraphModule):
            return None
        if run is not None and run.holds(gm) and run.blocks.count >= MIN_BLOCKS:
            return cls(gm, run.blocks, make, check, run)
        blocks = find_blocks(gm, MIN_BLOCKS)
        return cls(gm, blocks, make, check) if blocks is not None else None

    def __call__(self, m: int) -> Any:
        p2 = self.two.probe(m)
        p1 = first_block(p2) if self.derive else None
        if p1 is None:
            p1 = self.one.probe(m)
        stacked = stack(p1, p2, self.blocks.count)
        if stacked is None:
            return None
        if not self.checked:  # once: three blocks, probed, against three stacked
            three = self.make(truncate(self.gm, self.blocks, 3), {}).probe(m)
            want = stack(p1, p2, 3)
            if want is None or not same_figures(want, three):
                return None
            self.checked = True
        return stacked


def stack(p1: Any, p2: Any, n: int) -> Any:
    """The probe of ``n`` blocks from P1 (one block) and P2 (two), or None when P2 is not
    P1 with a second block like the first."""
    if p1.tags is None or p2.tags is None:
        return None
    second = p2.tags == 1
    base = np.flatnonzero(~second)
    if p1.ops != tuple(p2.ops[i] for i in base):
        return None
    pairs = []  # (an op of the second block, the same op of the first), forward then backward
    for phase in (False, True):
        copy = np.flatnonzero(second & (p2.backward == phase))
        first = np.flatnonzero((p2.tags == 0) & (p2.backward == phase))
        if len(copy) != len(first) or any(p2.ops[i] != p2.ops[j] for i, j in zip(copy, first)):
            return None
        pairs.append((copy, first))
    copy = np.concatenate([c for c, _ in pairs])
    first = np.concatenate([f for _, f in pairs])
    arrays: dict[str, np.ndarray] = {}
    for key in _ARRAYS:
        one, two = p1.arrays()[key], p2.arrays()[key]
        grown = one + (n - 1) * (two[base] - one)
        v, step = two[copy], two[copy] - two[first]
        if key == "grads":
            # gradients accumulate in backward order: block 2+j's backward runs after
            # the n-2-j blocks above it have added theirs (the second block's, none)
            step = -step
            arrays[key] = np.concatenate([grown, *(v + (n - 2 - j) * step
                                                   for j in range(n - 1))])
            continue
        arrays[key] = np.concatenate([grown, *(v + j * step for j in range(n - 1))])
    flags = {key: np.concatenate([getattr(p2, key)[base], *[getattr(p2, key)[copy]] * (n - 1)])
             for key in _FLAGS}
    ops = tuple(p2.ops[i] for i in base) + tuple(p2.ops[i] for i in copy) * (n - 1)
    return replace(p2, ops=ops, tags=None, **arrays, **flags,
                   saved=p1.saved + (n - 1) * (p2.saved - p1.saved),
                   outputs=p1.outputs + (n - 1) * (p2.outputs - p1.outputs),
                   casts=p1.casts + (n - 1) * (p2.casts - p1.casts), timeline=None)


def first_block(p2: Any) -> Any:
    """The probe of the graph cut to one block, from P2, its cut to two (step 1 without
    its first probe): P2's ops without the second block's, and its storages without those
    the second block's forward made. The head reads the last block kept, so it runs on
    the same shapes in both; what the second block keeps alive (its saved activations,
    its output) and the gradients of its parameters are what P1 lacks. In backward the
    gradient flowing into the first block is made by the second block's ops in P2 and by
    the head's in P1: the same bytes, alive over the same ops of P1. Returns None when P2
    has no timeline or no second block."""
    t = p2.timeline
    if t is None or p2.tags is None or not (p2.tags == 1).any():
        return None
    base = np.flatnonzero(p2.tags != 1)
    second = (p2.tags == 1) & ~p2.backward  # the second block's forward ops
    arrays = {key: value[base] for key, value in p2.arrays().items()}
    arrays["live"] = t.live(~t.gradient & ~second[t.born])[base]
    arrays["grads"] = t.grads(t.added_tags != 1)[base]
    flags = {key: getattr(p2, key)[base] for key in _FLAGS}
    return replace(p2, ops=tuple(p2.ops[i] for i in base), tags=p2.tags[base], **arrays,
                   **flags, saved=t.saved_bytes(~second[t.born]),
                   casts=p2.casts - t.casts.get(1, 0.0), timeline=None)


def same_figures(a: Any, b: Any) -> bool:
    """Whether two probes agree on every figure the cost model reads, in any op order:
    the ops, each op's FLOPs and bytes (sorted), the peak, saved and output bytes. Live
    bytes count by their peak only (that is all the cost model reads of them): an op
    between two blocks' backward, such as a residual gradient's add, is told to one or
    the other, which moves its live value but not the peak."""
    if Counter(a.ops) != Counter(b.ops):
        return False
    if not all(close(np.sort(a.arrays()[k]), np.sort(b.arrays()[k])) for k in _ARRAYS[:-2]):
        return False
    return (close(a.live.max(initial=0.0), b.live.max(initial=0.0))
            and close(a.first_live()[0], b.first_live()[0])
            and close(a.saved, b.saved) and close(a.outputs, b.outputs)
            and all(int(getattr(a, k).sum()) == int(getattr(b, k).sum()) for k in _FLAGS))
