"""The training loop a backend binds in place of ``passes.ops.microbatch_loop``.

Under ``torch.no_grad``, or when nothing is trained, the loop just collects every
microbatch's outputs. When training with a loss inside the model it runs each
microbatch's forward *and* backward at once, so only one microbatch's activations
are alive, through ``handover.FusedStep``: the step's gradient is built in fresh
``.grad`` slots, each backward seeded as eager's (``seeding.py``), checked at most
once at the end of the step (one device read), and handed to the user's
``loss.backward()``. A first step in float16 runs its backwards there instead, seeded
with the gradient that arrived (``deferred.py``).

What the loop reports besides outputs (the noise scale to update, the last call's loss
counts) travels in a ``StepChannels`` the backend binds into the loop, never on a module.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from mbcompile.execution.deferred import deferred
from mbcompile.execution.handover import FusedStep, grads_aside, hand_over, hooks_aside
from mbcompile.execution.live_hooks import UncheckedHookError, in_step
from mbcompile.execution.noise import NoiseScale
from mbcompile.execution.outer_calls import flop_counter_refused, forward_only, outer_calls_refused
from mbcompile.execution.replay import RngStates
from mbcompile.execution.seeding import Seed
from mbcompile.execution.step_checks import StepChecks, read_host, take_refused
from mbcompile.execution.step_config import StepConfig
from mbcompile.passes.errors import (
    InputError,
    JointStepWarning,
    MicrobatchError,
    MicrobatchOutOfMemoryError,
)
from mbcompile.passes.ops import as_tuple
from mbcompile.passes.sources import user_stacklevel

T = TypeVar("T")

__all__ = ["StepChannels", "hand_over", "make_loop", "read_host"]  # re-exported: two_phase.py


@dataclass
class StepChannels:
    """What one compiled graph's loop is told and reports besides its outputs.

    ``noise``: a ``NoiseScale`` the training step updates (None: not measured);
    ``config``: the run-time options compile time chose for this graph (``StepConfig``);
    ``last_counts``: the last call's per-microbatch counts of the trained loss's mean
    (references to device values, never read by the loop itself); ``refused``: on ranks,
    the error of a call this rank refuses (its length fits no split:
    ``length_plans.for_length``), raised by the next loop once the step's first
    collective is joined, so that every rank stops the step (taken by that loop).
    """

    noise: NoiseScale | None = None
    config: StepConfig = field(default_factory=StepConfig)
    last_counts: tuple[Any, ...] | None = None
    refused: BaseException | None = None


class _Loop:
    """One call's loop state, shared by the fused autograd function."""

    def __init__(self, body: fx.GraphModule, microbatches: list[tuple[Any, ...]],
                 fused_index: int | None, systems: Sequence[int], distributed: bool,
                 count_index: int | None = None, sizes: Sequence[int] = (),
                 noise: NoiseScale | None = None, sharded: Any = None, joint: Any = None,
                 seeding: Seed | None = None, nonfinite: str = "return",
                 replayable: bool = True) -> None:
        # ``joint.JointStep``: a body compiled with torch.compile runs each training
        # microbatch as one forward-backward graph (None: forward, then autograd)
        self.joint = joint
        # A model sharded with FSDP2: ``fsdp.ShardedStep`` runs each microbatch between
        # FSDP's hooks and keeps every rank's forwards in step (None: not sharded).
        self.sharded = sharded
        self.body = body if sharded is None else sharded.body
        self.microbatches = microbatches
        self.fused_index = fused_index
        self.systems = systems
        self.distributed = distributed
        self.count_index = count_index
        self.sizes = sizes
        self.noise = noise  # the gradient-noise-scale measurement, when switched on
        self.small_sq: list[float] = []
        self.counts: list[float] = []
        self.big_sq = 0.0
        self.checks: StepChecks | None = None
        # how each backward is seeded (``seeding.py``; None: with 1), and the seed it used
        self.seeding = seeding
        self.seed_value: torch.Tensor | None = None
        # a first float16 step's backwards wait for the real seed (``deferred.py``), where
        # a microbatch can run again after the call (``StepConfig.replayable``)
        self.replayable, self.deferred = replayable, None
        self.nonfinite = nonfinite  # "return": a non-finite loss is the caller's; "raise"
        self.no_grad_outputs: list[bool] = []
        self.step_grads: list[torch.Tensor | None] | None = None
        # On ranks: the gradient all-reduce the last microbatch's backward starts
        # (``distributed.OverlappedReduce``); None: reduced in ``backward`` instead.
        self.reducer: Any = None
        self.reduced: list[bool] | None = None  # per parameter: mbcompile all-reduces its grad
        self.refused: BaseException | None = None  # raised in the step (StepChannels.refused)
        self.drawn: tuple[Any, ...] = ()  # draws before the loop its seed reads (``ops``)

    def where(self, index: int) -> tuple[int, int]:
        """(system, microbatch within it) of the ``index``-th non-empty microbatch."""
        for system, count in enumerate(self.systems):
            if index < count:
                return system, index
            index -= count
        return len(self.systems) - 1, index

    def run(self) -> list[tuple[Any, ...]]:
        def loop() -> list[tuple[Any, ...]]:
            if self.refused is not None and self.sharded is None:
                raise self.refused  # (sharded: its rounds first, their gathers paired)
            with self._step():
                outs = [(real, self._in_microbatch(i, lambda i=i: self._call(i)))
                        for _, i, real in self._schedule()]
            if self.refused is not None:
                raise self.refused
            return [out for real, out in outs if real]

        return self._agreed(loop)

    def _schedule(self) -> list[tuple[int, int, bool]]:
        """``(round, microbatch, real)`` per forward. A sharded model's ranks run the same
        number of forwards (FSDP all-gathers in each): a rank with fewer microbatches
        runs its last one again in the missing rounds (not real: its result is dropped
        and its gradient weighted 0)."""
        n = len(self.microbatches)
        rounds = self.sharded.rounds(n) if self.sharded is not None else n
        return [(k, min(k, n - 1), k < n) for k in range(rounds)]

    def _call(self, index: int) -> tuple[Any, ...]:
        mb = self.microbatches[index]
        return as_tuple(self.body(*mb) if self.sharded is None else self.sharded.call(mb))

    def _step(self) -> Any:
        return self.sharded.step() if self.sharded is not None else contextlib.nullcontext()

    def _in_microbatch(self, index: int, fn: Callable[[], T], what: str = "forward") -> T:
        """Run ``fn`` for microbatch ``index``; a failure names the system and microbatch.

        An out-of-memory error stays one (``MicrobatchOutOfMemoryError`` is also a
        ``torch.OutOfMemoryError`` whose message keeps the allocator's text), so
        batch-size finders that catch OOMs keep working around a compiled module.
        """
        in_step.enter()  # hooks added to live layers after compile are watched
        try:
            return fn()
        except (MicrobatchError, UncheckedHookError):
            raise
        except Exception as exc:
            system, local = self.where(index)
            kind = MicrobatchOutOfMemoryError if isinstance(exc, torch.OutOfMemoryError) \
                else MicrobatchError
            raise kind(
                f"system {system}, microbatch {local} failed in its {what}: "
                f"{type(exc).__name__}: {exc}\n  the step was rolled back: parameters and "
                "gradients are as they were before the call (the original error is the "
                "__cause__ of this one)") from exc
        finally:
            in_step.leave()

    def _agreed(self, fn: Callable[[], T], checks: Callable[[], torch.Tensor] | None = None
                ) -> T:
        """Run the local loop, then read its device-side checks once (``StepChecks``).

        On real ranks the read is the status all-reduce: every rank learns whether
        any rank failed or raised (or, with ``nonfinite="raise"``, saw a non-finite
        loss), in the same one read. In one process a step that has nothing to act on
        (a non-finite loss is returned, no noise scale) reads nothing at all.
        """
        if not self.distributed:
            result = fn()
            if checks is not None and (self.nonfinite == "raise" or self.noise is not None):
                self._settle(read_host(checks()))
            return result
        from mbcompile.execution.distributed import step_status

        reducer = self.reducer
        try:
            result = fn()
        except Exception as exc:
            if reducer is not None:  # join the bucket all-reduces the other ranks launch
                reducer.flush(failed=True)
                reducer.discard()
            step_status(exc, read=read_host)  # raises exc here, and on every other rank
            raise
        try:
            local = checks() if checks is not None else None
            failed = self.checks.failed() if checks is not None and self.nonfinite == "raise" \
                else None
            values = step_status(None, local, failed,
                                 read=read_host)  # looked up now: the tests count its calls
            if values is not None:
                self._settle(values)
        except Exception:
            if reducer is not None:  # some rank failed: every rank drops the sums
                reducer.discard()
            raise
        return result

    def run_fused(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        self.deferred = deferred(self, params)  # alike on every rank, before a collective
        if self.distributed:
            from mbcompile.execution import distributed, sparse_grads
            # FSDP reduce-scatters its shards' gradients itself; mbcompile reduces the rest
            self.reduced = [not (self.sharded is not None and self.sharded.owns(p))
                            for p in params]
            replicated = [p for p, r in zip(params, self.reduced) if r]
            if distributed.OVERLAP and replicated and self.deferred is None:  # made first:
                self.reducer = distributed.OverlappedReduce(  # a failing rank joins
                    replicated, sparse=sparse_grads.sparse_gradient_params(self.body))
        return self._agreed(lambda: self._run_fused(params), lambda: self.checks.packed())

    def _run_fused(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        if self.deferred is not None:  # the first float16 step: no guess to seed it with
            return self.deferred.forward()
        joint = self._joint(params)
        if joint is None:
            return self._run_autograd(params)
        names = joint.names(params)
        # which outputs a gradient may enter, which parameters the loss reaches (None: the
        # body cannot tell on meta tensors)
        facts = joint.facts(names, params, self.fused_index, self.microbatches[0])
        if facts is None or not any(facts.reached):
            return self._run_autograd(params)
        drawn = RngStates(self.microbatches[0], joint.generators)
        try:
            return joint.run(self, names, facts, params)
        except Exception as exc:  # noqa: BLE001  (the autograd path says what is wrong)
            # only its text: the exception's frames hold the failed attempt's tensors
            failed = f"{type(exc).__name__}: {exc}"
        drawn.restore()  # the microbatches the failed attempt ran drew: eager draws once
        # The joint graph failed (nothing was kept: its gradients were the step's own).
        # Run the step the autograd way: if the model is at fault, that raises the
        # model's error as usual, and the joint graph stays for the next step; if only
        # the joint graph is, it is dropped for good, with a warning.
        results = self._run_autograd(params)
        joint.broken = failed
        warnings.warn(
            "torch_compile: the joint forward-backward graph of the training step failed "
            f"({failed[:300]}); the step ran, and will run, each microbatch's compiled "
            "forward and then autograd's backward instead (exact, a little slower)",
            JointStepWarning, stacklevel=user_stacklevel())
        return results

    def _joint(self, params: Sequence[torch.Tensor]) -> Any:
        """The body's ``JointStep`` when this step can use it, else None. Not with FSDP
        (its hooks run each unit's collectives), the noise scale (per-microbatch
        gradient norms), the overlapped all-reduce (it starts in the last backward), a
        module with backward hooks of its own (they fire per microbatch in autograd), a
        norm layer updating running statistics per microbatch, nor inside a
        ``saved_tensors_hooks`` context (torch.func refuses those two). A parameter's tensor
        and post-accumulate-grad hooks are no reason: they fire in the caller's backward, on
        the step's gradient (``handover.hooks_aside``)."""
        joint = self.joint
        if (joint is None or joint.broken is not None or self.sharded is not None
                or self.noise is not None or self.reducer is not None or self.refused is not None
                or joint.needs_autograd()
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
            return None
        return joint

    def _run_autograd(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        # The user's gradients set aside, so autograd's own accumulation builds this
        # step's gradient in fresh .grad slots, and put back whatever happens. The user's
        # post-accumulate-grad and tensor hooks of parameters wait for the caller's
        # backward (handover.py).
        with grads_aside(params):
            return self._autograd_step(params)

    def _autograd_step(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        checks = self.checks = StepChecks(len(self.microbatches), params[0].device,
                                          self.noise is not None)
        hooks: list[Any] = []
        seeding, self.seed_value = self.seeding, None
        # N before the first forward: on ranks its all-reduce comes before anything can fail
        count = None if seeding is None else seeding.global_count(
            self.microbatches, self.systems, self.distributed)
        try:
            results = []
            schedule = self._schedule()  # on ranks of a sharded model: agreed by every rank
            # (FSDP2 calls a sharded parameter's post-accumulate-grad hooks after each
            # reduce-scatter: set aside too, they fire in the caller's backward, once)
            with torch.enable_grad(), self._step(), hooks_aside(params):
                if self.refused is not None:  # after the count's all-reduce: the ranks agree
                    self._drain(-1, len(schedule))  # FSDP2: join every round on zeros
                    raise self.refused
                if checks.noise:  # after the user's hooks are set aside: these run per microbatch
                    hooks = [p.register_hook(checks.add_square) for p in params]
                for k, i, real in schedule:
                    checks.current = i
                    last = k == len(schedule) - 1
                    if self.sharded is not None:
                        self.sharded.sync(last)  # one reduce-scatter round, in the last backward
                    try:
                        out = self._in_microbatch(i, lambda i=i: self._call(i))
                    except Exception:
                        self._drain(k, len(schedule))
                        raise
                    partial = out[self.fused_index]
                    if k == 0 and seeding is not None:  # eager's seed, guessed (seeding.py)
                        if count is None and self.count_index is not None:
                            count = seeding.guess_count(out[self.count_index], self.sizes,
                                                        self.distributed)
                        self.seed_value = seeding.seed(partial, count, self.microbatches[0],
                                                    self.drawn)
                    if self.reducer is not None and last:
                        self.reducer.arm()  # gradients final in this backward start reducing
                    if real:
                        checks.finite(i, partial)  # read once, at the end of the step
                    try:  # a round kept for FSDP's collectives (not real) adds exact zeros
                        self._in_microbatch(i, lambda p=partial if real else partial * 0:
                                            p.backward(self.seed_value), "backward")
                    except Exception:
                        self._drain(k, len(schedule), in_backward=True)
                        raise
                    if not real:
                        continue
                    if checks.noise:
                        checks.count(i, out[self.count_index] if self.count_index is not None
                                     else self.sizes[i])
                    if i == 0:  # outputs autograd never reaches (counts) get no gradient
                        self.no_grad_outputs = [isinstance(o, torch.Tensor) and not o.requires_grad
                                                for o in out]
                    results.append(tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                         for o in out))
            if self.reducer is not None:
                self.reducer.flush()  # parameters the last backward never reached
            self.step_grads = [p.grad for p in params]
            if checks.noise:  # of the local gradients: the sums are written back in backward
                checks.step_square(self.step_grads)
        finally:
            for h in hooks:
                h.remove()
        return results

    def _drain(self, k: int, rounds: int, in_backward: bool = False) -> None:
        """Round ``k`` of ``rounds`` failed on this rank (-1: the step was refused before its
        first): a sharded model's rank joins the FSDP collectives the other ranks still
        issue (``fsdp.ShardedStep.drain``)."""
        if self.sharded is not None:
            self.sharded.drain([j == rounds - 1 for j in range(k + 1, rounds)],
                               in_backward=in_backward, started=k >= 0)

    def _settle(self, values: list[float]) -> None:
        """Act on the step's one read: raise for a non-finite loss (``nonfinite="raise"``;
        by default it is returned, as eager returns it), keep the noise figures."""
        bad = self.checks.first_nonfinite(values)
        if bad is not None and self.nonfinite == "raise":
            self.step_grads = None  # never handed over: the step is rolled back
            system, local = self.where(bad)
            raise MicrobatchError(
                f"the loss of system {system}, microbatch {local} is "
                f"{values[bad]} (not finite); the step was rolled back: "
                "parameters and gradients are as they were before the call")
        if self.checks.noise:
            self.small_sq, self.counts, self.big_sq = self.checks.noise_figures(values)


def make_loop(channels: StepChannels, distributed: bool = False) -> Callable[..., Any]:
    """The loop a backend binds for ``passes.ops.microbatch_loop``, reporting to ``channels``.

    With ``distributed`` the call holds one rank's share: the step's status and
    checks are all-reduced once, and the gradient buckets are all-reduced as the last
    microbatch's backward finishes them, waited for in ``backward``.
    """
    def microbatch_loop(body: fx.GraphModule, microbatches: list[tuple[Any, ...]], *,
                        fused_index: int | None, systems: Sequence[int],
                        count_index: int | None = None, sizes: Sequence[int] = (),
                        drawn: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        sharded, params, joint = known(body)
        config = channels.config
        loop = _Loop(body, microbatches, fused_index, systems, distributed, count_index, sizes,
                     channels.noise, sharded, joint, config.seed, config.nonfinite,
                     config.replayable)
        loop.refused, loop.drawn = take_refused(channels), drawn
        results = _run(loop, params)
        if count_index is not None:  # kept for reports (token counts); no copy, no sync
            channels.last_counts = tuple(r[count_index] for r in results)
        return results

    # per body, found on its first call: its ShardedStep (None: not sharded), its parameters
    # and its JointStep (None: not compiled with torch.compile)
    bodies: dict[int, tuple[fx.GraphModule, Any, tuple[torch.Tensor, ...] | None, Any]] = {}

    def known(body: fx.GraphModule) -> tuple[Any, tuple[torch.Tensor, ...] | None, Any]:
        """The body's ShardedStep, and its parameters, listed once: a body's parameters are
        fixed (compile builds a new body when the model's are replaced), and walking the
        modules on every call costs more than the check it feeds. FSDP2 swaps a sharded
        model's parameters between sharded and gathered, so those are listed per call (None).
        """
        if id(body) not in bodies:
            from mbcompile.execution import fsdp

            root = fsdp.sharded_root(body)
            if root is not None and not distributed:
                raise InputError(
                    f"{type(root).__name__} is sharded with fully_shard, so its parameters "
                    "live on several ranks: compile it with backend='torch.distributed' inside "
                    "the process group that sharded it")
            config = channels.config
            bodies[id(body)] = (body, None if root is None else
                                fsdp.ShardedStep(body, root, config.reshard_after_forward,
                                                 config.gradient_sync == "microbatch",
                                                 config.lengths_vary),
                                tuple(body.parameters()) if root is None else None,
                                config.joint)
        return bodies[id(body)][1:]

    microbatch_loop.__module__ = __name__
    return microbatch_loop


def _run(loop: _Loop, params: Sequence[torch.Tensor] | None = None) -> list[tuple[Any, ...]]:
    """One call of the loop; ``params`` are the body's (None: listed now)."""
    params = [p for p in (loop.body.parameters() if params is None else params) if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return forward_only(loop.run, loop.body)
    if loop.fused_index is None or any(_requires_grad(mb) for mb in loop.microbatches[:1]):
        if loop.distributed:
            raise InputError(
                "training on torch.distributed needs the loss computed inside the model (one "
                "scalar loss) and inputs that do not require grad: gradients are reduced once per "
                "step from the per-microbatch backward. Return the loss from forward, or wrap "
                "the model in DistributedDataParallel and use the simulated backend")
        flop_counter_refused()  # FlopCounterMode: named, nothing run
        return loop.run()
    outer_calls_refused()  # inside torch.func, a checkpoint, FlopCounterMode: named, none run
    flat = iter(FusedStep.apply(loop, len(params), *params))
    return [tuple(next(flat) if is_t else c for is_t, c in zip(layout, consts))
            for layout, consts in zip(loop.layout, loop.constants)]


def _requires_grad(value: Any) -> bool:
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return any(t.requires_grad for t in value)  # the usual microbatch: no pytree walk
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))
