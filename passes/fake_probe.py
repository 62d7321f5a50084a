"""Fake probe: run a graph on fake tensors with its batch resized to any size.

The one fake-tensor interpreter of mbcompile. The shape pass (``shape_prop``) runs
it at batch ``gbs`` and ``gbs + 1`` and records each node's shapes; the cost model
(``mbcompile.planning.cost``) runs it at a few microbatch sizes under its own
dispatch modes (a FLOP counter, saved-tensor hooks) and runs backward from what it
returns. Fake tensors carry shapes and dtypes, no data: a probe costs no real
compute whatever the model size.

Example, with ``x`` (6, 4, 8) batched along dim 0 and ``w`` (8,) shared::

    probe = FakeProbe(gm)
    args = probe.inputs([x, w], [0, None], batch=3)  # 1. fake x (3, 4, 8), fake w (8,)
    out = probe.run(*args)                           # 2. fake outputs at batch 3

Step 1 resizes every tensor inside a nested input (a dict, a tuple) along that
input's one batch dim and gives unbatched inputs a fake copy of the same shape.
Step 2 runs the graph node by node: parameters, buffers and tensor attributes
enter as fake copies, made once per probe and reused by every run, so an
in-place update in the graph (a BatchNorm's running statistics) never reaches
the user's tensors, and a caller can read a fake parameter's ``.grad`` after
running backward. A module that is not an ``fx.GraphModule`` runs whole, as one
``call_module``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

__all__ = ["FakeProbe", "resize_batch"]


def resize_batch(value: Any, dim: int | None, batch: int, mode: FakeTensorMode) -> Any:
    """A fake copy of ``value`` whose tensors have size ``batch`` along ``dim``.

    ``value`` may nest tensors in tuples, lists and dicts: they all share the one
    batch dim. ``dim=None`` (an unbatched input) keeps every shape. Anything that
    is not a tensor comes back as it is.

    >>> resize_batch({"x": torch.ones(6, 4), "n": 2}, 0, 3, mode)
    {'x': FakeTensor(..., size=(3, 4)), 'n': 2}
    """
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if dim is None:
            return mode.from_tensor(t)
        shape = list(t.shape)
        shape[dim] = batch
        with mode:
            return torch.zeros(shape, dtype=t.dtype, device=t.device)
    return pytree.tree_map(one, value)


class FakeProbe(fx.Interpreter):
    """Runs ``module`` on fake tensors in its own ``FakeTensorMode`` (``self.mode``).

    ``allow_non_fake_inputs`` is the mode's: True lets a real tensor that the graph
    reaches on its own (a global captured by a leaf function) take part; False
    makes it an error. Subclasses hook ``run_node`` to look at each node's value.
    """

    def __init__(self, module: nn.Module, *, allow_non_fake_inputs: bool = False) -> None:
        graph = module.graph if isinstance(module, fx.GraphModule) else fx.Graph()
        super().__init__(module, garbage_collect_values=True, graph=graph)
        self.mode = FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)
        self._fakes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (real, fake)
        # A value no node reads is dropped right after its node runs, as the
        # GraphModule's generated code does: the cost model's live-memory timeline
        # must see the same lifetimes as the real forward.
        for node in self.graph.nodes:
            if not node.users and node.op not in ("placeholder", "output"):
                self.user_to_last_uses.setdefault(node, []).append(node)

    def inputs(self, values: Sequence[Any], in_dims: Sequence[int | None], batch: int
               ) -> list[Any]:
        """Fake inputs for :meth:`run`: ``values`` resized to ``batch`` along ``in_dims``."""
        return [resize_batch(v, d, batch, self.mode) for v, d in zip(values, in_dims)]

    def fake(self, value: Any) -> Any:
        """The probe's fake copy of a real tensor (the same one every time); else ``value``."""
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            if id(value) not in self._fakes:  # the real tensor is kept: its id stays unique
                self._fakes[id(value)] = (value, self.mode.from_tensor(value))
            return self._fakes[id(value)][1]
        return value

    def state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s parameters and buffers by name, as fake copies."""
        return {k: self.fake(v) for k, v in (*module.named_parameters(),
                                             *module.named_buffers())}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run on fake ``args`` (from :meth:`inputs`); returns the fake outputs."""
        with self.mode:
            try:
                if isinstance(self.module, fx.GraphModule):
                    return super().run(*args, **kwargs)
                return self.call_module("", args, {})
            finally:
                # Interpreter keeps its environment (the output, and inputs no node
                # read) after run returns; the fake values must die with the run.
                self.env, self.args_iter = {}, iter(())

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, nn.Module):  # a submodule passed as a value (to checkpoint):
            state = self.state(value)     # called with fake parameters, as call_module is
            return lambda *args, **kwargs: torch.func.functional_call(value, state, args,
                                                                      kwargs)
        return self.fake(value)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.module.get_submodule(target)
        return torch.func.functional_call(module, self.state(module), tuple(args),
                                          dict(kwargs))
