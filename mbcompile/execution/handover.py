"""The backward of a training step: the step's gradients handed to ``loss.backward()``.

The fused step (``FusedStep`` below, over ``runtime._Loop``) and the two-phase step
(``two_phase._TwoPhaseStep``) build the step's gradient inside the call, in ``.grad``
slots set aside from the user's, with every backward seeded by a guess of the
gradient their loss will receive (``seeding.py``). Their backward is one function::

    loss.backward()  ->  hand_over(...)  ->  grads * factor  ->  AccumulateGrad into .grad
                                             (factor: exactly 1.0 when the guess was right)

A first step in float16, with nothing to guess from, builds its gradients in the
hand-over instead, seeded with the gradient that arrived (``deferred.py``).

Post-accumulate-grad hooks (``p.register_post_accumulate_grad_hook``, an optimizer
stepping in backward) and a parameter's tensor hooks (``p.register_hook``) are set aside
while the step's own backwards run (``hooks_aside``): they fire once per step, on the
full gradient, when autograd accumulates the handed-over gradient into ``.grad``, as in
eager (on an FSDP2-sharded model too, where FSDP calls them after its reduce-scatter).

Parameters that are computed tensors (``functional_call(cm, {name: p - lr * g})``: MAML's
fast weights) are handed their gradient the same way: the step runs on leaf aliases of
them (``_on_leaves``), and the caller's backward carries it on through their graph once.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

import torch

from mbcompile.execution.noise import estimate_noise_scale
from mbcompile.passes.errors import InputError, MicrobatchError
from mbcompile.passes.hook_tables import emptied

__all__ = ["FusedStep", "grads_aside", "hand_over", "hooks_aside", "output_grads_refused"]

_GRAD_FN = attrgetter("grad_fn")


def hand_over(owner: Any, grads: Sequence[Any], loss_positions: Sequence[int], n_params: int,
              reduce: Callable[[list[torch.Tensor | None]], None],
              noise: Callable[[torch.Tensor], None] | None = None) -> tuple[Any, ...]:
    """Hand the gradients ``owner``'s forward built (``owner.step_grads``, seeded with
    ``owner.seed_value``) to the caller's ``loss.backward()``.

    ``grads`` arrive for the step's tensor outputs, ``loss_positions`` being the loss's
    partial sums among them. One policy for a gradient arriving at any other output: the
    step's backward already ran, for the loss only, so a nonzero one would be lost; it is
    refused (all checked in one device read, and only when some arrive). The gradients
    are handed over once, summed over ranks by ``reduce``, and multiplied in place by
    ``owner.seeding.factor(g, seed)``: the gradient ``g`` that arrived at the partial
    sums (the same for each: the loss is their sum, maybe scaled) over the seed their
    backwards ran with, exactly 1.0 when the seed was ``g``.
    """
    deferred = owner.deferred
    try:
        return _hand_over(owner, grads, loss_positions, n_params, reduce, noise)
    except Exception as exc:
        if deferred is not None and owner.distributed and not deferred.agreed:
            deferred.agree(exc)  # refused before its backwards: the other ranks wait there
        raise


def _hand_over(owner: Any, grads: Sequence[Any], loss_positions: Sequence[int], n_params: int,
               reduce: Callable[[list[torch.Tensor | None]], None],
               noise: Callable[[torch.Tensor], None] | None) -> tuple[Any, ...]:
    if torch.is_grad_enabled():  # grad mode is on in a backward under create_graph=True
        raise MicrobatchError(
            "a backward with create_graph=True (a gradient penalty on the step's gradients, "
            "higher-order gradients) went through a compiled module's step, whose gradients "
            "were built in forward, per microbatch, with no graph of their own: nothing was "
            "handed over (the parameters' .grad are as they were). Take the penalty inside "
            "the model's forward (torch.autograd.grad(..., create_graph=True) there runs "
            "exactly per microbatch under capture='fx': docs/limits.md), or run that step "
            "on the model itself (cm.module)")
    losses = set(loss_positions)
    extra = [g for i, g in enumerate(grads) if i not in losses and g is not None]
    if extra and bool(torch.stack([x.ne(0).any() for x in extra]).any()):
        raise MicrobatchError(
            "a gradient flows into an output of the compiled module other than its loss (a "
            "per-sample output, or a second loss next to it), but the step's backward "
            "already ran, for the loss only; compute everything you backpropagate through "
            "inside the model (add it into the loss there), or call the module under "
            "torch.no_grad() for outputs you only read")
    if owner.step_grads is None:
        raise MicrobatchError(
            "backward through a compiled module's step ran twice; each call's gradients "
            "are handed over once, at its first backward (retain_graph is not supported "
            "across its loop), and are as that left them. To backpropagate a loss twice, "
            "add the terms into one backward ((2 * loss).backward()), or call the module "
            "again for each backward")
    step, owner.step_grads = owner.step_grads, None
    if owner.deferred is None:  # (a first float16 step's are made below, then reduced)
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
    if owner.deferred is not None:  # the first float16 step: its backwards run now, with g
        step, owner.seed_value = owner.deferred.backward(g), g
        reduce(step)
    seeding = owner.seeding
    factor = g if seeding is None else seeding.factor(g, owner.seed_value)
    if noise is not None:
        noise(factor)
    # a sparse gradient (``nn.Embedding(sparse=True)``) is scaled through its values
    scaled = [s._values() if s.is_sparse else s for s in step if s is not None]
    if scaled:
        overflow = _scale(scaled, factor)
        if seeding is not None and overflow is not None:
            seeding.overflowed(overflow)
    return (None, None, *step)


def output_grads_refused(flat: Sequence[Any], loss_pos: int | None = None) -> None:
    """Refuse the backward of a step whose outputs other than its loss (``flat``, the loss
    at ``loss_pos``) ask for their gradient (``logits.retain_grad()``, a tensor hook on
    them, registered after the call): the step's backwards ran in the call, for the loss,
    so they are not on the loss's graph and would get none, where eager's get
    ``dL/dlogits``. A hook on the loss checks, before anything is handed over."""
    if loss_pos is None:  # no trained loss: a gradient into an output is refused already
        return
    loss = flat[loss_pos]
    if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
        return
    outputs = [weakref.ref(t) for i, t in enumerate(flat) if i != loss_pos and t is not loss
               and isinstance(t, torch.Tensor) and t.requires_grad]  # (the loss twice: its
    # own check's hook is not the user's)
    if not outputs:
        return

    def check(g: torch.Tensor) -> None:
        if any(t is not None and (t.retains_grad or t._backward_hooks)
               for t in (ref() for ref in outputs)):
            raise MicrobatchError(
                "an output of the compiled module other than its loss asks for its gradient "
                "(retain_grad(), or a hook registered on it), but the step's backward ran "
                "in the call, per microbatch, for the loss only: that output is not on the "
                "loss's graph and would get no gradient, where eager's gets one. Nothing was "
                "handed over (the parameters' .grad are as they were). Compute what you need "
                "from that gradient inside forward, or run that step on the model itself "
                "(cm.module)")

    loss.register_hook(check)


def _scale(grads: list[torch.Tensor], factor: torch.Tensor) -> torch.Tensor | None:
    """``grads *= factor`` in place, no second buffer, and unconditionally: testing
    ``factor == 1`` would read the device every step, and x * 1.0 is exactly x. One
    foreach call: the same products as a mul_ per parameter, without a Python dispatch
    for each. A float32 factor goes through GradScaler's own unscale kernel, the same
    products, which also says on the device whether a gradient is not finite (returned:
    the next step's guess follows a GradScaler's back-off); None where it was not asked.
    FSDP2's shards (DTensors) and plain gradients (``fully_shard(..., ignored_params=)``)
    go in one call each: a foreach call refuses the two mixed."""
    kinds: dict[type, list[torch.Tensor]] = {}
    for g in grads:
        kinds.setdefault(type(g), []).append(g)
    if len(kinds) > 1:
        found = [_scale(group, factor) for group in kinds.values()]
        return None if found[0] is None else torch.stack(
            [f.to(found[0].device) for f in found if f is not None]).amax(0)
    if factor.dtype == torch.float32 and factor.numel() == 1 and all(
            g.device == factor.device for g in grads):
        found = torch.zeros(1, dtype=torch.float32, device=factor.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, factor.reshape(1))
        return found
    torch._foreach_mul_(grads, factor)
    return None


def hooks_aside(params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    """The user's post-accumulate-grad hooks and tensor hooks of ``params``, set aside (each
    hook dict emptied in place: autograd holds the dict) and put back in their order after
    the hooks mbcompile adds meanwhile and has not removed (``OverlappedReduce``'s). Both
    kinds then fire once per step, on the full gradient, in the caller's backward, as in
    eager: a parameter's tensor hook also ran once per microbatch before, and then again on
    the step's gradient (``weight.register_hook(lambda g: g * 0.5)`` scaled by 0.25)."""
    return emptied(hooks for p in params
                   for hooks in (p._post_accumulate_grad_hooks, p._backward_hooks))


@contextlib.contextmanager
def grads_aside(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """The user's ``.grad`` of ``params`` set aside (None) while the block builds the
    step's gradient in fresh slots with autograd's own accumulation, and put back whatever
    happens (a failed step leaves them as they were)."""
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class FusedStep(torch.autograd.Function):
    """Forward runs every microbatch's forward and backward; backward hands over grads.

    Outputs are the microbatch outputs (flattened). The gradient arriving for the
    loss's partial sums is the same scalar ``g`` for every microbatch (the loss is
    their sum, maybe divided by a count), so the parameters' gradient is
    ``g * Σ_m ∂partial_m/∂θ``, which the forward already accumulated as
    ``Σ_m seed * ∂partial_m/∂θ`` (``seed``: its guess of ``g``, ``seeding.py``).
    """

    @staticmethod
    def forward(ctx: Any, loop: Any, n_params: int, *params: Any) -> Any:
        # a parameter slot holding a computed tensor (one C read a parameter)
        results = _on_leaves(loop, params) if any(map(_GRAD_FN, params)) else \
            loop.run_fused(params)
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
        loop: Any = ctx.loop
        width = sum(loop.layout[0])
        loss_pos = sum(loop.layout[0][:loop.fused_index])  # among a microbatch's tensors
        try:
            return hand_over(loop, grads, [m * width + loss_pos
                                           for m in range(len(loop.layout))],
                             ctx.n_params, lambda step: _reduce(loop, step),
                             None if loop.noise is None else lambda g: _measure_noise(loop, g))
        finally:
            if loop.step_grads is None:  # handed over (or refused for good): as eager frees
                loop.microbatches, loop.deferred = (), None  # its inputs, while loss is kept


def _on_leaves(loop: Any, params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    """The step run where some of ``params`` are computed tensors, not leaves
    (``functional_call(cm, {name: p - lr * g})``: MAML's fast weights, a hypernetwork's
    output, ``2 * p``). Each microbatch's backward would run on into the caller's graph
    that made them (a second backward through it fails; the leaves behind them get
    per-microbatch gradients in the call, unscaled by the factor). So the body's slots
    hold leaf aliases (``w.detach().requires_grad_()``, the same storage) while the step
    runs: their gradient is the step's, handed to the computed tensors in ``backward``, and
    autograd carries it through the caller's graph once, as eager's backward does; a hook
    on a computed weight fires there, once. Not with the joint graph (it names the body's
    tensors) nor a first float16 step (its backwards would run after the slots are back)."""
    if loop.sharded is not None:
        raise InputError(
            "a compiled module sharded with fully_shard was called with parameters that are "
            "computed tensors (functional_call(cm, weights) with weights made from other "
            "tensors); FSDP gathers and reduces its own parameters. Fix: call "
            "functional_call on the model itself (cm.module); nothing was changed")
    leaves = [p.detach().requires_grad_() if p.grad_fn is not None else p for p in params]
    swap = {id(p): leaf for p, leaf in zip(params, leaves) if leaf is not p}
    held = [(m._parameters, key, v) for m in loop.body.modules()
            for key, v in m._parameters.items() if id(v) in swap]
    loop.joint, loop.replayable = None, False
    for table, key, v in held:
        table[key] = swap[id(v)]
    try:
        return loop.run_fused(leaves)
    finally:
        for table, key, v in held:
            table[key] = v


def _reduce(loop: Any, step: list[torch.Tensor | None]) -> None:
    """The step's gradients summed over ranks: the all-reduce the last microbatch's backward
    started, or one bucketed all-reduce per step, never per microbatch."""
    if loop.reducer is not None:  # launched during the last microbatch's backward
        loop.reducer.wait([s for s, r in zip(step, loop.reduced or [True] * len(step)) if r])
        loop.reducer = None
    elif loop.distributed:
        from mbcompile.execution.distributed import all_reduce_gradients

        all_reduce_gradients([s for s, r in zip(step, loop.reduced or [True] * len(step))
                              if r])


def _measure_noise(loop: Any, g: torch.Tensor) -> None:
    """Add this step's microbatch and step squared norms to the noise-scale averages.

    The norms were taken of the loss's partial sums' gradients as seeded; ``g``, the
    factor from those to the loss's (``hand_over``), times ``N`` is the factor to the
    per-sample loss (``L = S / N``: ``g = 1/N`` over a seed of 1), so tr(Σ) and |G|^2
    come out in the loss's own units. ``g`` stays a device tensor:
    the noise scale reads it when somebody reads the noise scale, not in the step.
    """
    total = sum(loop.counts)
    scale = (g.detach().double() * total).square()
    loop.noise.update(estimate_noise_scale(loop.small_sq, loop.counts, loop.big_sq, total),
                      scale=scale)
