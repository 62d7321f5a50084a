"""One microbatch's forward, backward and gradient accumulation as one compiled graph.

With ``compile(..., torch_compile=...)`` the training loop (``runtime._Loop``) runs
each microbatch through ``JointStep`` instead of the body's forward then autograd's
backward. ``torch.func.grad_and_value`` over ``functional_call(body, ...)`` makes the
microbatch's loss partial and its gradient one function, and ``torch.compile`` turns
it into one graph per microbatch size: forward and backward kernels fused across
their boundary, no autograd engine run and no ``AccumulateGrad`` per parameter per
microbatch, and the step's accumulation (``acc += g``) done inside the graph::

    grads = zeros_like(params)                    # once per step
    for mb in microbatches:
        outs = step(body, params, grads, mb, seed)  # grads += seed * d partial(mb) / d params

A hand loop over ``torch.compile(model)`` cannot do this: its backward runs through
``loss.backward()``. The gradients are the same sums in the same order (0 + g_0,
then + g_1, ...; 0 + g is exactly g), so the step stays exact to rounding.

One compiled function per body (its own code object: dynamo's cache limit is per code
object), one graph per microbatch size (at most two per system); starting from zeros,
not from the first microbatch's fresh gradients, keeps it one graph per size rather
than one more for the first microbatch (a third compile, where the zeros cost one
memset per step).
Outputs come back detached; which of them the autograd path would have let a
gradient into, and which trained parameters the loss reaches at all (the others keep
``.grad`` None), is found once per set of trained parameters by running the body, and
the loss's backward, on meta tensors (``facts``).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.func import functional_call, grad_and_value
from torch.nn.modules import module as module_globals
from torch.utils import _pytree as pytree

from mbcompile.execution.sparse_grads import has_sparse_gradients
from mbcompile.execution.step_checks import StepChecks
from mbcompile.passes.generators import checkpoint_replaying, generators_of
from mbcompile.passes.ops import TensorHook, as_tuple
from mbcompile.passes.penalties import takes_gradients

__all__ = ["JointStep", "MetaFacts", "joint_step"]


def joint_step(body: fx.GraphModule, options: Mapping[str, Any]) -> JointStep | None:
    """The body's ``JointStep``, or None where torch.func cannot differentiate it as
    autograd does: a body with activation checkpointing (``recompute``) saves tensors
    through saved-tensor hooks, which ``torch.func.grad`` refuses, and a sparse embedding's
    gradient would come back dense."""
    if any(n.op == "call_function" and (n.target is torch.utils.checkpoint.checkpoint
                                        or isinstance(n.target, checkpoint_replaying))
           for n in body.graph.nodes):
        return None
    if has_sparse_gradients(body):
        return None  # sparse gradients: torch.func.grad would hand back dense ones
    if takes_gradients(body):
        return None  # a gradient penalty: torch.compile has no double backward
    return JointStep(body, options)


class JointStep:
    """``body``'s microbatch training step, compiled with ``torch.compile(**options)``.

    ``broken`` holds why the joint graph could not run (then the loop keeps the
    per-microbatch autograd path for this body).
    """

    def __init__(self, body: fx.GraphModule, options: Mapping[str, Any]) -> None:
        self.body = body
        self.broken: str | None = None
        # a body's parameters are fixed (compile builds a new body when the model's change)
        self._names = {id(p): n for n, p in body.named_parameters()}
        self._modules = tuple(body.modules())
        self._tensor_hooks = any(isinstance(n.target, TensorHook) for m in self._modules
                                 if isinstance(m, fx.GraphModule) for n in m.graph.nodes)
        self._norms = tuple(m for m in self._modules
                            if isinstance(m, torch.nn.modules.batchnorm._NormBase))
        self._step = torch.compile(_own_code(self, JointStep._step_impl), **options)
        self._facts: dict[tuple[Any, ...], MetaFacts | None] = {}
        self.generators = generators_of(body)  # the model's own the body draws from

    def names(self, params: Sequence[torch.Tensor]) -> tuple[str, ...]:
        return tuple(self._names[id(p)] for p in params)

    def needs_autograd(self) -> bool:
        """Does a module of the body need autograd's per-microbatch backward now: backward
        hooks (torch.func would not run them), or a norm layer updating its running
        statistics in place (``batch_norm="per_microbatch"``; torch.func refuses in-place
        writes to a module's buffers)?"""
        return any(m._backward_hooks or m._backward_pre_hooks for m in self._modules) or any(
            m.training and m.track_running_stats for m in self._norms)

    def _hooks_would_see_meta(self) -> bool:
        """Would the meta run call a user's hook with meta tensors: a forward hook of a
        module the body calls, a global module hook, or a tensor hook forward registers?"""
        return self._tensor_hooks or any(
            m._forward_hooks or m._forward_pre_hooks for m in self._modules) or any(
            (module_globals._global_forward_hooks, module_globals._global_forward_pre_hooks,
             module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks))

    def run(self, loop: Any, names: tuple[str, ...], facts: MetaFacts,
            params: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
        """Every microbatch of ``loop`` (a ``runtime._Loop``) through the joint graph: the
        step's gradient is built in the graph's own tensors, never in ``.grad``, so the
        user's gradients are not touched; a parameter the loss does not reach is left out,
        and its gradient stays None. Each backward is seeded as eager's (a tensor, also
        when it is 1: one graph whatever the guess)."""
        trained = [p for p, r in zip(params, facts.reached) if r]
        names = tuple(n for n, r in zip(names, facts.reached) if r)
        microbatches, index = loop.microbatches, loop.fused_index
        checks = loop.checks = StepChecks(len(microbatches), params[0].device, False)
        stand_in = torch.zeros((), dtype=facts.loss_dtype, device=params[0].device)
        seed = None
        if loop.seeding is not None:
            count = loop.seeding.global_count(microbatches, loop.systems, loop.distributed)
            if count is None and loop.count_index is not None:  # a count the shapes fix,
                count = loop.seeding.guess_count(  # read off the meta run: in float16 a seed
                    facts.numbers[loop.count_index], loop.sizes, loop.distributed)  # of 1
            seed = loop.seeding.seed(stand_in, count, microbatches[0], loop.drawn)  # overflows
        loop.seed_value = seed = torch.ones_like(stand_in) if seed is None else seed
        grads, results = None, []
        for i, mb in enumerate(microbatches):
            grads, out = self(names, trained, grads, index, mb, seed)
            checks.finite(i, out[index])  # read once, at the end of the step
            results.append(out)
        loop.no_grad_outputs = [isinstance(o, torch.Tensor) and not f
                                for o, f in zip(results[0], facts.outputs)]
        found = iter(grads)
        loop.step_grads = [next(found) if r else None for r in facts.reached]
        return results

    def __call__(self, names: tuple[str, ...], params: list[torch.Tensor],
                 grads: list[torch.Tensor] | None, fused_index: int, mb: tuple[Any, ...],
                 seed: torch.Tensor) -> tuple[list[torch.Tensor], tuple[Any, ...]]:
        """(the step's gradients so far, this microbatch's outputs); ``grads`` None: the
        first microbatch (the step's gradients start at zero), else added to in place;
        ``seed``: what the partial's backward is seeded with (``seeding.py``)."""
        if grads is None:
            grads = [torch.zeros_like(p) for p in params]
        hooks = torch._C._autograd._saved_tensors_hooks_is_enabled()
        try:
            return grads, self._step(names, params, grads, fused_index, mb, seed)
        except BaseException:
            # torch.func.grad switches saved-tensor hooks off while it runs and, failing
            # inside a compiled frame, may leave them off: autograd's checkpointing (the
            # path the loop falls back to) needs them
            if hooks and not torch._C._autograd._saved_tensors_hooks_is_enabled():
                torch._C._autograd._saved_tensors_hooks_enable()
            raise

    def _step_impl(self, names: tuple[str, ...], params: list[torch.Tensor],
                   acc: list[torch.Tensor], fused_index: int, mb: tuple[Any, ...],
                   seed: torch.Tensor) -> tuple[Any, ...]:
        others: list[tuple[int, Any]] = []  # non-tensor outputs (counts as Python ints)

        def loss(trained: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
            outs = as_tuple(functional_call(self.body, trained, mb))
            # grad's aux holds tensors only: the rest leave through ``others``
            others.extend((i, o) for i, o in enumerate(outs) if not isinstance(o, torch.Tensor))
            # seeded: (partial * seed)'s backward hands the partial ``seed`` exactly
            return outs[fused_index] * seed, [o for o in outs if isinstance(o, torch.Tensor)]

        grads, (_, tensors) = grad_and_value(loss, has_aux=True)(dict(zip(names, params)))
        torch._foreach_add_(acc, [grads[n] for n in names])
        outs = list(tensors)
        for i, o in others:
            outs.insert(i, o)
        return tuple(outs)

    def facts(self, names: tuple[str, ...], params: Sequence[torch.Tensor], fused_index: int,
              mb: tuple[Any, ...]) -> MetaFacts | None:
        """What the autograd path would give with ``params`` trained, found by one run of
        the body on meta tensors (no data, no device work), once per set of trained
        parameters; None where the body cannot run on meta tensors (data-dependent
        shapes, a read of a value), or where a user's hook would be called on them: the
        loop keeps autograd."""
        if self._hooks_would_see_meta():
            return None  # asked again each step: the hook may be removed
        key = (names, tuple(tuple(t.shape) for t in pytree.tree_leaves(mb)  # (its counts)
                            if isinstance(t, torch.Tensor)))
        if key not in self._facts:
            self._facts[key] = _meta_facts(self.body, names, params, fused_index, mb)
        return self._facts[key]


def _own_code(owner: Any, method: Any) -> Any:
    """``method`` bound to ``owner`` on a copy of its code object: dynamo keeps its graphs
    per code object, with a limit of 8 (``recompile_limit``), and every JointStep's
    graphs (per body, microbatch size and set of trained parameters) sharing one code
    object would reach it in a process with a few compiled modules, after which dynamo
    runs the step eagerly without a word."""
    code = method.__code__
    name = f"{code.co_name}_{next(_COPIES)}"
    copy = code.replace(co_name=name, co_qualname=f"JointStep.{name}")
    return types.MethodType(types.FunctionType(copy, method.__globals__, name,
                                               method.__defaults__, method.__closure__), owner)


_COPIES = itertools.count()


@dataclass(frozen=True)
class MetaFacts:
    """``outputs``: per body output, would it require grad; ``reached``: per trained
    parameter, does the loss reach it (one that it does not keeps ``.grad`` None, as in
    autograd, never a zero gradient that weight decay or momentum would act on);
    ``loss_dtype``: the loss partial's dtype (its seed's); ``numbers``: per body output, the
    Python int it is (a mean's count the shapes fix), else None."""

    outputs: tuple[bool, ...]
    reached: tuple[bool, ...]
    loss_dtype: torch.dtype = torch.float32
    numbers: tuple[int | None, ...] = ()


def _meta_facts(body: fx.GraphModule, names: tuple[str, ...], params: Sequence[torch.Tensor],
                fused_index: int, mb: tuple[Any, ...]) -> MetaFacts | None:
    def meta(t: Any) -> Any:
        return t.detach().to("meta") if isinstance(t, torch.Tensor) else t

    state = {n: meta(t) for n, t in (*body.named_parameters(), *body.named_buffers())}
    trained = [meta(p).requires_grad_() for p in params]
    state.update(zip(names, trained))
    try:
        with torch.enable_grad():
            outs = as_tuple(functional_call(body, state, pytree.tree_map(meta, mb)))
            loss = outs[fused_index]
            grads = (torch.autograd.grad(loss, trained, allow_unused=True)
                     if loss.requires_grad else (None,) * len(trained))
    except Exception:  # noqa: BLE001  (any failure: the autograd path, which needs no meta run)
        return None
    return MetaFacts(tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs),
                     tuple(g is not None for g in grads), loss.dtype,
                     tuple(o if type(o) is int else None for o in outs))
