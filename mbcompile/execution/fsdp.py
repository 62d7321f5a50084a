"""Sharded models on torch.distributed: the microbatch loop around FSDP2's own hooks.

A model sharded with ``fully_shard`` (per block and at the root) is captured as
its own computation (``passes/capture.py``): sharded parameters are stand-ins
of the full shape, and each sharded block's call is bracketed by the markers
``fsdp_unit_enter`` / ``fsdp_unit_exit``. Here the loop's body gets FSDP back:

1. ``bind_units(body)``: every stand-in becomes a lookup of the module's current
   parameter (the unsharded one while its unit is gathered), and every marker
   runs FSDP's pre-forward (all-gather; backward hooks on the inputs) or
   post-forward (reshard; pre-backward hooks on the outputs) of its unit;
2. ``ShardedStep.call``: each microbatch runs as the root's forward, between the
   root's own FSDP hooks (lazy init, root all-gather, the final backward callback);
3. ``ShardedStep.sync(last)``: gradients are reduce-scattered only in the step's
   last backward (``set_requires_gradient_sync``), summed over ranks, not averaged
   (divide factor 1: mbcompile's gradient is the sum of partial sums over the
   global count), so a step makes one reduce-scatter round whatever the MBS; with
   the plan's ``gradient_sync="microbatch"`` in every backward instead (FSDP adds
   each round's shards into ``.grad``: gradients accumulate sharded);
4. ``ShardedStep.rounds``: FSDP all-gathers in every forward, so every rank runs
   as many forwards as the rank with the most microbatches; a rank whose share
   left a microbatch empty runs its last one again with weight 0 (its gradient
   adds exact zeros) instead of skipping it.

``ShardedStep.step`` also applies the plan's ``reshard_after_forward`` (``StepConfig``,
chosen with the MBS by the cost model) to every unit but the root for the step, and
puts the user's setting back afterwards.

The gradients FSDP reduce-scatters land in the sharded parameters' ``.grad``,
which the runtime set aside for the step, so they are never all-reduced again by
mbcompile; only the loss's partial sums are (``all_reduce_sums``).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn

from mbcompile.passes.capture import FSDP_PARAM
from mbcompile.passes.ops import fsdp_unit_enter, fsdp_unit_exit

__all__ = ["ShardedStep", "bind_units", "sharded_root", "is_sharded"]

_ROOT = "fsdp_root"  # the attribute of the bound body that holds the user's sharded model


def is_sharded(t: torch.Tensor) -> bool:
    """A parameter FSDP owns (a DTensor shard): FSDP reduces its gradient, not mbcompile."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sharded_root(body: fx.GraphModule) -> nn.Module | None:
    """The sharded model whose stand-ins ``body`` holds, or None for an unsharded body."""
    for t in (*body.parameters(), *body.buffers()):
        found = getattr(t, FSDP_PARAM, None)
        if found is not None:
            return found[0]
    return None


def current_param(root: nn.Module, name: str) -> torch.Tensor:
    """The parameter registered as ``name`` now: the gathered one inside its unit."""
    owner, _, attr = name.rpartition(".")
    return getattr(root.get_submodule(owner) if owner else root, attr)


def _unit(root: nn.Module, unit: str) -> tuple[nn.Module, Any]:
    module = root.get_submodule(unit)
    return module, module._get_fsdp_state()


def bind_units(body: fx.GraphModule, root: nn.Module, step: ShardedStep
               ) -> fx.GraphModule:
    """``body`` with FSDP at work: stand-ins read ``root``'s current parameters, markers
    call ``step.enter`` / ``step.exit`` (the units' hooks). The result holds ``root``
    itself, so its parameters (the shards) are the ones the training step
    differentiates.

    A part split off into a graph of its own (a block under activation checkpointing,
    ``passes/recompute.py``: ``checkpoint(self.submod_1, x, blocks_0_ff_weight, ...)``)
    is bound the same way, and the stand-ins it is passed are read inside it instead, at
    their first use: after its unit's all-gather in forward, and after FSDP's
    pre-backward all-gather when the checkpoint recomputes it.
    """
    return _bind(body, root, step, [None] * _arity(body))


def _arity(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "placeholder")


def _stand_in_name(gm: fx.GraphModule, node: Any) -> str | None:
    """The sharded parameter a ``get_attr`` node of ``gm`` stands in for, if any."""
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    found = getattr(operator.attrgetter(node.target)(gm), FSDP_PARAM, None)
    return None if found is None else found[1]


def _bind(gm: fx.GraphModule, root: nn.Module, step: ShardedStep,
          passed: list[str | None]) -> fx.GraphModule:
    """``gm`` bound (``bind_units``); ``passed[i]`` names the sharded parameter whose
    stand-in the caller passes as placeholder ``i``: read here instead, where first used."""
    bound_markers = {fsdp_unit_enter: step.enter, fsdp_unit_exit: step.exit}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root_node: fx.Node | None = None
    attrs: dict[str, Any] = {_ROOT: root}
    inputs = iter(passed)
    lifted: dict[fx.Node, str] = {}  # placeholders read here instead, by the parameter

    def value(a: fx.Node) -> fx.Node:
        if a in lifted and a not in env:  # the first use: read the current parameter now
            env[a] = graph.call_function(current_param, (root_node, lifted[a]))
            env[a].meta = dict(a.meta)
        return env[a]

    for node in gm.graph.nodes:
        if root_node is None and node.op != "placeholder":
            root_node = graph.get_attr(_ROOT)
        if node.op == "placeholder":
            name = next(inputs, None)
            if name is not None:
                lifted[node] = name
                continue
        elif (param := _stand_in_name(gm, node)) is not None:
            env[node] = graph.call_function(current_param, (root_node, param))
            env[node].meta = dict(node.meta)
            continue
        elif node.op == "call_function" and node.target in bound_markers:
            env[node] = graph.call_function(bound_markers[node.target],
                                            fx.node.map_arg(node.args, value))
            if node.target is fsdp_unit_enter:
                step.order.append(node.args[0])
            env[node].meta = dict(node.meta)
            continue
        elif _calls_graph(gm, node):  # a split-off part: bound, given no stand-in
            env[node] = _bind_call(gm, node, graph, value, attrs, root, step)
            continue
        env[node] = graph.node_copy(node, value)
    for node in list(graph.nodes):
        if node.target is current_param and not node.users:
            graph.erase_node(node)  # passed to a part, which now reads it itself
        elif node.op in ("get_attr", "call_module") and node.target not in attrs:
            attrs[node.target] = operator.attrgetter(node.target)(gm)
    bound = fx.GraphModule(attrs, graph, type(gm).__name__)
    bound.train(gm.training)
    return bound


def _calls_graph(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A call of a split-off graph: ``self.submod_0(...)``, or ``checkpoint(submod, ...)``
    (and the generator-replaying checkpoint) whose first argument reads one."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), fx.GraphModule)
    first = node.args[0] if node.op == "call_function" and node.args else None
    return isinstance(first, fx.Node) and first.op == "get_attr" and isinstance(
        operator.attrgetter(str(first.target))(gm), fx.GraphModule)


def _bind_call(gm: fx.GraphModule, node: fx.Node, graph: fx.Graph, value: Any,
               attrs: dict[str, Any], root: nn.Module, step: ShardedStep) -> fx.Node:
    """``node``, a call of a split-off graph, calling it bound: the stand-ins it passed
    are read inside it, so they are dropped from the call."""
    direct = node.op == "call_module"
    target = str(node.target if direct else node.args[0].target)  # type: ignore[union-attr]
    args = list(node.args if direct else node.args[1:])
    names = [_stand_in_name(gm, a) for a in args]
    part = _bind(operator.attrgetter(target)(gm), root, step, names)
    name = f"{target.replace('.', '_')}_bound"
    attrs[name] = part
    kept = tuple(value(a) if isinstance(a, fx.Node) else a
                 for a, n in zip(args, names) if n is None)
    if direct:
        call = graph.call_module(name, kept, dict(node.kwargs))
    else:
        call = graph.call_function(node.target, (graph.get_attr(name), *kept),
                                   dict(node.kwargs))
    call.meta = dict(node.meta)
    return call


def _zero_missing_grads(group: Any) -> None:
    """Zero gradients for the gathered parameters of an FSDP param group that have none,
    so its reduce-scatter sends what every other rank's does."""
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.unsharded_param
        if fsdp_param.unsharded_accumulated_grad is None and param.grad is None:
            param.grad = torch.zeros_like(param)


class ShardedStep:
    """What one training step of a sharded model does around the runtime's loop."""

    def __init__(self, body: fx.GraphModule, root: nn.Module,
                 reshard: bool | None = None, every_microbatch: bool = False,
                 varies: bool = False) -> None:
        self.root = root
        self.count: int | None = None  # forwards per step on every rank (the most on any)
        self.varies = varies  # each rank's count may change per call (its own length)
        self.order: list[str] = []  # the units in forward order (the body's markers)
        # how far the current round got, for ``drain``: units entered and not yet left
        # (with what they were given), units done, the last values a unit returned
        self.open: list[tuple[str, tuple[Any, ...]]] = []
        self.done: set[str] = set()
        self.last: tuple[Any, ...] = ()
        self.body = bind_units(body, root, self)
        # the plan's reshard_after_forward for the units (None: the setting they were sharded
        # with), handed over in the step's StepConfig
        self.reshard = reshard
        # the plan's gradient_sync: reduce-scatter in every backward, not just the last
        self.every_microbatch = every_microbatch

    def enter(self, unit: str, *values: Any) -> tuple[Any, ...]:
        """FSDP's pre-forward of ``unit`` (all-gather; post-backward hook on the inputs)."""
        module, state = _unit(self.root, unit)
        args, _ = state._pre_forward(module, values, {})
        self.open.append((unit, tuple(args)))
        return tuple(args)

    def exit(self, unit: str, *values: Any) -> tuple[Any, ...]:
        """FSDP's post-forward of ``unit`` (reshard; pre-backward hooks on the outputs)."""
        module, state = _unit(self.root, unit)
        out = tuple(state._post_forward(module, (), values))
        self.open.pop()
        self.done.add(unit)
        self.last = out
        return out

    def rounds(self, local: int) -> int:
        """Forwards this rank runs per step: the most microbatches any rank has (one max
        all-reduce). Where the lengths may vary (``StepConfig.lengths_vary``, the same on
        every rank) at every call: each rank may cut its own call by its length
        (``length_plans.py``), so the counts change from step to step, and one rank may
        run a module lowered for one split while another runs another's. Else on the first
        call only: the plan does not change."""
        if self.count is None or self.varies:
            t = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.count = int(t)
        return self.count

    def call(self, args: Sequence[Any]) -> Any:
        """One microbatch through the body, as the root's forward: its FSDP hooks around."""
        self.open, self.done, self.last = [], set(), ()
        state = self.root._get_fsdp_state()
        args, _ = state._pre_forward(self.root, tuple(args), {})
        out = self.body(*args)
        return state._post_forward(self.root, args, out)

    def drain(self, rounds: Sequence[bool], in_backward: bool = False, started: bool = True
              ) -> None:
        """This rank's round failed: issue the collectives the other ranks still issue.

        A failed forward is finished on a zero: the units left open are left, the units
        not reached are entered and left, each touching its gathered parameters (so each
        reduce-scatter has every rank's full input); then its backward. A failed backward
        (``in_backward``) is finished unit by unit (``finish_backward``). Then one such
        round for each of ``rounds`` still to come (True: the step's last); ``started``
        False: no round began (a call this rank refused), only those. Every gradient it
        adds is zero or wrong, and the step is rolled back anyway.
        """
        if started and in_backward:
            self.finish_backward()
        elif started:
            self._finish_round()
        for last in rounds:
            self.sync(last)
            self.open, self.done, self.last = [], set(), ()
            state = self.root._get_fsdp_state()
            state._pre_forward(self.root, (), {})
            self._finish_round()

    def finish_backward(self) -> None:
        """This rank's backward failed: issue the collectives its units' backward still owed.

        Unit by unit in backward order, as FSDP's own hooks would: the pre-backward of a
        unit not reached (its all-gather, the next unit's prefetch), then the
        post-backward of a unit not finished (its reduce-scatter, in the step's last
        backward), each parameter without a gradient given zeros so every rank's
        reduce-scatter has the same input; then the root's final callback, which the
        failed backward never ran. The gradients are wrong; the step is rolled back.
        """
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        for unit in reversed(self.order):
            _, state = _unit(self.root, unit)
            for group in state._fsdp_param_groups:
                if group._training_state == TrainingState.POST_BACKWARD:
                    continue
                if group._training_state != TrainingState.PRE_BACKWARD:
                    state._pre_backward(self._zero())
                _zero_missing_grads(group)
                group.post_backward()
        root = self.root._get_fsdp_state()
        for group in root._fsdp_param_groups:  # the root's reduce-scatter, in the callback
            _zero_missing_grads(group)
        root._root_post_backward_final_callback()

    def _finish_round(self) -> None:
        x = self._zero()
        for value in (*(v for _, args in self.open for v in args), *self.last):
            if isinstance(value, torch.Tensor) and value.requires_grad:
                x = x + value.sum() * 0  # reach the units already run, for their backward
        for unit, _ in reversed(self.open):  # innermost first
            (x,) = self.exit(unit, x + self._touch(unit))
        for unit in self.order:
            if unit not in self.done:
                (x,) = self.enter(unit, x)
                (x,) = self.exit(unit, x + self._touch(unit))
        state = self.root._get_fsdp_state()
        (x,) = state._post_forward(self.root, (), (x + self._touch(""),))
        x.backward()

    def _zero(self) -> torch.Tensor:
        p = next(self.root.parameters())
        return torch.zeros((), dtype=p.dtype, device=p.device, requires_grad=True)

    def _touch(self, unit: str) -> torch.Tensor:
        """Zero times every gathered parameter of ``unit``: each gets a (zero) gradient."""
        _, state = _unit(self.root, unit)
        total = self._zero()
        for group in state._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                total = total + fsdp_param.unsharded_param.sum() * 0
        return total

    @staticmethod
    def owns(param: torch.Tensor) -> bool:
        """FSDP reduces this parameter's gradient (a shard), so mbcompile must not."""
        return is_sharded(param)

    def sync(self, last: bool) -> None:
        """Reduce-scatter gradients in the coming backward if it is the step's last, or in
        every one (``gradient_sync="microbatch"``: FSDP adds each round's shards into
        ``.grad``, so they accumulate sharded)."""
        self.root.set_requires_gradient_sync(last or self.every_microbatch)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Sum gradients over ranks for the step (FSDP averages by default); restore the
        user's FSDP settings afterwards, and leave every unit resharded."""
        units = [m for m in self.root.modules() if hasattr(m, "_get_fsdp_state")]
        groups = [g for m in units for g in m._get_fsdp_state()._fsdp_param_groups]
        saved = [(g.reduce_grads, g.all_reduce_grads, g.gradient_divide_factor,
                  g.force_sum_reduction_for_comms) for g in groups]
        for g in groups:
            g.gradient_divide_factor, g.force_sum_reduction_for_comms = 1.0, True
        # the plan's reshard_after_forward, for every unit but the root (FSDP keeps the
        # root gathered from forward to backward, set at its lazy init in the first step)
        others = [m for m in units if m is not self.root] if self.reshard is not None else []
        settings = [(m._get_fsdp_state()._auto_reshard_after_forward,
                     [g.post_forward_mesh_info for g in m._get_fsdp_state()._fsdp_param_groups])
                    for m in others]
        for m in others:
            m.set_reshard_after_forward(self.reshard, recurse=False)
        try:
            yield
        except BaseException:
            self.root.reset_iter_state()  # a failed step: FSDP drops what it tracked
            raise
        finally:
            for g, (reduce, all_reduce, factor, force) in zip(groups, saved):
                g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
                g.gradient_divide_factor, g.force_sum_reduction_for_comms = factor, force
            for m, (auto, meshes) in zip(others, settings):  # the user's setting again
                state = m._get_fsdp_state()
                state._auto_reshard_after_forward = auto
                for g, mesh in zip(state._fsdp_param_groups, meshes):
                    g.post_forward_mesh_info = mesh
            for m in units:  # kept gathered after a no-grad forward (the root always)
                m.reshard()
