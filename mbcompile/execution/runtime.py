"""The training loop a backend binds in place of ``passes.ops.microbatch_loop``.

Under ``torch.no_grad``, or when nothing is trained, the loop just collects every
microbatch's outputs. When training with a loss inside the model it runs each
microbatch's forward *and* backward at once, so only one microbatch's activations
are alive, through ``_FusedStep`` below: the step's gradient is built in fresh
``.grad`` slots, checked once at the end of the step (one device read), and handed
to the user's ``loss.backward()``.

What the loop reports besides outputs (the noise scale to update, the last
call's loss counts) travels in an explicit ``StepChannels`` object that the
backend binds into the loop, never as attributes of a module.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from mbcompile.execution.live_hooks import UncheckedHookError, in_step
from mbcompile.execution.noise import NoiseScale, estimate_noise_scale
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

__all__ = ["StepChannels", "hand_over", "make_loop", "read_host"]


@dataclass
class StepChannels:
    """What one compiled graph's loop is told and reports besides its outputs.

    ``noise``: a ``NoiseScale`` the training step updates (None: not measured);
    ``config``: the run-time options compile time chose for this graph (``StepConfig``);
    ``last_counts``: the last call's per-microbatch counts of the trained loss's mean
    (references to device values, never read by the loop itself).
    """

    noise: NoiseScale | None = None
    config: StepConfig = field(default_factory=StepConfig)
    last_counts: tuple[Any, ...] | None = None


class _Loop:
    """One call's loop state, shared by the fused autograd function."""

    def __init__(self, body: fx.GraphModule, microbatches: list[tuple[Any, ...]],
                 fused_index: int | None, systems: Sequence[int], distributed: bool,
                 count_index: int | None = None, sizes: Sequence[int] = (),
                 noise: NoiseScale | None = None, sharded: Any = None, joint: Any = None
                 ) -> None:
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
        self.checks: _StepChecks | None = None
        self.no_grad_outputs: list[bool] = []
        self.step_grads: list[torch.Tensor | None] | None = None
        # On ranks: the gradient all-reduce the last microbatch's backward starts
        # (``distributed.OverlappedReduce``); None: reduced in ``backward`` instead.
        self.reducer: Any = None
        self.reduced: list[bool] | None = None  # per parameter: mbcompile all-reduces its grad

    def where(self, index: int) -> tuple[int, int]:
        """(system, microbatch within it) of the ``index``-th non-empty microbatch."""
        for system, count in enumerate(self.systems):
            if index < count:
                return system, index
            index -= count
        return len(self.systems) - 1, index

    def run(self) -> list[tuple[Any, ...]]:
        def loop() -> list[tuple[Any, ...]]:
            with self._step():
                outs = [(real, self._in_microbatch(i, lambda i=i: self._call(i)))
                        for _, i, real in self._schedule()]
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
        in_step.depth += 1  # hooks added to live layers after compile are watched
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
            in_step.depth -= 1

    def _agreed(self, fn: Callable[[], T], checks: Callable[[], torch.Tensor] | None = None
                ) -> T:
        """Run the local loop, then read its device-side checks once (``_StepChecks``).

        On real ranks the read is the status all-reduce: every rank learns whether
        any rank failed, raised or saw a non-finite loss, in the same one read.
        """
        if not self.distributed:
            result = fn()
            if checks is not None:
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
            values = step_status(None, local,
                                 self.checks.failed() if checks is not None else None,
                                 read=read_host)  # looked up now: the tests count its calls
            if values is not None:
                self._settle(values)
        except Exception:
            if reducer is not None:  # some rank failed: every rank drops the sums
                reducer.discard()
            raise
        return result

    def run_fused(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        if self.distributed:
            from mbcompile.execution import distributed

            # FSDP reduce-scatters its shards' gradients itself; mbcompile reduces the rest
            self.reduced = [not (self.sharded is not None and self.sharded.owns(p))
                            for p in params]
            replicated = [p for p, r in zip(params, self.reduced) if r]
            if distributed.OVERLAP and replicated:  # made first: a failing rank can still join
                self.reducer = distributed.OverlappedReduce(replicated)
        return self._agreed(lambda: self._run_fused(params), lambda: self.checks.packed())

    def _run_fused(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        joint = self._joint(params)
        if joint is None:
            return self._run_autograd(params)
        names = joint.names(params)
        # which outputs a gradient may enter, which parameters the loss reaches (None: the
        # body cannot tell on meta tensors)
        facts = joint.facts(names, params, self.fused_index, self.microbatches[0])
        if facts is None or not any(facts.reached):
            return self._run_autograd(params)
        try:
            return self._run_joint(joint, names, facts, params)
        except Exception as exc:  # noqa: BLE001  (the autograd path says what is wrong)
            # only its text: the exception's frames hold the failed attempt's tensors
            failed = f"{type(exc).__name__}: {exc}"
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
        parameter or module with backward hooks of its own (they fire per microbatch in
        autograd), a norm layer updating running statistics per microbatch, nor inside a
        ``saved_tensors_hooks`` context (torch.func refuses those two)."""
        joint = self.joint
        if (joint is None or joint.broken is not None or self.sharded is not None
                or self.noise is not None or self.reducer is not None
                or any(p._backward_hooks or p._post_accumulate_grad_hooks for p in params)
                or joint.needs_autograd()
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
            return None
        return joint

    def _run_joint(self, joint: Any, names: tuple[str, ...], facts: Any,
                   params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        """Every microbatch through the joint graph: the step's gradient is built in the
        graph's own tensors, never in ``.grad``, so the user's gradients are not touched;
        a parameter the loss does not reach is left out, and its gradient stays None."""
        trained = [p for p, r in zip(params, facts.reached) if r]
        names = tuple(n for n, r in zip(names, facts.reached) if r)
        checks = self.checks = _StepChecks(len(self.microbatches), params[0].device, False)
        grads, results = None, []
        for i, mb in enumerate(self.microbatches):
            grads, out = joint(names, trained, grads, self.fused_index, mb)
            checks.finite(i, out[self.fused_index])  # read once, at the end of the step
            results.append(out)
        self.no_grad_outputs = [isinstance(o, torch.Tensor) and not f
                                for o, f in zip(results[0], facts.outputs)]
        found = iter(grads)
        self.step_grads = [next(found) if r else None for r in facts.reached]
        return results

    def _run_autograd(self, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        # Set the user's gradients aside so autograd's own accumulation builds this
        # step's gradient in fresh .grad slots; put them back whatever happens.
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        checks = self.checks = _StepChecks(len(self.microbatches), params[0].device,
                                           self.noise is not None)
        hooks = [p.register_hook(checks.add_square) for p in params] if checks.noise else []
        try:
            results = []
            schedule = self._schedule()
            with torch.enable_grad(), self._step():
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
                    if self.reducer is not None and last:
                        self.reducer.arm()  # gradients final in this backward start reducing
                    if real:
                        checks.finite(i, partial)  # read once, at the end of the step
                    try:  # a round kept for FSDP's collectives (not real) adds exact zeros
                        self._in_microbatch(i, (partial if real else partial * 0).backward,
                                            "backward")
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
                    results.append(tuple(_detach(o) for o in out))
            if self.reducer is not None:
                self.reducer.flush()  # parameters the last backward never reached
            self.step_grads = [p.grad for p in params]
            if checks.noise:  # of the local gradients: the sums are written back in backward
                checks.step_square(self.step_grads)
        finally:
            for h in hooks:
                h.remove()
            for p, g in zip(params, saved):
                p.grad = g
        return results

    def _drain(self, k: int, rounds: int, in_backward: bool = False) -> None:
        """Round ``k`` of ``rounds`` failed on this rank: a sharded model's rank joins the
        FSDP collectives the other ranks still issue (``fsdp.ShardedStep.drain``)."""
        if self.sharded is not None:
            self.sharded.drain([j == rounds - 1 for j in range(k + 1, rounds)],
                               in_backward=in_backward)

    def _settle(self, values: list[float]) -> None:
        """Act on the step's one read: raise for a non-finite loss, keep the noise figures."""
        bad = self.checks.first_nonfinite(values)
        if bad is not None:
            self.step_grads = None  # never handed over: the step is rolled back
            system, local = self.where(bad)
            raise MicrobatchError(
                f"the loss of system {system}, microbatch {local} is "
                f"{values[bad]} (not finite); the step was rolled back: "
                "parameters and gradients are as they were before the call")
        if self.checks.noise:
            self.small_sq, self.counts, self.big_sq = self.checks.noise_figures(values)


class _StepChecks:
    """What a training step checks, kept on the device and read once per step.

    Per microbatch: the loss partial (is it finite?) and, when measuring the noise
    scale, ``|g_m|^2`` and the count; for the step: ``|Σ g_m|^2``. ``packed()`` is
    one vector ``[loss partials..., |g_m|^2..., counts..., |G|^2]``, so the whole step
    costs one device-to-host read, not one ``.item()`` per microbatch. The partials
    are kept as they come (detached) and stacked once, in ``packed()``, rather than
    copied one by one into a device vector (three dispatched ops per microbatch).
    """

    def __init__(self, n: int, device: torch.device, noise: bool) -> None:
        self.n, self.noise, self.current, self.device = n, noise, 0, device
        self.partials: list[torch.Tensor | None] = [None] * n
        self._losses: torch.Tensor | None = None
        if noise:
            self.squares = torch.zeros(n, dtype=torch.float64, device=device)
            self.counts = torch.zeros(n, dtype=torch.float64, device=device)
            self.big = torch.zeros(1, dtype=torch.float64, device=device)

    def finite(self, i: int, partial: torch.Tensor) -> None:
        self.partials[i] = partial.detach()  # read once, at the end of the step

    def add_square(self, g: torch.Tensor) -> None:  # a tensor hook: the gradient is unchanged
        self.squares[self.current].add_(torch.linalg.vector_norm(g.detach()).double().square())

    def count(self, i: int, count: Any) -> None:
        self.counts[i] = count.detach() if isinstance(count, torch.Tensor) else float(count)

    def step_square(self, grads: Sequence[torch.Tensor | None]) -> None:
        for g in grads:
            if g is not None:
                self.big.add_(torch.linalg.vector_norm(g.detach()).double().square())

    def losses(self) -> torch.Tensor:
        """Every microbatch's loss partial, in float64 (one stack; a partial that is not
        0-dim is summed: a scalar loss's partial only needs its shape fixed)."""
        if self._losses is None and not self.n:
            self._losses = torch.zeros(0, dtype=torch.float64, device=self.device)
        elif self._losses is None:
            parts = [p if p.dim() == 0 else p.sum() for p in self.partials]
            self._losses = torch.stack(parts).double()
        return self._losses

    def packed(self) -> torch.Tensor:
        if not self.noise:
            return self.losses()
        return torch.cat([self.losses(), self.squares, self.counts, self.big])

    def failed(self) -> torch.Tensor:
        """A device bool: some microbatch's loss is not finite."""
        return ~torch.isfinite(self.losses()).all()

    def first_nonfinite(self, values: Sequence[float]) -> int | None:
        return next((i for i, v in enumerate(values[:self.n]) if not math.isfinite(v)), None)

    def noise_figures(self, values: Sequence[float]) -> tuple[list[float], list[float], float]:
        n = self.n
        return list(values[n:2 * n]), list(values[2 * n:3 * n]), values[3 * n]


def read_host(t: torch.Tensor) -> list[float]:
    """The step's one device-to-host read (every check of the step, packed in ``t``)."""
    return t.detach().cpu().tolist()


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


class _FusedStep(torch.autograd.Function):
    """Forward runs every microbatch's forward and backward; backward hands over grads.

    Outputs are the microbatch outputs (flattened). The gradient arriving for the
    loss's partial sums is the same scalar ``g`` for every microbatch (the loss is
    their sum, maybe divided by a count), so the parameters' gradient is
    ``g * Σ_m ∂partial_m/∂θ``, which the forward already accumulated.
    """

    @staticmethod
    def forward(ctx: Any, loop: _Loop, n_params: int, *params: Any) -> Any:
        results = loop.run_fused(params)
        ctx.loop, ctx.n_params = loop, n_params
        ctx.set_materialize_grads(False)
        flat = [o for out in results for o in out if isinstance(o, torch.Tensor)]
        loop.layout = [[isinstance(o, torch.Tensor) for o in out] for out in results]
        # only the non-tensors: ctx holds the loop until backward, and tensors kept here
        # (every microbatch's logits) would outlive the step's join of them
        loop.constants = [[None if t else o for o, t in zip(out, layout)]
                          for out, layout in zip(results, loop.layout)]
        ctx.mark_non_differentiable(*(o for out in results for o, skip in
                                      zip(out, loop.no_grad_outputs) if skip))
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        loop: _Loop = ctx.loop
        width = sum(loop.layout[0])
        loss_pos = sum(loop.layout[0][:loop.fused_index])  # among a microbatch's tensors
        return hand_over(loop, grads, [m * width + loss_pos for m in range(len(loop.layout))],
                         ctx.n_params, lambda step: _reduce(loop, step),
                         None if loop.noise is None else lambda g: _measure_noise(loop, g))


def _reduce(loop: _Loop, step: list[torch.Tensor | None]) -> None:
    """The step's gradients summed over ranks: the all-reduce the last microbatch's backward
    started, or one bucketed all-reduce per step, never per microbatch."""
    if loop.reducer is not None:  # launched during the last microbatch's backward
        loop.reducer.wait()
        loop.reducer = None
    elif loop.distributed:
        from mbcompile.execution.distributed import all_reduce_gradients

        all_reduce_gradients([s for s, r in zip(step, loop.reduced or [True] * len(step))
                              if r])


def hand_over(owner: Any, grads: Sequence[Any], loss_positions: Sequence[int], n_params: int,
              reduce: Callable[[list[torch.Tensor | None]], None],
              noise: Callable[[torch.Tensor], None] | None = None) -> tuple[Any, ...]:
    """The backward of a training step, fused (``_FusedStep``) or two-phase
    (``two_phase._TwoPhaseStep``): hand the gradients its forward built
    (``owner.step_grads``) to the caller's ``loss.backward()``.

    ``grads`` arrive for the step's tensor outputs, ``loss_positions`` being the loss's
    partial sums among them. One policy for a gradient arriving at any other output: the
    step's backward already ran, for the loss only, so a nonzero one would be lost; it is
    refused (all checked in one device read, and only when some arrive). The gradients
    are handed over once, summed over ranks by ``reduce``, and scaled in place by the
    loss's incoming gradient ``g``, the same for every partial sum (the loss is their
    sum, maybe divided by a count): ``g * Σ_m ∂partial_m/∂θ``.
    """
    losses = set(loss_positions)
    extra = [g for i, g in enumerate(grads) if i not in losses and g is not None]
    if extra and bool(torch.stack([x.ne(0).any() for x in extra]).any()):
        raise MicrobatchError(
            "a gradient flows into an output of the compiled module other than its loss (a "
            "per-sample output), but the step's backward already ran, for the loss only; "
            "compute everything you backpropagate through inside the model (return it in "
            "the loss), or call the module under torch.no_grad() for outputs you only read")
    if owner.step_grads is None:
        raise MicrobatchError(
            "backward through a compiled module's step ran twice; each call's gradients "
            "are handed over once (retain_graph is not supported across its loop)")
    step, owner.step_grads = owner.step_grads, None
    reduce(step)
    loss_grads = [grads[i] for i in loss_positions]
    if all(g is None for g in loss_grads):
        return (None, None) + (None,) * n_params
    g = next(x for x in loss_grads if x is not None)
    others = [x for x in loss_grads if x is not g]  # the sum's backward hands one tensor
    if any(x is None for x in others) or (
            others and not bool(torch.stack([x.eq(g).all() for x in others]).all())):
        raise MicrobatchError("microbatch losses received different gradients; only the "
                              "combined loss can be differentiated")
    if noise is not None:
        noise(g)
    # Scale in place, no second buffer, and unconditionally: testing ``g == 1`` would
    # read the device every step, and x * 1.0 is exactly x. One foreach call: the same
    # products as a mul_ per parameter, without a Python dispatch for each.
    scaled = [s for s in step if s is not None]
    if scaled:
        torch._foreach_mul_(scaled, g)
    return (None, None, *step)


def _measure_noise(loop: _Loop, g: torch.Tensor) -> None:
    """Add this step's microbatch and step squared norms to the noise-scale averages.

    The norms were taken of the loss's partial sums; ``g * N`` is the factor from
    those to the per-sample loss (``L = g * S`` with ``g = 1/N`` for a plain mean),
    so tr(Σ) and |G|^2 come out in the loss's own units. ``g`` stays a device tensor:
    the noise scale reads it when somebody reads the noise scale, not in the step.
    """
    total = sum(loop.counts)
    scale = (g.detach().double() * total).square()
    loop.noise.update(estimate_noise_scale(loop.small_sq, loop.counts, loop.big_sq, total),
                      scale=scale)


def make_loop(channels: StepChannels, distributed: bool = False) -> Callable[..., Any]:
    """The loop a backend binds for ``passes.ops.microbatch_loop``, reporting to ``channels``.

    With ``distributed`` the call holds one rank's share: the step's status and
    checks are all-reduced once, and the gradient buckets are all-reduced as the last
    microbatch's backward finishes them, waited for in ``backward``.
    """
    def microbatch_loop(body: fx.GraphModule, microbatches: list[tuple[Any, ...]], *,
                        fused_index: int | None, systems: Sequence[int],
                        count_index: int | None = None, sizes: Sequence[int] = ()
                        ) -> list[tuple[Any, ...]]:
        sharded, params, joint = known(body)
        loop = _Loop(body, microbatches, fused_index, systems, distributed, count_index, sizes,
                     channels.noise, sharded, joint)
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
                                                 config.gradient_sync == "microbatch"),
                                tuple(body.parameters()) if root is None else None,
                                config.joint)
        return bodies[id(body)][1:]

    microbatch_loop.__module__ = __name__
    return microbatch_loop


def _run(loop: _Loop, params: Sequence[torch.Tensor] | None = None) -> list[tuple[Any, ...]]:
    """One call of the loop; ``params`` are the body's (None: listed now)."""
    params = [p for p in (loop.body.parameters() if params is None else params)
              if p.requires_grad]
    if not params or not torch.is_grad_enabled():
        return loop.run()
    if loop.fused_index is None or any(_requires_grad(mb) for mb in loop.microbatches[:1]):
        if loop.distributed:
            raise InputError(
                "training on torch.distributed needs the loss computed inside the model (one "
                "scalar loss) and inputs that do not require grad: gradients are reduced once "
                "per step from the per-microbatch backward. Return the loss from forward, or "
                "wrap the model in DistributedDataParallel and use the simulated backend")
        return loop.run()
    flat = iter(_FusedStep.apply(loop, len(params), *params))
    return [tuple(next(flat) if is_t else c for is_t, c in zip(layout, consts))
            for layout, consts in zip(loop.layout, loop.constants)]


def _requires_grad(value: Any) -> bool:
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return any(t.requires_grad for t in value)  # the usual microbatch: no pytree walk
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(value))
