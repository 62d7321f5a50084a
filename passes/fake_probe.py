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

import contextlib
import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from .capture import FSDP_PARAM
from .facts import FACT, SHAPES, Batched
from .hook_sandbox import hooks_sandboxed
from .hook_tables import emptied
from .loss_shapes import needs_shape_twins, shape_twins

__all__ = ["FakeProbe", "fake_copy", "holds_no_data", "resize_batch", "shaped_like"]


def planned_device(t: torch.Tensor) -> torch.device:
    """The device ``t`` is planned on: its own, or its fake device for a fake tensor; a
    tensor on the meta device is planned on the CPU, so a model built on the meta device
    costs what the same model on the CPU does (the kernels, and so the FLOPs and bytes,
    depend on the device: CPU attention runs its flash kernel, meta its reference maths)."""
    device = t.fake_device if isinstance(t, FakeTensor) else t.device
    return torch.device("cpu") if device.type == "meta" else device


def holds_no_data(t: torch.Tensor) -> bool:
    """Whether ``t`` is shapes only: a meta tensor, or a fake tensor (of any mode)."""
    return t.is_meta or isinstance(t, FakeTensor)


def fake_copy(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """``t`` as a fake tensor of ``mode``: itself when it is one already; a copy of its
    shape, strides, dtype and ``requires_grad`` when it holds no data (a meta tensor, or a
    fake tensor of another mode: a model built under the user's own ``FakeTensorMode``,
    which ``mode`` cannot mix with); else ``mode.from_tensor``. No copy reads data.

    A sharded parameter's stand-in (``capture.stand_in``: one element, expanded) becomes
    what it stands for, the gathered parameter, contiguous: with its zero strides, ops
    that want a contiguous weight would count a copy of it that the step never makes.
    """
    if isinstance(t, FakeTensor) and t.fake_mode is mode:
        return t
    gathered = getattr(t, FSDP_PARAM, None) is not None
    if not holds_no_data(t) and not gathered:
        return mode.from_tensor(t)
    with mode:
        if gathered:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device=planned_device(t),
                               requires_grad=t.requires_grad)
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype,
                                   device=planned_device(t), requires_grad=t.requires_grad)


def shaped_like(node: fx.Node) -> torch.Tensor:
    """A meta tensor of the shape and dtype the shape pass recorded for ``node``'s value."""
    info = node.meta[SHAPES]
    return torch.empty(info.shape_a, dtype=info.dtype, device="meta")


def _as_split(node: fx.Node) -> torch.Tensor:
    """A draw made before the loop as the body is handed it: ``factor`` rows per sample
    along its batch dim as (samples, factor) there (``draws.merged_back``)."""
    fact, shaped = node.meta.get(FACT), shaped_like(node)
    if isinstance(fact, Batched) and fact.factor != 1:
        return shaped.unflatten(fact.dim, (-1, fact.factor))
    return shaped


def resize_batch(value: Any, dim: int | None, batch: int, mode: FakeTensorMode,
                 device: torch.device | None = None) -> Any:
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
        if dim is None and device is not None:
            with mode:
                return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
        if dim is None:
            return fake_copy(t, mode)
        shape = list(t.shape)
        shape[dim] = batch
        with mode:
            return torch.zeros(shape, dtype=t.dtype, device=device or planned_device(t))
    return pytree.tree_map(one, value)


_META = torch.device("meta")


def _on_planned_device(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """A node's arguments with the meta device replaced by the CPU, where ``planned_device``
    puts meta tensors: a graph captured from a model on the meta device names it in
    ``arange(..., device=meta)`` and ``x.to(meta)``."""
    def one(v: Any) -> Any:
        return torch.device("cpu") if isinstance(v, torch.device) and v == _META else v
    if "device" in kwargs and kwargs["device"] in ("meta", _META):
        kwargs = {**kwargs, "device": torch.device("cpu")}
    return tuple(one(a) for a in args), kwargs


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
        self._twins = needs_shape_twins(module)
        # A value no node reads is dropped right after its node runs, as the
        # GraphModule's generated code does: the cost model's live-memory timeline
        # must see the same lifetimes as the real forward.
        for node in self.graph.nodes:
            if not node.users and node.op not in ("placeholder", "output"):
                self.user_to_last_uses.setdefault(node, []).append(node)

    def inputs(self, values: Sequence[Any], in_dims: Sequence[int | None], batch: int
               ) -> list[Any]:
        """Fake inputs for :meth:`run`: ``values`` resized to ``batch`` along ``in_dims``;
        placeholders past them (a body's draws made before the loop, ``draws.py``) get
        fakes of their recorded shape, on the first input's device."""
        args = [resize_batch(v, d, batch, self.mode) for v, d in zip(values, in_dims)]
        extra = [n for n in self.graph.nodes if n.op == "placeholder"][len(args):]
        if extra:
            device = next((planned_device(t) for t in pytree.tree_leaves(args)
                           if isinstance(t, torch.Tensor)), torch.device("cpu"))
            args += [resize_batch(_as_split(n), n.meta[FACT].dim if isinstance(
                n.meta.get(FACT), Batched) else None, batch, self.mode, device) for n in extra]
        return args

    def share(self, other: FakeProbe) -> None:
        """Run in ``other``'s fake mode, with its fake copies (the same fake parameter for a
        parameter both read): for a graph that ``other`` ran, or one it calls."""
        self.mode, self._fakes = other.mode, other._fakes

    def fake(self, value: Any) -> Any:
        """The probe's fake copy of a tensor (the same one every time: tied weights stay
        tied), made by ``fake_copy``; anything else comes back as it is."""
        if isinstance(value, torch.Tensor) and not (isinstance(value, FakeTensor)
                                                    and value.fake_mode is self.mode):
            if id(value) not in self._fakes:  # the tensor is kept: its id stays unique
                self._fakes[id(value)] = (value, fake_copy(value, self.mode))
            return self._fakes[id(value)][1]
        return value

    def state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module``'s parameters and buffers by name, as fake copies."""
        return {k: self.fake(v) for k, v in (*module.named_parameters(),
                                             *module.named_buffers())}

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Run on fake ``args`` (from :meth:`inputs`); returns the fake outputs. Losses that
        read values on the way to a shape call their shape twins (``loss_shapes``)."""
        twins = shape_twins() if self._twins else contextlib.nullcontext()
        with self.mode, twins:
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
        if isinstance(value, fx.GraphModule):  # a block passed as a value (to checkpoint):
            return self._inner(value)            # run node by node, as this graph is
        if isinstance(value, nn.Module):  # called with fake parameters, as call_module is
            state = self.state(value)
            return lambda *args, **kwargs: torch.func.functional_call(value, state, args,
                                                                      kwargs)
        return self.fake(value)

    def _inner(self, gm: fx.GraphModule) -> Any:
        """``gm`` as a function run by a plain fake probe sharing this one's mode and fake
        copies: its nodes get the same treatment (meta devices planned on the CPU)."""
        inner = FakeProbe(gm)
        inner.share(self)
        inner.extra_traceback = False

        def run(*args: Any) -> Any:
            try:
                return fx.Interpreter.run(inner, *args)
            finally:
                inner.env, inner.args_iter = {}, iter(())
        return run

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, *_on_planned_device(args, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, *_on_planned_device(args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.module.get_submodule(target)
        if target and isinstance(module, fx.GraphModule) and not kwargs:  # a split's part
            return self._inner(module)(*args)
        if _cumulative_batch_norm(module):  # its factor 1 / num_batches_tracked is a read:
            module = copy.copy(module)       # any momentum gives the same shapes
            module.momentum = 0.0
        # a layer's hooks on made-up data: they change nothing; its backward hooks are not
        # attached at all (they would run after the block, on fake gradients, unwatched)
        with hooks_sandboxed(module), emptied((module._backward_pre_hooks,
                                               module._backward_hooks)):
            return torch.func.functional_call(module, self.state(module), tuple(args),
                                              dict(kwargs))


def _cumulative_batch_norm(module: nn.Module) -> bool:
    """A BatchNorm in training with ``momentum=None`` (a cumulative average)."""
    return (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None
            and module.training and module.track_running_stats)
