"""The two-phase step a backend binds in place of ``passes.ops.two_phase_step``.

A graph whose loss couples samples (a contrastive loss, ``loss.sqrt()``, BatchNorm in
training) is rewritten into the per-sample part P (``body``) and the coupled part C
(``coupled``), which reads the frontier F (``passes/coupling.py``). One training step,
all inside the compiled module's call, as ``runtime._FusedStep`` does for a plain loss:

1. P runs on every microbatch without grad; F's pieces are kept with the RNG state
   each microbatch started from;
2. F is joined over microbatches (and gathered over ranks), C runs once with grad on
   it: the loss, C's parameter gradients and dL/dF;
3. P runs again on every microbatch, with grad, from the same RNG state (dropout
   draws the same masks), and backpropagates its slice of dL/dF.

By the chain rule split at F the gradients are the full batch's; only one
microbatch of P's activations is alive at a time, plus F and C at the whole batch.
The step's gradient is built in set-aside ``.grad`` slots, checked with one device
read, and handed to the user's ``loss.backward()``; C's backward is seeded with the
gradient the loss received at the previous step, rescaled exactly in the hand-over
(``seeding.py``); a failure in any phase leaves parameters and gradients as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from mbcompile.execution import runtime
from mbcompile.execution.frontier_gather import RankGather, mark_sent
from mbcompile.execution.handover import grads_aside, hand_over, hooks_aside
from mbcompile.execution.outer_calls import outer_calls_refused
from mbcompile.execution.replay import RngStates, RunningStatistics, fingerprint, same_values
from mbcompile.execution.runtime import StepChannels, _Loop, read_host
from mbcompile.execution.step_checks import take_refused
from mbcompile.passes import ops
from mbcompile.passes.errors import InputError, MicrobatchError
from mbcompile.passes.facts import PARAMS
from mbcompile.passes.fake_probe import FakeProbe
from mbcompile.passes.generators import generators_of
from mbcompile.passes.ops import as_tuple

__all__ = ["frontier_template", "make_two_phase"]

_PHASES = ("forward without grad (phase 1 of 3)", "forward again with grad (phase 3 of 3)",
           "backward of its slice of dL/dF (phase 3 of 3)")


class _Step:
    """One call's two-phase step: the three phases, and what backward hands over."""

    def __init__(self, body: fx.GraphModule, coupled: fx.GraphModule,
                 microbatches: list[tuple[Any, ...]], free: tuple[Any, ...],
                 outputs: Sequence[tuple[str, int]], loss_index: int | None,
                 systems: Sequence[int], sizes: Sequence[int], gather: RankGather | None,
                 sums: Callable[..., tuple[Any, ...]], keep_coupled_grads: bool,
                 template: Sequence[tuple[Any, ...]] | None = None,
                 seeding: Any = None, nonfinite: str = "return") -> None:
        self.body, self.coupled = body, coupled
        self.template = template  # the frontier's shapes, for a failing rank (StepConfig)
        self.microbatches, self.free = microbatches, free
        self.outputs, self.loss_index = outputs, loss_index
        self.systems = systems
        self.gather, self.sums = gather, sums
        self.keep_coupled_grads = keep_coupled_grads  # C's gradients counted on one rank
        # on ranks, whether they exchange F's shapes before gathering it (frontier_gather.py)
        self.exchanges = gather is not None and gather.exchange and any(self._ndims())
        self.loop = _Loop(body, microbatches, None, systems, gather is not None, sizes=sizes)
        self.step_grads: list[torch.Tensor | None] | None = None
        self.layout: list[bool] = []
        self.constants: list[Any] = []
        self.loss_pos = 0  # the loss among the step's tensor outputs
        self.no_grad_outputs: set[int] = set()  # outputs C computed without grad (detached)
        self.frozen = _without_gradient(body)  # F pieces that carry no gradient (detached)
        self.generators = generators_of(body)  # the model's own, replayed with torch's
        self.replayed: torch.Tensor | None = None  # phase 3 recomputed phase 1's frontier
        # on ranks, the error of a call this rank refuses (StepChannels.refused): it joins
        # the step's collectives as a rank whose phase 1 failed, so every rank stops
        self.refused: BaseException | None = None
        # the loss's backward is seeded with the gradient it got last step (seeding.py)
        self.seeding, self.seed_value, self.nonfinite = seeding, None, nonfinite
        self.deferred = None  # its backwards run in its forward (the fused step's may wait)

    # ------------------------------------------------------------ helpers
    def _join(self, results: list[tuple[Any, ...]], failure: BaseException | None = None
              ) -> tuple[list[Any], list[int]]:
        """F over microbatches (and ranks): each value, and where this rank's rows start.
        On ranks whose shapes may differ, they are exchanged first (``RankGather.agree``):
        a failure on any rank, or shapes that make no whole batch, raise on every rank."""
        local = [ops.accumulate_cat(results, i, dim) if kind == "cat" and results else
                 ops.accumulate_sum(results, i, self.systems) if results else None
                 for i, (kind, dim) in enumerate(self.outputs)]
        rows: list[list[int] | None] = [None] * len(local)
        if self.exchanges:
            assert self.gather is not None
            rows = self.gather.agree(
                None if failure is not None else [tuple(v.shape) if isinstance(
                    v, torch.Tensor) else () for v in local], self._ndims(),
                [dim if kind == "cat" else None for kind, dim in self.outputs],
                self._names(), failure, runtime.read_host, self._device(), self._returned())
        joined: list[Any] = []
        offsets: list[int] = []
        for i, (kind, dim) in enumerate(self.outputs):
            offset = 0
            if kind == "cat" and self.gather is not None:
                local[i], offset = self.gather.gather(local[i], dim, rows[i])
            joined.append(local[i])
            offsets.append(offset)
        sums = [i for i, (kind, _) in enumerate(self.outputs) if kind == "sum"]
        for i, total in zip(sums, self.sums(*(joined[i] for i in sums))):
            joined[i] = total
        return joined, offsets

    def _ndims(self) -> list[int]:
        """Each body output's number of dims, from the frontier template (0: a number)."""
        if self.template is None:
            return [0] * len(self.outputs)
        return [len(o[0]) if isinstance(o, tuple) else 0 for o in self.template[0]]

    def _device(self) -> Any:
        first = self.template[0] if self.template else ()
        return next((o[2] for o in first if isinstance(o, tuple)), "cpu")

    def _names(self) -> list[str]:
        return [n.name for n in self.coupled.graph.nodes if n.op == "placeholder"]

    def _returned(self) -> list[bool]:
        """Per joined value: whether C only returns it (its placeholder feeds the output)."""
        return [all(u.op == "output" for u in n.users)
                for n in self.coupled.graph.nodes if n.op == "placeholder"]

    def _coupled(self, inputs: Sequence[Any]) -> tuple[Any, ...]:
        try:
            return as_tuple(self.coupled(*inputs, *self.free))
        except MicrobatchError:
            raise
        except Exception as exc:
            raise MicrobatchError(
                f"the coupled part of the two-phase step (run once on the whole batch) "
                f"failed: {type(exc).__name__}: {exc}\n  the step was rolled back: parameters "
                "and gradients are as they were before the call (the original error is the "
                "__cause__ of this one)") from exc

    def _per_microbatch(self, states: list[RngStates] | None = None, what: str = "forward"
                        ) -> tuple[list[tuple[Any, ...]], Exception | None]:
        """P on every microbatch (keeping each one's RNG state in ``states``), and the
        failure, if any. On ranks F is gathered next, and every rank must issue the same
        collectives: a failing rank goes on with zeros shaped like its F and reports the
        failure in the step's one status all-reduce (the others run on, then stop), or,
        where the ranks exchange their shapes first, reports it there (no zeros)."""
        results: list[tuple[Any, ...]] = []
        try:
            if self.refused is not None:  # this rank's call fits no split (runs no microbatch)
                raise self.refused
            for i, mb in enumerate(self.microbatches):
                if states is not None:
                    states.append(RngStates(mb, self.generators))
                results.append(self.loop._in_microbatch(
                    i, lambda mb=mb: as_tuple(self.body(*mb)), what))
        except Exception as exc:
            if self.gather is None:
                raise
            return ([] if self.exchanges else _stand_ins(self.template)), exc
        return results, None

    # -------------------------------------------------------------- phases
    def run(self) -> tuple[Any, ...]:
        """The reference meaning, with grad as the caller has it (nothing fused). On ranks a
        failing rank still joins the gather (with zeros) and the status all-reduce."""
        results, failure = self._per_microbatch()
        if self.gather is None:
            return self._coupled(self._join(results)[0])
        try:
            joined, _ = self._join(results, failure)
            if failure is not None:
                raise failure
            outs = self._coupled(joined)
        except Exception as exc:
            if not getattr(exc, "_mbcompile_status_sent", False):
                _agreed_status(exc)  # raises here, and an error on every other rank
            raise
        _agreed_status(None)
        return outs

    def run_fused(self, params: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        with grads_aside(params), hooks_aside(params):  # (those fire in loss.backward())
            outs, loss = self._three_phases(params)
        self._check(loss)
        return outs

    def _three_phases(self, params: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], Any]:
        # 1. P per microbatch, no grad: F's pieces, and the RNG state each started from
        states: list[RngStates] = []
        # what phase 1 updates in place, for a step the ranks stop after it (RankGather.agree)
        running = RunningStatistics(self.body) if self.exchanges else None
        with torch.no_grad():
            results, failure = self._per_microbatch(states, _PHASES[0])
        pieces = [[r[i].shape[dim] if kind == "cat" else 0 for r in results]
                  for i, (kind, dim) in enumerate(self.outputs)]
        prints = [[fingerprint(r[i]) for i, (kind, _) in enumerate(self.outputs)
                   if kind == "cat" and _differentiable(r[i])] for r in results]
        try:
            joined, offsets = self._join(results, failure)
        except BaseException:  # refused on every rank (or failed): as before the step
            if states:
                states[0].restore()
            if running is not None:
                running.restore()
            raise
        del results
        if failure is not None:
            raise failure
        # 2. C once, with grad, on the joined F: the loss, C's gradients and dL/dF
        leaves = [j.detach().requires_grad_() if _differentiable(j) and i not in self.frozen
                  else j for i, j in enumerate(joined)]
        with torch.enable_grad():
            outs = self._coupled(leaves)
            loss = outs[self.loss_index]
            if self.seeding is not None:
                self.seed_value = self.seeding.seed(loss, None, ())
            try:
                loss.backward(self.seed_value)
            except Exception as exc:
                raise MicrobatchError(
                    f"the backward of the two-phase step's coupled part failed: "
                    f"{type(exc).__name__}: {exc}\n  the step was rolled back") from exc
        if not self.keep_coupled_grads:  # C's own gradients are added once, by one rank;
            for p in params:  # zeros, not None: every rank all-reduces the same buckets
                if p.grad is not None:
                    p.grad.zero_()
        grads = [leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
                 for leaf in leaves]
        del leaves, joined
        after = RngStates(self.microbatches[0], self.generators)
        statistics = RunningStatistics(self.body)  # updated in phase 1, once per microbatch
        same: list[torch.Tensor] = []
        # 3. P again per microbatch, with grad, from the same RNG state; backpropagate its
        # slice of dL/dF (a partial sum's gradient is the total's, the same for every piece)
        starts = [[offsets[i] + sum(p[:m]) for m in range(len(p))] for i, p in enumerate(pieces)]
        cats = [i for i, (kind, _) in enumerate(self.outputs) if kind == "cat"]
        try:
            for m, mb in enumerate(self.microbatches):
                states[m].restore()
                with torch.enable_grad():
                    again = self.loop._in_microbatch(
                        m, lambda mb=mb: as_tuple(self.body(*mb)), _PHASES[1])
                    # randomness phase 3 did not replay (a generator not found) shows here
                    same.extend(same_values(fingerprint(again[i]), before) for i, before
                                in zip((i for i in cats if _differentiable(again[i])), prints[m]))
                    pairs = [(again[i], grads[i] if kind == "sum"
                              else grads[i].narrow(dim, starts[i][m], pieces[i][m]))
                             for i, (kind, dim) in enumerate(self.outputs)
                             if grads[i] is not None and isinstance(again[i], torch.Tensor)
                             and again[i].requires_grad]
                    if pairs:
                        self.loop._in_microbatch(
                            m, lambda pairs=pairs: torch.autograd.backward(*zip(*pairs)),
                            _PHASES[2])
                del again, pairs
        finally:
            statistics.restore()
        after.restore()  # the RNG as after one forward of each part
        self.replayed = torch.stack(same).all() if same else None
        self.step_grads = [p.grad for p in params]
        self.no_grad_outputs = {i for i, o in enumerate(outs)
                                if isinstance(o, torch.Tensor) and not o.requires_grad}
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs), loss

    def reduce(self, grads: list[torch.Tensor | None]) -> None:
        """The step's gradients summed over ranks (in one process: as they are)."""
        if self.gather is not None:
            from mbcompile.execution.distributed import all_reduce_gradients

            all_reduce_gradients(grads)

    def _check(self, loss: torch.Tensor) -> None:
        """The step's one device read: the loss is finite (on ranks: every rank's is)."""
        finite = torch.isfinite(loss.detach()).all()
        replayed = finite if self.replayed is None else self.replayed.to(finite.device)
        if self.nonfinite == "return":  # a non-finite loss is returned, as eager returns it
            finite = torch.ones_like(finite)
            replayed = replayed if self.replayed is not None else finite
        checks = torch.stack([finite, replayed]).double()
        if self.gather is None:
            values = read_host(checks)
        else:
            values = _agreed_status(None, checks, ~(finite & replayed))
        ok = values is not None and values[0] == 1.0
        if ok and values[1] != 1.0:
            self.step_grads = None
            raise MicrobatchError(
                "the two-phase step's per-sample part computed other values in phase 3 than "
                "in phase 1, so its gradients would belong to other values than the loss: "
                "randomness that mbcompile does not replay (torch's generators and the "
                "model's own torch.Generator attributes are replayed; a generator kept "
                "elsewhere, such as a global or a closure, is not). Fix: keep the generator "
                "as an attribute of the module that draws from it, or draw the noise outside "
                "the model and pass it in; the step was rolled back")
        if not ok:
            self.step_grads = None
            raise MicrobatchError(
                f"the loss of the two-phase step is {float(loss.detach())} (not finite); the "
                "step was rolled back: parameters and gradients are as they were before the call")


def frontier_template(body: fx.GraphModule, values: Sequence[Any],
                      in_dims: Sequence[int | None], sizes: Sequence[int]) -> list[tuple[Any, ...]]:
    """Each microbatch's body outputs as ``(shape, dtype, device)`` (numbers as they are),
    from a run on fake tensors at compile time, before any hook of the user's can fail."""
    probe = FakeProbe(body)
    template = []
    for m in sizes:
        with torch.no_grad():
            outs = as_tuple(probe.run(*probe.inputs(values, in_dims, m)))
        template.append(tuple((tuple(o.shape), o.dtype, o.device) if isinstance(o, torch.Tensor)
                              else o for o in outs))
    return template


def _stand_ins(template: Sequence[tuple[Any, ...]] | None) -> list[tuple[Any, ...]]:
    """Zeros shaped like each microbatch's body outputs, for a rank whose phase 1 failed to
    join the frontier's collectives with (``frontier_template``, in the ``StepConfig``)."""
    if template is None:
        raise InputError("this two-phase module has no frontier template; compile it with "
                         "backend='torch.distributed'")
    return [tuple(torch.zeros(o[0], dtype=o[1], device=o[2]) if isinstance(o, tuple)
                  else type(o)(0) if isinstance(o, (int, float)) else o for o in outs)
            for outs in template]


def _without_gradient(body: fx.GraphModule) -> frozenset[int]:
    """The body outputs (F's pieces) that depend on no parameter through anything
    differentiable (``detach``, a no-grad region): C reads them as constants, so what C
    returns of them comes back detached, as in eager."""
    out = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    return frozenset(i for i, v in enumerate(values)
                     if isinstance(v, fx.Node) and v.meta.get(PARAMS) is False)


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


class _TwoPhaseStep(torch.autograd.Function):
    """Forward runs the three phases; backward hands over the step's gradients."""

    @staticmethod
    def forward(ctx: Any, step: _Step, n_params: int, *params: Any) -> Any:
        if step.gather is None:
            outs = step.run_fused(params)
        else:
            outs = _agreed(step, params)
        ctx.step, ctx.n_params = step, n_params
        ctx.set_materialize_grads(False)
        step.layout = [isinstance(o, torch.Tensor) for o in outs]
        step.constants = list(outs)  # for the caller, who drops them (no reference cycle)
        flat = [o for o in outs if isinstance(o, torch.Tensor)]
        loss = outs[step.loss_index]
        step.loss_pos = next(i for i, o in enumerate(flat) if o is loss)
        # marked: what cannot carry a gradient, and what eager returns detached (computed
        # under no_grad, or .detach()-ed); a gradient sent into any other output reaches
        # backward, which refuses it (marking it would drop it silently)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if isinstance(o, torch.Tensor)
                                      and (not _differentiable(o) or i in step.no_grad_outputs)))
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        step: _Step = ctx.step
        return hand_over(step, grads, [step.loss_pos], ctx.n_params, step.reduce)


def _agreed_status(error: BaseException | None, checks: torch.Tensor | None = None,
                   failed: torch.Tensor | None = None) -> list[float] | None:
    """The ranks' status all-reduce; what it raises is marked, so it is not sent twice."""
    from mbcompile.execution.distributed import step_status

    try:
        return step_status(error, checks, failed, read=runtime.read_host)  # counted by tests
    except BaseException as exc:
        mark_sent(exc)
        raise


def _agreed(step: _Step, params: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """On ranks: a rank that fails stops every rank; the status is all-reduced once, at the
    end of the step (a rank that failed in phase 1 still joins the gather first)."""
    try:
        return step.run_fused(params)
    except Exception as exc:
        if not getattr(exc, "_mbcompile_status_sent", False):
            _agreed_status(exc)
        raise


def make_two_phase(channels: StepChannels, gather: RankGather | None = None,
                   sums: Callable[..., tuple[Any, ...]] = ops.all_reduce_sums,
                   keep_coupled_grads: bool = True) -> Callable[..., Any]:
    """The step a backend binds for ``passes.ops.two_phase_step``.

    One process: ``gather`` None. On ranks: ``gather`` joins F over ranks, ``sums``
    all-reduces the partial sums, and ``keep_coupled_grads`` is True on one rank
    only, so the all-reduce of the gradients counts C's own gradients once.
    """
    def two_phase_step(body: fx.GraphModule, coupled: fx.GraphModule,
                       microbatches: list[tuple[Any, ...]], *free: Any,
                       outputs: Sequence[tuple[str, int]], loss_index: int | None,
                       systems: Sequence[int], sizes: Sequence[int] = ()) -> tuple[Any, ...]:
        if channels.noise is not None:
            raise InputError("measure_noise_scale does not support a two-phase step (a loss "
                             "that couples samples) yet; compile without it")
        config = channels.config
        step = _Step(body, coupled, microbatches, free, outputs, loss_index, systems, sizes,
                     gather, sums, keep_coupled_grads, config.frontier_template, config.seed,
                     config.nonfinite)
        step.refused = take_refused(channels)
        params = list(dict.fromkeys(
            p for m in (body, coupled) for p in m.parameters() if p.requires_grad))
        if not params or not torch.is_grad_enabled() or loss_index is None:
            return step.run()
        if any(isinstance(t, torch.Tensor) and t.requires_grad
               for mb in microbatches[:1] for t in mb) or any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in free):
            if gather is not None:
                raise InputError("training on torch.distributed needs inputs that do not "
                                 "require grad")
            return step.run()
        outer_calls_refused()  # inside torch.func, a checkpoint, a forward-AD level: named
        flat = iter(_TwoPhaseStep.apply(step, len(params), *params))
        outs = tuple(next(flat) if is_t else c for is_t, c in zip(step.layout, step.constants))
        step.constants = []  # the step is kept by autograd until backward: not the outputs
        return outs

    two_phase_step.__module__ = __name__
    return two_phase_step
