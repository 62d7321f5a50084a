"""Capture pass: a model becomes an ``fx.GraphModule`` with flat outputs.

Before::

    class Net(nn.Module):
        def forward(self, x, y): return {"loss": F.mse_loss(self.l(x), y), "out": self.l(x)}

After (``capture(net, ...)``)::

    def forward(self, x, y):
        ...
        return (mse_loss, l_1)          # flat leaves; CaptureResult.output_spec rebuilds the dict

Outputs are flattened (tuples, lists, dicts, dataclasses, ``ModelOutput``-like
objects) so that later passes see one fact per output leaf; ``OutputSpec`` puts
the structure back after the call (``output_spec.py``). An ``fx.GraphModule`` is
taken as it is. The tracer is ``fx_tracer.py``'s; the Python state forward touches is
put back after the trace (``python_state.py``), what it wrote becomes side effects
replayed per step, their traced values extra outputs after the model's own
(``side_effects.py``), and what it read becomes guards (``guards.py``).

A model sharded with FSDP2 (``fully_shard``) is captured as its own computation:
FSDP's forward hooks are set aside while tracing, every module is traced into
(``nn.Linear`` becomes ``F.linear`` on its weight), each sharded parameter is
replaced in the graph by a stand-in of its full shape that holds one element
(``FSDP_PARAM`` names the real one), and each call of a sharded submodule is
bracketed by ``fsdp_unit_enter`` / ``fsdp_unit_exit``, identities here, where
the torch.distributed backend runs FSDP's all-gather and reshard at run time::

    enter = fsdp_unit_enter('blocks.0', x)     # pre-forward: all-gather blocks.0
    linear = torch._C._nn.linear(enter[0], blocks_0_ff_weight, blocks_0_ff_bias)
    exit_ = fsdp_unit_exit('blocks.0', linear) # post-forward: reshard, hook backward
"""

from __future__ import annotations

import contextlib
import operator
import traceback
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .autocast_regions import Region, autocast_entered
from .code_reach import reached_code
from .custom_functions import refused_in_fx
from .errors import CaptureError
from .forward_modes import autocast_nodes
from .fx_instance_checks import tensor_checks_answered, tensor_checks_refused
from .fx_refusals import layer_settings_refused
from .fx_tracer import FlatOutputTracer, StateAsProxies, hooks_see_every_use, user_stack
from .fx_writes import writes_as_values
from .generators import generators_made_refused, generators_of
from .graph_code import graph_module
from .guards import (
    Guard,
    NumberInput,
    inputs_wanted,
    numbers_as_inputs,
    read_number,
    recorded_reads,
    unrecorded,
    unwritten,
)
from .output_spec import OutputSpec, flatten_output
from .python_state import Change, python_state_kept
from .side_effects import (
    NO_EFFECTS,
    Effects,
    SetAttr,
    prints_recorded,
    record_effects,
    rewiring_refused,
)
from .slot_guards import slot_guards
from .sources import source_line, user_frame

__all__ = ["FSDP_PARAM", "CaptureResult", "OutputSpec", "capture", "fsdp_modules",
           "effects_as_outputs", "fsdp_view", "gathered_dtypes", "stand_in"]

@dataclass(frozen=True)
class CaptureResult:
    """A captured model: the graph (flat outputs), its output spec, the specialised args."""

    graph_module: fx.GraphModule
    output_spec: OutputSpec
    concrete_args: Mapping[str, Any]
    method: str = "symbolic_trace"
    guards: tuple[Guard, ...] = ()  # the plain attributes forward read (passes/guards.py)
    effects: Effects = NO_EFFECTS  # what forward writes into Python objects, replayed per step
    #: where forward enters autocast regions of its own (``autocast_regions.py``)
    autocast_regions: tuple[Region, ...] = ()


# --------------------------------------------------------------------------- FSDP2

FSDP_PARAM = "_mbcompile_fsdp_param"


def fsdp_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every module sharded with FSDP2's ``fully_shard``
    (the root first, named ""); empty for a model that is not sharded."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if units and units[0][1] is not model:
        raise CaptureError(
            f"{type(model).__name__} has submodules sharded with fully_shard "
            f"({units[0][0]!r}, ...) but is not sharded itself; FSDP2 needs the root sharded "
            "too (its forward drives the all-gathers). Fix: call fully_shard(model) after "
            "sharding the blocks")
    for n, m in units:
        if len(m._get_fsdp_state()._modules) > 1:
            raise CaptureError(
                f"{n or type(model).__name__!r} is sharded together with other modules "
                "(fully_shard([a, b, ...])), which mbcompile does not run yet. Fix: shard "
                "each module on its own")
    return units


@contextlib.contextmanager
def fsdp_view(model: torch.nn.Module, units: list[tuple[str, torch.nn.Module]]
               ) -> Iterator[None]:
    """Trace a sharded model's own computation: FSDP's forward hooks (all-gather, reshard)
    are set aside for the block and every unit holds its shards (no communication)."""
    if not units:
        yield
        return
    saved = []
    for _, m in units:
        m.reshard()  # an unsharded unit (the root after an eval forward) frees its gather
        state = m._get_fsdp_state()
        ids = (state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id)
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            saved.append((hooks, dict(hooks)))
            for i in ids:
                hooks.pop(i, None)
    try:
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)


def _with_stand_ins(model: torch.nn.Module, graph: fx.Graph,
                    units: Sequence[tuple[str, torch.nn.Module]]) -> dict[str, Any]:
    """The graph's attributes, each sharded parameter replaced by a stand-in: a parameter
    of the full shape that holds one element (an expanded zero), naming the real one."""
    from torch.distributed.tensor import DTensor

    dtypes = gathered_dtypes(units)
    attrs: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        value = operator.attrgetter(node.target)(model)
        attrs[node.target] = stand_in(value, model, node.target, dtypes.get(id(value))) \
            if isinstance(value, DTensor) else value
    return attrs


def gathered_dtypes(units: Sequence[tuple[str, torch.nn.Module]]) -> dict[int, torch.dtype]:
    """``id`` of each sharded floating parameter whose unit's ``MixedPrecisionPolicy``
    gathers it in another dtype -> that dtype (what forward computes with)."""
    dtypes: dict[int, torch.dtype] = {}
    for _, module in units:
        for group in module._get_fsdp_state()._fsdp_param_groups:
            wanted = group.mp_policy.param_dtype
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                if wanted is not None and param.dtype.is_floating_point:
                    dtypes[id(param)] = wanted
    return dtypes


def stand_in(param: torch.Tensor, model: torch.nn.Module, name: str,
             dtype: torch.dtype | None = None) -> torch.nn.Parameter:
    """A parameter of ``param``'s full shape that holds one element (an expanded zero),
    naming the sharded one: ``model``'s parameter ``name``; in ``dtype``, the one FSDP
    gathers it in, when that is another (mixed precision)."""
    zero = torch.zeros((), dtype=dtype or param.dtype, device=param.device)
    value = torch.nn.Parameter(zero.expand(param.shape), requires_grad=param.requires_grad)
    setattr(value, FSDP_PARAM, (model, name))
    return value


def capture(model: torch.nn.Module, concrete_args: Mapping[str, Any] | None = None
            ) -> CaptureResult:
    """Trace ``model`` with ``torch.fx`` into a graph whose outputs are flat leaves.

    ``concrete_args`` fixes non-tensor arguments (fx inserts a check that later
    calls pass the same value). A tracing failure raises ``CaptureError`` naming
    the user's source line and the ways out.
    """
    concrete_args = dict(concrete_args or {})
    if isinstance(model, fx.GraphModule):
        gm = model
        leaves: list[Any] = []
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        spec = flatten_output(out.args[0], leaves, lambda v: isinstance(v, fx.Node))
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in gm.graph.nodes:
            if node.op == "output":
                graph.output(tuple(env[n] for n in leaves))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        writes_as_values(graph, gm)
        return CaptureResult(fx.GraphModule(gm, graph), spec, concrete_args, "graph_module")
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(
            f"mbcompile.compile expects a torch.nn.Module, got {type(model).__name__}. "
            "Wrap a function in an nn.Module whose forward calls it.")
    wanted = inputs_wanted()
    if wanted:  # numbers that change on every call, as graph inputs (guards.py)
        try:
            return _traced(model, concrete_args, wanted)
        except CaptureError:  # Python control flow on one of them: keep guarding it
            pass
    return _traced(model, concrete_args, frozenset())


def _traced(model: torch.nn.Module, concrete_args: dict[str, Any],
            wanted: frozenset[tuple[int, Any]]) -> CaptureResult:
    """``capture``'s trace of a module; ``wanted``: the numbers read as graph inputs."""
    name = type(model).__name__
    units = fsdp_modules(model)
    with fsdp_view(model, units):
        own = vars(model).get("forward")
        if own is not None and not (getattr(own, "__func__", None) is type(model).forward
                                    and getattr(own, "__self__", None) is model):
            # fx traces type(model).forward, eager calls this (a rebinding of the class's
            # own, as accelerate's prepare leaves, is the same code)
            raise CaptureError(
                f"{name}.forward was replaced on the instance (model.forward = ...); "
                "torch.fx traces the class's forward, not the one eager calls. Fix: compile "
                "with capture='auto' or capture='export', or compile a Module whose forward "
                "calls the replacement")
        root_hooks = [k for k in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                                  "_backward_pre_hooks") if getattr(model, k, None)]
        if root_hooks:
            raise CaptureError(
                f"{name} has hooks on the model itself ({', '.join(root_hooks)}); "
                "torch.fx traces forward directly, so they would never run in the compiled "
                "module. Fix: move their work into forward, register them on a submodule, or "
                "compile a wrapper Module whose forward calls the model (hooks of submodules "
                "are traced)")
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        before = set(model.__dict__)  # what fx stores on the root for constants is not
        versions = {n: t._version for n, t in state.items()}
        owned = generators_of(model)  # before fx stores a generator forward made on it
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        tracer = FlatOutputTracer({id(m): m for n, m in units if n} if units else None,
                                   name)
        try:
            # a training forward is traced: no-grad regions are forward's own, not the caller's
            numbers: dict[str, NumberInput] = {}
            tensor_checks_refused(model, name)  # isinstance(h, torch.Tensor): eager's answer
            with python_state_kept(model, concrete_args) as snapshot, prints_recorded() as \
                    prints, numbers_as_inputs(wanted), recorded_reads(
                        model, name, lambda h: _number_input(tracer, numbers, h)) as guards, \
                    refused_in_fx(name), torch.enable_grad(), \
                    StateAsProxies(tracer, model, sharded=bool(units)), \
                    reached_code(model, snapshot.add_slot, name,
                                 lambda m: tracer.is_leaf_module(m, ""), concrete_args) as reach, \
                    autocast_entered() as regions:
                with tensor_checks_answered():
                    graph = tracer.trace(model, concrete_args=concrete_args or None)
                # now, while the constants fx stored on the root (_tensor_constant0, a
                # generator's _opaque_obj0) are there to copy; the model is then restored
                with unrecorded():  # it copies the root's training flag: not forward's read
                    gm = graph_module(_with_stand_ins(model, graph, units) if units
                                      else tracer.root, graph, name)
                generators_made_refused(gm, [*owned, *(s.owner.get(s.key) for s in reach.slots)],
                                        name)
                for attr in [*numbers, *_stashed_constants(tracer, model, before)]:
                    del model.__dict__[attr]
                rebound, rewired = snapshot.rebound_slots(), snapshot.rewired()
                layer_settings_refused(snapshot.changes(), name)
                effects = effects_as_outputs(graph, snapshot.changes(), prints, name)
                tracer.dtype_reads_refused()  # (a printed dtype is an output by now)
        except CaptureError:
            raise
        except Exception as exc:  # any tracing failure becomes one clear error
            where = user_frame(traceback.extract_tb(exc.__traceback__))
            layers = ", ".join(repr(n) for n in dict.fromkeys(tracer.traced_no_grad))
            inside = (f"  torch.fx traced into the torch layers {layers}: they are called "
                      "inside a no-grad region of forward with parameters that require grad, "
                      "and their own code may branch on their input (BatchNorm checks its "
                      "dims). Fix: freeze them (requires_grad_(False): they are then kept "
                      "whole), or compile with capture='auto'.\n") if layers else ""
            raise CaptureError(
                f"torch.fx could not trace {type(model).__name__}.forward at {where}\n"
                f"  {type(exc).__name__}: {exc}\n{inside}"
                "  fx tracing runs forward with symbolic values, so Python control flow on "
                "tensor values or data-dependent shapes cannot be captured. Fix: move the "
                "data-dependent part into a leaf module or function, make the branch depend "
                "on a non-tensor argument (it is then fixed at compile time), or pass an "
                "already captured torch.fx.GraphModule.") from exc
    changed = [n for n, t in state.items() if t._version != versions[n]]
    if changed:  # forward updated state with real tensors while tracing: undo, and refuse
        with torch.no_grad():
            for n in changed:
                if n in buffers:
                    state[n].copy_(buffers[n])
        raise CaptureError(
            f"{name}.forward changes {changed[0]!r} in place (for example "
            f"self.{changed[0].rsplit('.', 1)[-1]}.add_(1)); tracing runs that update once, at "
            "compile time, and records nothing for the calls. Fix: return the new value from "
            "forward and update it outside the model, or keep the update in a module trusted "
            "with mbcompile.trust_module")
    assert tracer.output_spec is not None
    if rebound:  # self.seen = self.seen + n: fx records the sum, not the assignment
        attr = f"self.{rebound[0].rsplit('.', 1)[-1]}"
        raise CaptureError(
            f"{name}.forward assigns a tensor to {rebound[0]!r} ({attr} = {attr} + 1, or "
            f"{attr} += 1, which a traced value runs as the same assignment); torch.fx "
            "records the value but not the assignment. Fix: compile with capture='auto' or "
            "'export' (torch.export writes it back once per step), or update it with an "
            f"in-place method, which fx records ({attr}.add_(...))")
    rewiring_refused([*rewired, *_parameters_assigned(graph, effects, model)], name)
    autocast = autocast_nodes(graph)
    if autocast:
        raise CaptureError(
            f"{name}.forward has an autocast region ({source_line(autocast[0])}); torch.fx "
            "traces ops, not the dtypes autocast picks for them, so the region would run in "
            "the model's own dtype. Fix: compile with capture='auto' or capture='export' "
            "(torch.export keeps the casts autocast makes)")
    # the module's code is made from the graph as it is when first needed (a lazy
    # GraphModule, ``graph_code.py``: a split step runs the body, not this graph), so it has
    # the hooks' uses and the user's stacks set here
    writes_as_values(graph, gm)  # before any pass reads values: a write is one (fx_writes.py)
    hooks_see_every_use(graph)
    for node in graph.nodes:
        if node.stack_trace:
            node.stack_trace = user_stack(node.stack_trace)
    return CaptureResult(gm, tracer.output_spec, concrete_args,
                         guards=(*unwritten((*guards, *slot_guards(reach.slots, name, model)),
                                            effects.written, effects.keys_set()), *effects.guards),
                         effects=effects, autocast_regions=tuple(regions))


def _number_input(tracer: fx.Tracer, numbers: dict[str, NumberInput], holder: NumberInput
                  ) -> fx.Proxy:
    """What forward reads for a number that is a graph input: ``read_number(holder)``, the
    holder an attribute of the graph (set on the root for the trace, removed after)."""
    attr = next((a for a, h in numbers.items() if h is holder), f"_mbcompile_number_{len(numbers)}")
    if attr not in numbers:
        numbers[attr] = holder
        object.__setattr__(tracer.root, attr, holder)
    return tracer.create_proxy("call_function", read_number,
                               (tracer.create_proxy("get_attr", attr, (), {}),), {})


def _stashed_constants(tracer: fx.Tracer, model: torch.nn.Module, before: set[str]
                       ) -> list[str]:
    """The attributes fx stored on the root for tensors forward made (``_tensor_constant0``
    for ``torch.tensor([1., 2.])``): the graph module holds its own copy, and left on the
    model they would be forward's writes, replayed onto it every step."""
    return [name for name in tracer.tensor_attrs.values()
            if name not in before and name in model.__dict__]


def _parameters_assigned(graph: fx.Graph, effects: Effects, model: torch.nn.Module
                         ) -> list[str]:
    """Module attributes forward assigns a parameter to (``self.w = self.lin.weight``):
    ``nn.Module`` registers it as a parameter of its own, so the next compile could not
    trace the assignment (fx records the read, export refuses the rewiring)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    found = []
    for r in effects.records:
        if isinstance(r, SetAttr) and isinstance(r.owner, torch.nn.Module) and r.value:
            node = r.value.rebuild(out.args[0])
            if isinstance(node, fx.Node) and node.op == "get_attr":
                try:
                    model.get_parameter(str(node.target))
                except AttributeError:
                    continue
                found.append(f"{r.where.removeprefix('self.')} (adds a parameter)")
    return found


def effects_as_outputs(graph: fx.Graph, changes: Sequence[Change], prints: Sequence[Any],
                        name: str) -> Effects:
    """The trace's side effects (``passes/side_effects.py``); the traced values they hold
    become outputs after the model's own (one already returned keeps its place)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = tuple(out.args[0])
    returned = {x: i for i, x in enumerate(leaves) if isinstance(x, fx.Node)}
    effects = record_effects(changes, prints, name, len(leaves), returned)
    if effects.outputs:
        out.args = (leaves + effects.outputs,)
        # fx makes an attribute's node (``x.shape`` printed, ``x.dtype`` stored) when it is
        # first asked for, here, after the output: it must come before the output reads it
        nodes = list(graph.nodes)
        for late in nodes[nodes.index(out) + 1:]:
            out.prepend(late)
    return effects
