"""Each microbatch's backward seeded as eager's full-batch backward seeds it.

Eager backpropagates the normalised loss: ``L = w * Σ_i l_i / N`` hands every
sample's loss the gradient ``g * w / N`` (``g``: the gradient the caller sends into
``L``, 1 for ``loss.backward()``, a GradScaler's scale, a weight). The training step
runs each microbatch's backward inside the call, before the caller's backward, so it
seeds them with the same value from two things it knows in time:

1. ``N``, the global count, from a count pre-pass over every microbatch before the
   first backward (``passes/loss_counts.py``; a count the shapes fix is read off the
   first microbatch), summed over systems (and ranks) in the tail's own order;
2. ``g``, speculated to be the gradient the caller sent into ``L`` at the previous step
   (1 at the first, where a float16 step waits for ``g`` instead: ``deferred.py``): a
   GradScaler's scale changes rarely, ``loss * w`` not at all. The
   previous step of any graph of the module (``Guesses``): a graph compiled mid-run (a
   new length, batch size, mode) guesses the scale, not 1, at its first step, where an
   fp16 backward seeded with 1 underflows.

``tail`` is the graph from the loss's global partial sum to ``L`` (the division by
``N``, any scaling), so the seed is autograd's own ``dL/dS`` for ``g``, bit for bit::

    seed = grad(tail(S, N, *inputs), S, g_guess)     # g_guess / N for a plain mean
    for mb in microbatches: partial(mb).backward(seed)
    # in loss.backward(): the real dL/dS arrives; the gradients are multiplied by
    factor = dL/dS / seed          # a device op, no read; exactly 1.0 when they are equal

A right guess makes the factor exactly 1.0, and the gradients are eager's rounding; a
wrong one (the scale just changed, a loss whose tail cannot be replayed) gives the
same gradient rounded as a backward of the raw sums scaled once, never another value.
Where nothing can be replayed the guess is the previous step's ``dL/dS`` itself
(right whenever ``N`` does not change between steps). After a step whose gradients
were not finite the guess is halved, as a GradScaler halves its scale; a scale that
grows (every 2000 finite steps by default) is guessed one step late.

On ranks (``Seed.ranks``) the seed must be one number on every rank: each rank's backwards
are seeded before the gradients are summed over ranks, and the factor is applied to the
sum. So every guess there is the module's (the last gradient of any of its graphs: every
rank saw the same steps, whichever graph each ran), never a graph's own, and a count
the shapes fix (known to each rank for its share only) is not replayed: its seed is the
module's last ``dL/dS``, rescaled exactly by the factor where ``N`` changed.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from mbcompile.execution.deferred import body_in_float16
from mbcompile.execution.seed_trace import TRACE_AFTER, TRACED, kind_of, trace
from mbcompile.passes import ops
from mbcompile.passes.draws import is_draw
from mbcompile.passes.graph_walks import ancestors
from mbcompile.passes.loss_counts import count_graph, data_count_graph

__all__ = ["Guesses", "Seed", "step_seed"]


class Guesses:
    """What the graphs of a compiled module and its variants (each with its own ``Seed``)
    share of the training loop: the gradient the caller sends into the loss belongs to
    the loop, not to a graph. A graph guesses from its own last step, and at its first
    (on ranks at every step) from the last step of any (``last``, ``bare``); a GradScaler
    halves its scale after any graph's overflow, so every graph's guess is halved once
    per overflow since it last saw its gradient (``overflows``)."""

    def __init__(self) -> None:
        self.last: Seed | None = None  # the last to record the gradient its loss got
        self.bare: Seed | None = None  # the last without a tail (ranks: any) to see dL/dS
        self.overflows: torch.Tensor | None = None  # every graph's overflow flags, summed

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, deepcopy) drops its graphs and their seeds: it guesses afresh
        return {"last": None, "bare": None, "overflows": None}

    def overflowed(self, found: torch.Tensor) -> None:
        self.overflows = found if self.overflows is None else self.overflows + found


class Seed:
    """One compiled graph's seeding: the tail to replay, the count pre-pass, and the
    gradients seen at the last step (the guesses for the next)."""

    #: the body computes in float16 whatever the call (``deferred.body_in_float16``): a
    #: wrong seed is not rescaled exactly, so its first step waits for the real one
    float16 = False
    #: the step runs on ranks (set by their backend, ``ranks.bindings``): guesses only from
    #: what every rank saw alike, the module's steps, so that every rank seeds alike
    ranks = False

    def __init__(self, tail: fx.GraphModule | None = None, loss_pos: int | None = None,
                 free: Sequence[int] = (), counted: bool = False,
                 counts: fx.GraphModule | None = None, float16: bool = False) -> None:
        self.float16 = float16
        self.tail = tail  # (S, [N], *draws, *free inputs) -> L; None: not replayable
        self.loss_pos = loss_pos  # L among the graph's outputs (watched for its gradient)
        self.free = tuple(free)  # the inputs the tail reads, by place in a microbatch
        self.counted = counted  # the tail divides by the loss's global count
        self.counts = counts  # inputs -> a microbatch's count (None: read off the body)
        self._integral = True  # the count is an integer (summed at once: ``_whole_count``)
        # Kept raw and made usable (and halved after an overflow) where they are read, so
        # a step that never reads one launches nothing for it (a GPU step of a small model
        # is bound by its launches): ``outer`` at the next seed, ``last`` only without a tail.
        self._outer: torch.Tensor | None = None  # the gradient L received last (None: 1)
        self._last: torch.Tensor | None = None  # the gradient dL/dS was last (no tail)
        self._seen: torch.Tensor | None = None  # the loop's overflows when it last saw a g
        #: its own until the module's call hands it the module's (``Guesses``)
        self.shared = Guesses()
        # per kind of input (``seed_trace.kind_of``): its replays so far, then its trace
        # (False: none)
        self._traced: dict[tuple[Any, ...], Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        # the traces are remade where the copy runs (a few steps' replays)
        return {**self.__dict__, "_traced": {}}

    def watch(self, flat: Sequence[Any]) -> None:
        """Record the gradient the caller sends into ``L`` this step, for the next."""
        if self.loss_pos is None:
            return
        loss = flat[self.loss_pos]
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(self.record)

    def record(self, g: torch.Tensor) -> None:
        """Keep ``g`` as the next guess, as it is (the seed it gives is made usable:
        ``seed``). No device op."""
        self._outer = g.detach()
        self.shared.last, self._seen = self, self.shared.overflows  # no halving due yet

    def _guess(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradient ``L`` got at this graph's last step and the overflows since; at
        its first step, the module's last step's, of any graph (``Guesses``). Its own
        first: two graphs of one loop may get different gradients every step (``w *
        cm(aux) + cm(main)``)."""
        last = self.shared.last
        if self.ranks:  # the module's, whichever graph each rank ran (``_bare``)
            source = self if last is None else last
        else:
            source = self if self._outer is not None or last is None else last
        return source._outer, self._halvings(source)

    def unguessed(self, microbatches: Sequence[tuple[Any, ...]], systems: Sequence[int]
                  ) -> bool:
        """Whether this step's seed (in one process) would be 1 for want of any gradient
        seen before, by this graph or any graph of its module (a first float16 step waits
        for the real one instead: ``deferred.py``). The guess the step uses (``seed``): the
        tail's replay of the last gradient of ``L``, or, where there is no tail or its count
        is not known before the forwards, the last ``dL/dS`` (only tail-less graphs leave
        one for another graph: a counted graph of another batch size has its own count)."""
        replayed = self.tail is not None
        if replayed and self._guess()[0] is None:
            return True
        if (replayed and not self.counted) or self._bare()._last is not None:
            return False
        if self.ranks:  # the same answer on every rank: the pre-pass's all-reduced count
            return not replayed or self.counts is None
        # a counted tail replays where the count pre-pass gives the count (read off the
        # first microbatch's forward otherwise: not known yet, so the bare guess may be used)
        return not replayed or self.global_count(microbatches, systems, False) is None

    def _halvings(self, source: Seed) -> torch.Tensor | None:
        """How often a GradScaler halved its scale since ``source`` saw its gradient: the
        overflows of any graph of the module since then, on the device (None: none)."""
        overflows = self.shared.overflows
        if overflows is None or source._seen is None:
            return overflows
        return overflows - source._seen

    def global_count(self, microbatches: Sequence[tuple[Any, ...]], systems: Sequence[int],
                     distributed: bool) -> Any:
        """``N`` before the first forward: the count graph on every microbatch, summed as
        the tail sums it (None: no count graph, or it cannot run on these inputs)."""
        if not self.counted or self.counts is None:
            return None
        try:
            with torch.no_grad():
                counts = self._whole_count(microbatches)
                if counts is None:
                    counts = [(self.counts.forward(*mb),) for mb in microbatches]
        except Exception:  # noqa: BLE001  (soft targets: the shapes need the model; no guess)
            counts = None
        if distributed:  # every rank joins, whatever its inputs gave (a guess is only a guess)
            from mbcompile.execution.distributed import all_reduce_sums

            local = ops.accumulate_sum(counts, 0, systems) if counts is not None else 0
            return all_reduce_sums(local)[0]
        return None if counts is None else ops.accumulate_sum(counts, 0, systems)

    def _whole_count(self, microbatches: Sequence[tuple[Any, ...]]) -> list[tuple[Any]] | None:
        """The count of every microbatch at once, on the inputs ``split`` cut them from
        (``ops.Microbatches.whole``), where that is exact: an integer count is the same
        number summed in any order. A count in floating point (class weights) is summed
        as the tail sums it, per microbatch, from then on (None)."""
        whole = getattr(microbatches, "whole", None)
        if whole is None or not self._integral:
            return None
        count = self.counts.forward(*whole)
        if isinstance(count, bool) or (isinstance(count, torch.Tensor) and (
                count.is_floating_point() or count.is_complex())) or isinstance(count, float):
            self._integral = False
            return None
        return [(count,)]

    def guess_count(self, first: Any, sizes: Sequence[int], distributed: bool) -> Any:
        """``N`` from the first microbatch when the shapes fix it (a Python int): the
        elements per sample times the samples (checked by the factor, like every guess).
        Not on ranks: a rank knows its own share's (its length may be another rank's),
        and a seed from it would differ between ranks (the module's last ``dL/dS`` instead)."""
        if not self.counted or distributed or not isinstance(first, int) or not sizes:
            return None
        per_sample, rest = divmod(first, sizes[0])
        return per_sample * sum(sizes) if not rest else None

    def seed(self, partial: torch.Tensor, count: Any, first: tuple[Any, ...],
             drawn: tuple[torch.Tensor, ...] = ()) -> torch.Tensor | None:
        """The seed of every microbatch's backward (None: seed with 1, as a plain
        ``backward()``): the tail's ``dL/dS`` for the guessed gradient of ``L``, at this
        step's draws (``drawn``) and unbatched inputs (in ``first``, the first microbatch).

        The replay (``_replay``: the tail's forward, then autograd's backward) of a kind of
        input (``seed_trace.kind_of``: shapes, dtypes, devices, Python numbers) replayed
        ``TRACE_AFTER`` times is traced into the aten ops autograd runs (``make_fx``), so
        that later steps call those few ops, not the autograd engine: the same kernels on
        the same values, the same seed bit for bit (``tests/test_seeded_backward.py``).
        Not sooner: a trace costs about a hundred replays, which a variant or a short run
        would not earn back."""
        if self.tail is None or (self.counted and count is None):
            last = self.last
            return last if last is not None and last.dtype == partial.dtype else None
        # the guess raw, with the overflows since: its halving is replayed (and traced) too
        args = (partial.detach(), *self._guess(),
                *((count,) if self.counted else ()), *drawn, *(first[i] for i in self.free))
        kind = kind_of(args)
        traced = self._traced.get(kind) if kind is not None else None
        if type(traced) is int or (traced is None and kind is not None
                                   and len(self._traced) < TRACED):  # another replay
            replays = (traced or 0) + 1
            self._traced[kind] = replays if replays < TRACE_AFTER else trace(
                self._replay, args)
        try:
            if isinstance(traced, fx.GraphModule):
                with torch.no_grad():
                    return traced.forward(*args)  # its code: no module call around it
            return self._replay(*args)
        except Exception:  # noqa: BLE001  (a tail that cannot be replayed: seed with 1)
            return None

    def _replay(self, partial: torch.Tensor, outer: torch.Tensor | None,
                halvings: torch.Tensor | None, *args: Any) -> torch.Tensor:
        """``dL/dS`` of the tail at ``S = 0`` (the tail is affine in ``S``) for the gradient
        ``outer`` of ``L`` (None: 1; halved ``halvings`` times, ``_halved``), made usable as a
        seed. A guess that is not finite (the last step's gradient overflowed: halving
        keeps it infinite) is 1, as ``outer`` says: only this step's own count may make the
        seed infinite, or the next step of a GradScaler would be NaN where eager's is not."""
        outer = _halved(outer, halvings)
        outer = None if outer is None else _usable(outer)
        with torch.enable_grad():
            s = partial.new_zeros(partial.shape).requires_grad_()
            loss = self.tail(s, *args)
            g = outer if outer is not None else torch.ones_like(loss)
            (seed,) = torch.autograd.grad(loss, s, g.to(loss.dtype).expand_as(loss))
        return _usable(seed, infinite=True)

    def overflowed(self, found: torch.Tensor) -> None:
        """The step's gradients were not finite (``found`` > 0, on the device): a
        GradScaler lowers its scale by half before the next step, so the next guesses
        are half the last gradients (a wrong guess of a power of two rescales exactly)."""
        self.shared.overflowed(found)  # applied where a guess is read (``_halved``)

    @property
    def outer(self) -> torch.Tensor | None:
        """The guess of the gradient ``L`` receives this step (None: 1). Not made usable
        here: the seed it gives is (``seed``), and a zero or non-finite guess gives the
        same seed of 1 either way."""
        return _halved(*self._guess())

    @property
    def last(self) -> torch.Tensor | None:
        """The guess of ``dL/dS`` where no tail can be replayed (None: seed with 1): this
        graph's last, or at its first step another's (a two-phase step's ``dL/dS`` is the
        gradient its loss got; a count that differs is a wrong guess, closer than 1)."""
        source = self._bare()
        last = _halved(source._last, self._halvings(source))
        return None if last is None else _usable(last)

    def _bare(self) -> Seed:
        """Whose last ``dL/dS`` this graph guesses from: its own, at its first step another's;
        on ranks the module's last, of any graph (each rank may run another graph: a rank
        that recompiled for its own length, its own split), which every rank saw alike."""
        bare = self.shared.bare
        if self.ranks:
            return self if bare is None else bare
        return self if self._last is not None or bare is None else bare

    def factor(self, g: torch.Tensor, seed: torch.Tensor | None) -> torch.Tensor:
        """What the gradients seeded with ``seed`` are multiplied by, given the ``dL/dS``
        that arrived: exactly 1.0 when the guess was right."""
        g = self._last = g.detach()
        self._seen = self.shared.overflows  # this step's overflow, if any, comes after
        if self.tail is None or self.ranks:  # (on ranks any graph's: ``_bare``)
            self.shared.bare = self
        if seed is None:
            return g
        # ``g / seed``, exactly 1.0 where they are equal: the seed is nonzero (``_usable``),
        # IEEE division of a finite number by itself is exactly 1, and an infinite seed
        # (a count of 0: every label ignored) is written as 1 where it was right, not NaN
        return torch.where(g == seed, 1.0, g / seed)


def _halved(g: torch.Tensor | None, halvings: torch.Tensor | None) -> torch.Tensor | None:
    """``g`` halved once per overflow (``halvings``, a count; device ops only): exact, a
    power of two (``g * 1.0`` is ``g``)."""
    if g is None or halvings is None:
        return g
    return g * torch.pow(0.5, halvings.to(device=g.device, dtype=g.dtype).reshape(()))


def _usable(g: torch.Tensor, infinite: bool = False) -> torch.Tensor:
    """``g`` as a seed or guess: a zero or non-finite one is 1 instead (a backward seeded
    with 0 would leave nothing for the factor to rescale). ``infinite``: ``g`` is this
    step's own ``dL/dS`` (replayed at this step's count), whose ±inf (a count of 0) is
    eager's seed too and is kept: eager's gradients are then what its ops make of an
    infinite seed (zeros from ``nll_loss`` with every label ignored, NaN from a sum
    divided by an empty mask's count), and a guess of 1 would make zeros NaN."""
    size = g.abs()  # 0 < |g| < inf: false for 0, ±inf and NaN; five ops where isfinite
    keep = size > 0 if infinite else (size > 0) & (size < math.inf)  # and != 0 take eight
    return torch.where(keep, g, 1.0)


def step_seed(top: fx.GraphModule, loss_outputs: Sequence[int]) -> Seed | None:
    """The ``Seed`` of a rewritten graph (before it is bound): the tail from the loop's
    trained partial sum to the one output that is the loss, or a bare ``Seed`` (guess the
    last ``dL/dS``; a two-phase step's loss is the output itself) where there is none.
    The loop is handed the draws the tail reads (``drawn``: ``loss * lam``, ``lam`` drawn
    before the loop as eager draws it), which its seed replays with the values drawn, and,
    for a hand-written mean (``tok.sum() / mask.sum()``), the count it divides by
    (``count_index``: ``_data_count``)."""
    nodes = list(top.graph.nodes)
    if any(n.target is ops.two_phase_step for n in nodes):
        return Seed()
    loop = next((n for n in nodes if n.target is ops.microbatch_loop), None)
    if loop is None or loop.kwargs.get("fused_index") is None:
        return None
    split = next(n for n in nodes if n.target is ops.split)
    fused, count = loop.kwargs["fused_index"], loop.kwargs.get("count_index")
    body = operator.attrgetter(loop.args[0].target)(top)
    body = body.__dict__.get("unsplit", body)  # ``recompute``'s blocks: their ops, whole
    counts = None if count is None else count_graph(body, count)
    totals = {}  # body output index -> its global value (after all_reduce_sums)
    acc = {n: n.args[1] for n in nodes if n.target is ops.accumulate_sum and n.args[0] is loop}
    for n in nodes:
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
                and n.args[0].target is ops.all_reduce_sums:
            totals[acc.get(n.args[0].args[n.args[1]])] = n
    total = totals.get(fused)
    out = nodes[-1]
    leaves = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    losses = [i for i in loss_outputs if isinstance(leaves[i], fx.Node)]
    float16 = body_in_float16(body)
    bare = Seed(counted=count is not None, counts=counts, float16=float16)
    if total is None or len(losses) != 1:
        return bare
    found, found_counts = None, None
    if count is None:  # a hand-written mean, tok.sum() / mask.sum(): its count, if any
        found, found_counts = _data_count(body, leaves[losses[0]], totals, fused)
    drawn_before = {n for n in nodes[:nodes.index(loop)] if is_draw(n)}
    tail = _tail(top, leaves[losses[0]], total, totals.get(count), split, drawn_before)
    if tail is None and found is not None:
        tail = _tail(top, leaves[losses[0]], total, totals[found], split, drawn_before)
        if tail is not None:  # the loop counts it, as it counts a cross entropy's
            count, counts = found, found_counts
            loop.update_kwarg("count_index", count)
    if tail is None:
        return bare
    graph, free, drawn = tail
    if drawn:
        loop.update_kwarg("drawn", tuple(drawn))
    if drawn or (found is not None and count == found):
        top.recompile()
    return Seed(graph, losses[0], free, count is not None, counts, float16)


def _data_count(body: fx.GraphModule, loss: fx.Node, totals: dict[Any, fx.Node],
                fused: int) -> tuple[int | None, Any]:
    """The body output that counts the loss's denominator, where the loss reads exactly one
    global sum besides its own and the data alone computes it (``mask.sum()``), and its
    count graph: the seed then replays ``S / N`` with this step's ``N`` (``inf`` where
    every label is masked, whose zero gradients eager's ops keep) instead of guessing."""
    stops = set(totals.values())
    needed = ancestors([loss], through=lambda n: n not in stops)
    others = [i for i, n in totals.items() if n in needed and i != fused and i is not None]
    counts = data_count_graph(body, others[0]) if len(others) == 1 else None
    return (None, None) if counts is None else (others[0], counts)


def _tail(top: fx.GraphModule, loss: fx.Node, total: fx.Node, count: fx.Node | None,
          split: fx.Node, drawn_before: set[fx.Node]
          ) -> tuple[fx.GraphModule, list[int], list[fx.Node]] | None:
    """``(S, [N], *draws, *inputs) -> L`` copied from ``top``, and the draws it reads (of
    ``drawn_before``, as inputs); None when ``L`` reads anything else the loop computes
    (another partial sum, a per-sample output), a batched input or a later draw."""
    stops = {total} | ({count} if count is not None else set())
    needed = ancestors([loss], through=lambda n: n not in stops and n not in drawn_before)
    if total not in needed:
        return None
    placeholders = [n for n in top.graph.nodes if n.op == "placeholder"]
    in_dims = split.kwargs["in_dims"]
    graph = fx.Graph()
    env = {total: graph.placeholder("total")}
    if count is not None:
        env[count] = graph.placeholder("count")
    drawn = [n for n in top.graph.nodes if n in needed and n in drawn_before]
    env.update((n, graph.placeholder(n.name)) for n in drawn)
    free = []
    for n in top.graph.nodes:
        if n not in needed or n in stops or n in env:
            continue
        if n.op == "placeholder":
            place = placeholders.index(n)
            if in_dims[place] is not None:
                return None  # a batched input: its value is not one microbatch's
            free.append(place)
            env[n] = graph.placeholder(n.name)
        elif n.target in (ops.split, ops.microbatch_loop, ops.accumulate_cat,
                          ops.accumulate_sum, ops.all_reduce_sums) or n.op == "output" \
                or is_draw(n):  # drawn after the loop: replayed, it would draw again
            return None
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[loss])
    return fx.GraphModule(top, graph, "LossTail"), free, drawn
