"""The first float16 training step: its backwards wait for the real seed.

The fused step (``runtime._Loop``) runs each microbatch's backward inside the call,
seeded with a guess of the gradient ``g`` the caller sends into the loss: the previous
step's (``seeding.py``). At a module's first step nothing has been seen, and the guess
is 1. In float32 and bfloat16 a wrong power-of-two seed is rescaled exactly afterwards;
in float16 it is not: eager's backward, seeded with a GradScaler's 65536, keeps an
intermediate gradient that a backward seeded with 1 underflows (a loss of order 1e-5:
8% from eager's gradients), and eager's may overflow (a skipped step, the scale halved)
where the guessed one does not. So a first step that computes in float16 (an autocast
at the call, a float16 trained parameter or input: ``computes_in_float16``; or a body
that computes in float16 by itself, decided at lowering: ``body_in_float16``) waits::

    call:           for mb: states[mb] = RngStates(); out = body(mb)   # graph dropped
    loss.backward(): g arrives at the partial sums (handover.hand_over)
                    for mb: states[mb].restore(); body(mb).backward(g) # eager's seed

1. in the call, each microbatch's forward runs with grad as eager's does (an op may pick
   its kernel by grad mode) and its graph is dropped at once: one microbatch's
   activations are alive, and the call returns what it returns on every other step;
2. in ``loss.backward()``, when ``g`` arrives, each microbatch runs again from the RNG
   state its forward started from (``replay.RngStates``: the same dropout masks), under
   the call's autocast and with the hooks the call ran with (``live_hooks.CallHooks``:
   eager fixes a step's hooks at its forward, so one added or removed between the call
   and backward is as at the call), watched as there (``rewatched``), with running statistics
   updated once (``replay.RunningStatistics``), and its backward is seeded with ``g``
   itself: no guess, the factor is exactly 1. The forward must compute the loss the
   call returned (checked on the device, read once).

It costs one more forward per microbatch, at the first step of a run (and of a graph
compiled before any step of its module was backpropagated); every later step is guessed
from it. On ranks each rank's backwards run in its own ``loss.backward()``, which then
agrees on a status (a second forward that failed on one rank stops every rank) and
all-reduces the gradients (no overlap, that step only). Not taken, the step is guessed
as before: float32 and bfloat16, FSDP, ``torch_compile``'s joint graphs, the noise
scale, a graph that writes state back (the write would be seen by the second forward),
inside a ``saved_tensors_hooks`` context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from mbcompile.execution.handover import grads_aside, hooks_aside
from mbcompile.execution.live_hooks import CallHooks, in_step, rewatched
from mbcompile.execution.replay import RngStates, RunningStatistics, fingerprint, same_values
from mbcompile.execution.step_checks import StepChecks, read_host
from mbcompile.passes.errors import MicrobatchError
from mbcompile.passes.generators import generators_of

__all__ = ["DeferredStep", "body_in_float16", "computes_in_float16", "deferred"]

_AGAIN = ("forward again in loss.backward() (the first float16 step)",
          "backward in loss.backward() (the first float16 step)")


def computes_in_float16(params: Sequence[torch.Tensor], inputs: Sequence[Any]) -> bool:
    """Whether a step computes in float16, decided on the host at the call: an autocast to
    float16 on the parameters' device (or the CPU's), or a float16 trained parameter or
    input (what the body computes in whatever the call: ``body_in_float16``)."""
    for kind in {"cpu", params[0].device.type}:
        if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.float16:
            return True
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.float16
               for t in (*params, *inputs))


def body_in_float16(body: fx.GraphModule) -> bool:
    """Whether a microbatch body computes in float16 whatever the caller's autocast,
    decided at lowering (``seeding.step_seed``): a float16 parameter or buffer (a frozen
    ``.half()`` base layer under trainable float32 ones), a node whose recorded value is
    float16 (export records each node's: an autocast to float16 inside forward), or one
    that names float16 (``.half()``, ``.to(torch.float16)``, an autocast's arguments)."""
    if any(t.dtype == torch.float16 for t in (*body.parameters(), *body.buffers())):
        return True
    for n in body.graph.nodes:
        if n.op == "call_method" and n.target == "half":
            return True
        values = (n.meta.get("val"), n.args, n.kwargs)
        if any(v is torch.float16 or isinstance(v, torch.Tensor) and v.dtype == torch.float16
               for v in pytree.tree_leaves(values)):
            return True
    return False


def deferred(loop: Any, params: Sequence[torch.Tensor]) -> DeferredStep | None:
    """The loop's step as a ``DeferredStep`` where it is a first float16 step that can wait
    for its seed, else None (guessed, as every later step: the cheap tests first)."""
    seeding = loop.seeding
    # the same answer on every rank (nothing here reads a rank's own share but its dtypes;
    # a rank that refuses its call raises in ``forward``, the others stop at the status)
    if (seeding is None or not loop.replayable
            or loop.sharded is not None or loop.joint is not None
            or loop.noise is not None or in_step.watching is None
            or not seeding.unguessed(loop.microbatches, loop.systems)  # (a count, once)
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            or not (seeding.float16 or computes_in_float16(params, loop.microbatches[0]))):
        return None
    return DeferredStep(loop, params)


class DeferredStep:
    """One call's first float16 step: the forwards now, the backwards when ``g`` arrives."""

    def __init__(self, loop: Any, params: Sequence[torch.Tensor]) -> None:
        self.loop, self.params = loop, list(params)
        self.generators = generators_of(loop.body)  # the model's own, replayed with torch's
        self.states: list[RngStates] = []  # the RNG state each microbatch's forward began at
        self.prints: list[torch.Tensor] = []  # each microbatch's loss partial, fingerprinted
        self.autocast = _Autocast({"cpu", self.params[0].device.type})
        # the hooks the call runs with, run and watched again then (eager fixes a step's
        # hooks at its forward: one added or removed between the call and backward is not)
        self.watching, self.hooks = in_step.watching, CallHooks()
        self.agreed = False  # on ranks: the backward's status all-reduce was made (``agree``)

    def forward(self) -> list[tuple[Any, ...]]:
        """Every microbatch's forward, its graph dropped: what the call returns."""
        loop = self.loop
        checks = loop.checks = StepChecks(len(loop.microbatches), self.params[0].device, False)
        if loop.refused is not None:  # on ranks: raised here, every rank stops at the status
            raise loop.refused
        results = []
        with torch.enable_grad():
            for i, mb in enumerate(loop.microbatches):
                self.states.append(RngStates(mb, self.generators))
                out = loop._in_microbatch(i, lambda i=i: loop._call(i))
                partial = out[loop.fused_index]
                checks.finite(i, partial)  # read once, at the end of the step
                self.prints.append(fingerprint(partial))
                if i == 0:  # outputs autograd never reaches (counts) get no gradient
                    loop.no_grad_outputs = [isinstance(o, torch.Tensor) and not o.requires_grad
                                            for o in out]
                results.append(tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                     for o in out))
                del out, partial  # this microbatch's graph, before the next one's
        loop.step_grads = [None] * len(self.params)  # built in backward, handed over once
        return results

    def backward(self, g: torch.Tensor) -> list[torch.Tensor | None]:
        """The step's gradients: each microbatch again, from its forward's RNG state, its
        backward seeded with ``g`` (the gradient of its loss partial, eager's seed). The
        user's ``.grad``, the RNG and running statistics are as before it, whatever
        happens; a second forward that computes another loss raises ``MicrobatchError``."""
        loop, params = self.loop, self.params
        now = RngStates(loop.microbatches[0], self.generators)
        statistics = RunningStatistics(loop.body)  # updated by the call's forwards, once
        same = []
        try:
            with grads_aside(params), torch.enable_grad(), self.autocast(), \
                    hooks_aside(params), self.hooks(), rewatched(self.watching):
                for i in range(len(loop.microbatches)):
                    self.states[i].restore()
                    partial = loop._in_microbatch(i, lambda i=i: loop._call(i),
                                                  _AGAIN[0])[loop.fused_index]
                    same.append(same_values(fingerprint(partial), self.prints[i]))
                    loop._in_microbatch(i, lambda p=partial: p.backward(g), _AGAIN[1])
                    del partial
                grads = [p.grad for p in params]
            self._check(same)
        except Exception as exc:
            if loop.distributed:  # every rank learns it before the gradients' all-reduce
                self.agree(exc)
            raise
        finally:
            statistics.restore()
            now.restore()
            self.states = []
        if loop.distributed:
            self.agree(None)
        return grads

    def agree(self, error: BaseException | None) -> None:
        """On ranks: the status all-reduce of the backward (raises ``error`` here, and on
        every other rank where one failed), once (``agreed``)."""
        from mbcompile.execution.distributed import step_status

        self.agreed = True
        step_status(error, torch.zeros(0, device=self.params[0].device), read=read_host)

    def _check(self, same: list[torch.Tensor]) -> None:
        """The second forwards computed the losses the call returned (one device read)."""
        if same and not bool(torch.stack(same).all()):  # one read, at the first step only
            raise MicrobatchError(
                "the first float16 step runs each microbatch's forward again in "
                "loss.backward(), to seed its backward with the real gradient as eager does, "
                "and that forward computed another loss than the call: randomness mbcompile "
                "does not replay (torch's generators and the model's own torch.Generator "
                "attributes are replayed; one kept elsewhere, such as a global or a closure, "
                "is not), or an input or parameter changed in place between the call and "
                "backward. Fix: keep the generator as an attribute of the module that draws "
                "from it, or draw the noise outside the model and pass it in; nothing was "
                "handed over (the parameters' .grad are as they were)")


class _Autocast:
    """The autocast state of the call on ``kinds`` of device, to run the second forwards
    under in ``loss.backward()``, which is usually called outside the autocast region."""

    def __init__(self, kinds: set[str]) -> None:
        self.kinds = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                      for k in sorted(kinds)]
        self.cache = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.kinds:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache))
            yield
