"""Model-owned random generators: found in a graph, their states saved and replayed.

A part of the graph that runs twice for one step must draw the same numbers both
times: a two-phase step runs the per-sample part P without grad and again with grad
(``mbcompile/execution/two_phase.py``), ``recompute`` runs each checkpointed block
again in backward (``passes/recompute.py``). torch's own generators are saved and
restored by both; a ``torch.Generator`` the model owns (``torch.randn(...,
generator=self.g)``) is found here and replayed the same way.

Before (a traced forward)::

    _opaque_obj0 = self._opaque_obj0                     # the model's torch.Generator
    randn = torch.randn(size, generator=_opaque_obj0)

``generators_of(gm)`` finds ``_opaque_obj0``; ``GeneratorStates(gens)`` saved before a
microbatch's first run and ``restore()``-d before its second makes the second run
draw the same noise.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import sysconfig
import traceback
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
import torch.utils.checkpoint

from .errors import CaptureError
from .graph_walks import arg_leaves
from .sources import is_library, user_frame

__all__ = ["GeneratorStates", "checkpoint_replaying", "generators_made_refused", "generators_of",
           "seeding_refused"]


def generators_of(gm: torch.nn.Module) -> tuple[torch.Generator, ...]:
    """Every ``torch.Generator`` a graph (and the graphs and modules it calls) draws from:
    attributes its nodes read, constants in its nodes' arguments, and generators held by
    the modules it calls as single nodes (their forward draws from them)."""
    found: dict[int, torch.Generator] = {}
    for module in gm.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Generator):
                found.setdefault(id(value), value)
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                for value in arg_leaves(node):
                    if isinstance(value, torch.Generator):
                        found.setdefault(id(value), value)
    return tuple(found.values())


def generators_made_refused(gm: torch.nn.Module, known: Sequence[Any], model_name: str
                            ) -> None:
    """A generator the captured graph draws from that is not ``known`` (the model's own,
    taken before the trace, and the values of the globals and closure variables its code
    reaches) was made by forward itself (``g = torch.Generator().manual_seed(0)``): the
    graph keeps the one made at compile time and draws on from it, where eager makes a new
    one each call. Refused with a ``CaptureError``."""
    held = {id(v) for v in known}
    made = [g for g in generators_of(gm) if id(g) not in held]
    if made:
        raise CaptureError(
            f"{model_name}.forward makes a torch.Generator and draws from it; the compiled "
            "step would keep the one made at compile time and draw on from it, where eager "
            "makes a new one (and seeds it) on every call. Fix: make the generator in "
            "__init__ (self.g = torch.Generator().manual_seed(0)) and reseed it outside "
            "forward, or draw the noise once in __init__ and keep it as a buffer")


class GeneratorStates:
    """The states of some generators, taken now; ``restore()`` puts them back."""

    def __init__(self, generators: Sequence[torch.Generator]) -> None:
        self.generators = tuple(generators)
        self.states = [g.get_state() for g in self.generators]

    def restore(self) -> None:
        for g, state in zip(self.generators, self.states):
            g.set_state(state)


class checkpoint_replaying:  # noqa: N801 (an op of the graph, named like a function)
    """``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` whose recompute
    also replays the model's own ``generators`` (torch's own are replayed by checkpoint).

    A graph node calls an instance; fx prints it as ``checkpoint_replaying``.
    """

    __name__ = "checkpoint_replaying"

    def __init__(self, generators: Sequence[torch.Generator]) -> None:
        self.generators = tuple(generators)

    def __call__(self, fn: Any, *args: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                                 context_fn=self._contexts)

    def _contexts(self) -> tuple[Any, Any]:
        saved: list[GeneratorStates] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            saved.append(GeneratorStates(self.generators))  # as the block starts
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            now = GeneratorStates(self.generators)
            saved[0].restore()
            try:
                yield
            finally:
                now.restore()  # the stream goes on where the step left it

        return forward(), recompute()

    def __repr__(self) -> str:
        return f"checkpoint_replaying({len(self.generators)} generators)"


_STDLIB = sysconfig.get_paths()["stdlib"]

#: the functions that seed or replace the state of torch's own generators
_SEEDING = ("torch.manual_seed", "torch.random.manual_seed", "torch.seed", "torch.random.seed",
            "torch.set_rng_state", "torch.random.set_rng_state", "torch.random.fork_rng",
            "torch.cuda.manual_seed", "torch.cuda.manual_seed_all", "torch.cuda.set_rng_state")


@contextlib.contextmanager
def seeding_refused(model: torch.nn.Module) -> Iterator[None]:
    """While ``model``'s forward is captured: a call that seeds a generator (``torch.manual_seed``,
    ``torch.random.fork_rng``, ``self.g.manual_seed(0)``) is refused with a ``CaptureError``
    naming its line, after the capture, with every generator as it was.

    Capture runs forward once, at compile time: the seed would be set then, changing the
    caller's RNG, and never again in a step, where eager seeds on every call. Seeding
    functions are skipped while capturing (so nothing changes); a model's own generator is
    found reseeded by its state.

    >>> with seeding_refused(model):
    ...     gm = capture(model)   # forward calls torch.manual_seed(0): CaptureError
    """
    calls: list[str] = []
    owned = [v for m in model.modules() for v in vars(m).values()
             if isinstance(v, torch.Generator)]
    before = GeneratorStates(owned)
    cpu = torch.get_rng_state()

    def skipped(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if is_library(caller) or caller.startswith(_STDLIB):  # torch's or ours: let be
                return original(*args, **kwargs)
            calls.append(f"{name} at {user_frame(traceback.extract_stack()[:-1])}")
            return contextlib.nullcontext() if name.endswith("fork_rng") else None
        return call

    with contextlib.ExitStack() as stack:
        for name in _SEEDING:
            module, attr = name.rsplit(".", 1)
            original = getattr(importlib.import_module(module), attr)
            stack.enter_context(mock.patch(name, skipped(name, original)))
        try:
            yield
        finally:
            reseeded = [g for g, state in zip(owned, before.states)
                        if not torch.equal(g.get_state(), state)]
            before.restore()
            torch.set_rng_state(cpu)
    if reseeded and not calls:
        calls.append("manual_seed of a torch.Generator the model holds")
    if calls:
        raise CaptureError(
            f"{type(model).__name__}.forward seeds a random generator ({calls[0]}); capture "
            "runs forward once, at compile time, so the seed would be set once, there, while "
            "eager seeds it on every call, and the compiled steps would draw other numbers. "
            "Fix: seed outside forward (before each step, in your training loop), or pass "
            "the noise in as an input; nothing was changed")
