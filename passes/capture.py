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
the structure back after the call. An ``fx.GraphModule`` is taken as it is.

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
import dataclasses
import inspect
import operator
import os
import re
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm as _LegacySpectralNorm
from torch.nn.utils.weight_norm import WeightNorm as _LegacyWeightNorm
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .custom_functions import refused_in_fx
from .errors import CaptureError
from .forward_modes import (
    autocast_regions,
    autocast_state,
    differentiation_error,
    stamp_modes,
)
from .guards import Guard, recorded_reads
from .ops import TensorHook, fsdp_unit_enter, fsdp_unit_exit
from .sources import source_line, user_frame

__all__ = ["FSDP_PARAM", "CaptureResult", "OutputSpec", "capture", "fsdp_modules",
           "fsdp_unit_enter", "fsdp_unit_exit", "fsdp_view", "gathered_dtypes", "stand_in",
           "through_leaves"]


@dataclass(frozen=True)
class OutputSpec:
    """The structure of a model's output, with leaves numbered 0..n-1.

    ``kind`` is "leaf", "const", "tuple", "list", "dict" or "dataclass"; ``children``
    hold the sub-specs and ``keys`` their names (dict keys or dataclass fields).
    """

    kind: str
    index: int = -1  # for "leaf": position in the flat outputs
    value: Any = None  # for "const"
    type: Any = None  # container type to rebuild
    keys: tuple[Any, ...] = ()
    children: tuple[OutputSpec, ...] = ()

    def rebuild(self, leaves: tuple[Any, ...] | list[Any]) -> Any:
        if self.kind == "leaf":
            return leaves[self.index]
        if self.kind == "const":
            return self.value
        values = [c.rebuild(leaves) for c in self.children]
        if self.kind == "tuple":
            return self.type(*values) if _is_namedtuple(self.type) else self.type(values)
        if self.kind == "list":
            return self.type(values)
        if self.kind == "dataclass":
            return self.type(**dict(zip(self.keys, values)))
        return self.type(zip(self.keys, values))  # dict and its subclasses


def _is_namedtuple(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


def flatten_output(obj: Any, leaves: list[Any], is_leaf: Callable[[Any], bool]) -> OutputSpec:
    """Flatten ``obj`` into ``leaves`` (appending) and return its spec."""
    if is_leaf(obj):
        leaves.append(obj)
        return OutputSpec("leaf", index=len(leaves) - 1)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # ModelOutput-like objects are dataclasses (and OrderedDicts): rebuild by field.
        names = tuple(f.name for f in dataclasses.fields(obj))
        kids = tuple(flatten_output(getattr(obj, n), leaves, is_leaf) for n in names)
        return OutputSpec("dataclass", type=type(obj), keys=names, children=kids)
    if isinstance(obj, tuple):
        kids = tuple(flatten_output(v, leaves, is_leaf) for v in obj)
        return OutputSpec("tuple", type=type(obj), children=kids)
    if isinstance(obj, list):
        kids = tuple(flatten_output(v, leaves, is_leaf) for v in obj)
        return OutputSpec("list", type=type(obj), children=kids)
    if isinstance(obj, Mapping):
        keys = tuple(obj.keys())
        kids = tuple(flatten_output(obj[k], leaves, is_leaf) for k in keys)
        return OutputSpec("dict", type=dict if type(obj) is fx.immutable_collections.immutable_dict
                          else type(obj), keys=keys, children=kids)
    return OutputSpec("const", value=obj)


@dataclass(frozen=True)
class CaptureResult:
    """A captured model: the graph (flat outputs), its output spec, the specialised args."""

    graph_module: fx.GraphModule
    output_spec: OutputSpec
    concrete_args: Mapping[str, Any]
    method: str = "symbolic_trace"
    guards: tuple[Guard, ...] = ()  # the plain attributes forward read (passes/guards.py)


class _FlatOutputTracer(fx.Tracer):
    """A tracer that records source lines and flattens the traced function's output.

    ``units``: the sharded submodules of an FSDP2 model (then every module is traced
    into, and each unit's call is bracketed by the enter/exit markers).
    """

    def __init__(self, units: Mapping[int, torch.nn.Module] | None = None,
                 model_name: str = "") -> None:
        super().__init__()
        self.model_name = model_name
        self.record_stack_traces = True
        self.output_spec: OutputSpec | None = None
        self.units = units
        self.ambient_autocast = autocast_state()

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], *rest: Any, **more: Any) -> fx.Proxy:
        if kind == "call_method" and target == "register_hook":  # h.register_hook(fn)
            if len(args) != 2 or kwargs or not callable(args[1]):
                raise CaptureError("Tensor.register_hook in forward takes one hook function")
            node = self.create_node("call_function", TensorHook(args[1]), (args[0].node,), {})
            return _HookHandle(node, self)
        if target in _DIFFERENTIATIONS or (kind == "call_method" and target == "backward"):
            raise differentiation_error(self.model_name)
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # the grad mode and autocast state forward's own regions set (passes/forward_modes.py)
        node = super().create_node(*args, **kwargs)
        stamp_modes(node, self.ambient_autocast)
        return node

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # modules the user trusts as per-sample (mbcompile.trust_module) stay single nodes
        from .rules import TRUSTED_MODULES

        if isinstance(m, tuple(TRUSTED_MODULES)):
            if not torch.is_grad_enabled():
                raise CaptureError(
                    f"{type(m).__name__} {module_qualified_name!r}, trusted with "
                    "mbcompile.trust_module, is called inside a no-grad region of forward; a "
                    "trusted module runs as one opaque call, so its parameters would get "
                    "gradients. Fix: call it outside the no-grad region and detach its output")
            return True
        if not torch.is_grad_enabled():
            return False  # traced into, so that its parameters are read (and detached) here
        if _runs_more_than_forward(m):
            return False  # its hooks and parametrizations are part of the step: traced too
        # a sharded model holds DTensor shards: its layers become functions of stand-ins
        return self.units is None and super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.units is None or id(m) not in self.units:
            return super().call_module(m, forward, args, kwargs)
        name = self.path_of_module(m)

        def bracketed(*a: Any, **k: Any) -> Any:
            a, k = self._marked(fsdp_unit_enter, name, (a, k))
            return self._marked(fsdp_unit_exit, name, forward(*a, **k))

        return super().call_module(m, bracketed, args, kwargs)

    def _marked(self, marker: Callable[..., Any], name: str, value: Any) -> Any:
        """``value`` with its proxies passed through one ``marker(name, *proxies)`` node."""
        return through_leaves(value, fx.Proxy, lambda proxies: self.create_proxy(
            "call_function", marker, (name, *proxies), {}))

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore[override]
        # Non-tensor arguments are substituted here rather than handed to fx as
        # concrete_args: fx flattens containers ((0, 1), {"a": 1}) into extra
        # placeholders and emits invalid code for parameters with defaults. Every
        # parameter keeps one placeholder; CompiledModule.forward checks the values.
        concrete = dict(concrete_args or {})
        fn, args = super().create_args_for_root(root_fn, is_module, None)
        names = list(inspect.signature(root_fn).parameters)
        fixed = {i: concrete[n] for i, n in enumerate(names) if n in concrete}

        def flat_fn(*a: Any) -> tuple[Any, ...]:
            a = tuple(fixed.get(i, v) for i, v in enumerate(a))
            leaves: list[Any] = []
            self.output_spec = flatten_output(fn(*a), leaves, lambda v: isinstance(v, fx.Proxy))
            return tuple(leaves)

        return flat_fn, args


class _StateAsProxies(TorchFunctionMode):
    """While fx traces: a call without any proxy argument that fx would not see becomes a
    node when it writes into the model's own state (``for p in self.teacher.parameters():
    p.mul_(0.9)``: the parameters enter as ``get_attr`` nodes) or draws random numbers
    (``torch.randn(4, generator=self.g)``).

    Without this such a call runs on real tensors at trace time: the EMA updates the
    teacher once, at compile; the draw advances the generator once, and its noise is a
    constant of every step. (A state tensor used together with a proxy is fx's own
    business: it becomes a ``get_attr``.)
    """

    def __init__(self, tracer: fx.Tracer, model: torch.nn.Module) -> None:
        super().__init__()
        self.tracer = tracer
        self.state = {id(t): name for name, t in (*model.named_parameters(),
                                                  *model.named_buffers())}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(v, fx.Proxy) for v in leaves):  # fx would not see the call
            if func in _RANDOM_FACTORIES:
                return self.tracer.create_proxy("call_function", func, tuple(args), kwargs)
            if _in_place(func) and args and isinstance(args[0], torch.Tensor) \
                    and id(args[0]) in self.state:  # a write into the model's state
                args, kwargs = pytree.tree_map(self._as_proxy, (args, kwargs))
        return func(*args, **kwargs)

    def _as_proxy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self.state:
            return self.tracer.create_proxy("get_attr", self.state[id(value)], (), {})
        return value


_RANDOM_FACTORIES = frozenset({torch.randn, torch.rand, torch.randint, torch.randperm,
                               torch.normal})


def _in_place(func: Any) -> bool:
    """``Tensor.mul_``, ``Tensor.copy_``, ``Tensor.__iadd__``: a call that writes its first
    argument (``__get__`` of a property, ``Tensor.grad_fn``, is not one)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("_")) or (
        name.startswith("__i") and name.endswith("__") and name != "__init__")


class _HookHandle(fx.Proxy):
    """What ``h.register_hook(fn)`` returns while tracing: a handle forward may not use."""

    def __getattr__(self, name: str) -> Any:
        raise CaptureError(
            f"forward uses the handle of a tensor hook it registered (.{name}) at "
            f"{source_line(self.node)}; the compiled graph keeps the hook for the whole step. "
            "Fix: keep the hook registered, or register it outside forward")


def _hooks_see_every_use(graph: fx.Graph) -> None:
    """Each ``tensor_hook(h)`` node stands for ``h`` in every use, earlier ones too: in eager
    the hook sees the gradient of ``h`` from all its uses, whenever it was registered."""
    for node in list(graph.nodes):
        if isinstance(node.target, TensorHook):
            (h,) = node.args
            h.replace_all_uses_with(node, delete_user_cb=lambda user, hook=node: user is not hook)
            h.append(node)


def _runs_more_than_forward(m: torch.nn.Module) -> bool:
    """A layer whose call recomputes its weight: a parametrization (spectral norm's power
    iteration also updates buffers), or the pre-hook of legacy ``spectral_norm`` /
    ``weight_norm``. Kept as one node, that work would run once per microbatch instead of
    once per step, so it is traced. (Other hooks of a layer run at its call, once per
    microbatch: a hook of the user's that keeps state belongs on a module of their own,
    whose hooks are traced.)"""
    return (parametrize.is_parametrized(m)
            or type(m).__module__.startswith("torch.nn.utils.parametriz")
            or any(isinstance(h, _WEIGHT_HOOKS) for h in m._forward_pre_hooks.values()))


_WEIGHT_HOOKS = (_LegacySpectralNorm, _LegacyWeightNorm)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DIFFERENTIATIONS = (torch.autograd.grad, torch.autograd.backward)
_FRAME = re.compile(r'  File "([^"]+)", line \d+, in [^\n]*\n(?:    [^\n]*\n?)?')


def _tracer_frame(path: str) -> bool:
    """torch's own frames, and this module's tracer (its call_module override)."""
    return path.startswith(_TORCH_DIR) or path == os.path.abspath(__file__)


def _user_stack(stack_trace: str) -> str:
    """The recorded stack without torch's own frames (fx's printouts then show the user's line)."""
    frames = [m.group(0) for m in _FRAME.finditer("  " + stack_trace.lstrip())]
    kept = [f for f in frames if not _tracer_frame(os.path.abspath(_FRAME.match(f).group(1)))]
    return "".join(kept).rstrip("\n") if kept else stack_trace


# --------------------------------------------------------------------------- FSDP2


def through_leaves(value: Any, kind: type, call: Callable[[list[Any]], Any]) -> Any:
    """``value`` with its leaves of type ``kind`` replaced by ``call(those leaves)``'s
    items, in order: one marker call for all of a unit's values (``call`` sees the list
    even when it is empty)."""
    leaves, spec = pytree.tree_flatten(value)
    at = [i for i, v in enumerate(leaves) if isinstance(v, kind)]
    out = call([leaves[i] for i in at])
    for j, i in enumerate(at):
        leaves[i] = out[j]
    return pytree.tree_unflatten(leaves, spec)


#: Attribute of a stand-in parameter: ``(root model, qualified name)`` of the sharded one.
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
        return CaptureResult(fx.GraphModule(gm, graph), spec, concrete_args, "graph_module")
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(
            f"mbcompile.compile expects a torch.nn.Module, got {type(model).__name__}. "
            "Wrap a function in an nn.Module whose forward calls it.")
    name = type(model).__name__
    units = fsdp_modules(model)
    with fsdp_view(model, units):
        root_hooks = [k for k in ("_forward_pre_hooks", "_forward_hooks")
                      if getattr(model, k, None)]
        if root_hooks:
            raise CaptureError(
                f"{name} has forward hooks on the model itself ({', '.join(root_hooks)}); "
                "torch.fx traces forward directly, so they would never run in the compiled "
                "module. Fix: move their work into forward, register them on a submodule, or "
                "compile a wrapper Module whose forward calls the model (hooks of submodules "
                "are traced)")
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        versions = {n: t._version for n, t in state.items()}
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        tracer = _FlatOutputTracer({id(m): m for n, m in units if n} if units else None,
                                   name)
        try:
            # a training forward is traced: no-grad regions are forward's own, not the caller's
            with python_state_kept(model) as rebound, recorded_reads(model, name) as guards, \
                    refused_in_fx(name), torch.enable_grad(), \
                    (contextlib.nullcontext() if units else _StateAsProxies(tracer, model)):
                graph = tracer.trace(model, concrete_args=concrete_args or None)
                # now, while the constants fx stored on the root (_tensor_constant0, a
                # generator's _opaque_obj0) are there to copy; the model is then restored
                gm = fx.GraphModule(_with_stand_ins(model, graph, units) if units else tracer.root,
                                    graph, name)
        except CaptureError:
            raise
        except Exception as exc:  # any tracing failure becomes one clear error
            where = user_frame(traceback.extract_tb(exc.__traceback__))
            raise CaptureError(
                f"torch.fx could not trace {type(model).__name__}.forward at {where}\n"
                f"  {type(exc).__name__}: {exc}\n"
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
        raise CaptureError(
            f"{name}.forward assigns a new tensor to {rebound[0]!r}; torch.fx records the "
            "value but not the assignment. Fix: compile with capture='auto' or 'export' "
            "(torch.export writes it back once per step), or update it in place "
            f"(self.{rebound[0].rsplit('.', 1)[-1]}.add_(...))")
    autocast = autocast_regions(graph)
    if autocast:
        raise CaptureError(
            f"{name}.forward has an autocast region ({source_line(autocast[0])}); torch.fx "
            "traces ops, not the dtypes autocast picks for them, so the region would run in "
            "the model's own dtype. Fix: compile with capture='auto' or capture='export' "
            "(torch.export keeps the casts autocast makes)")
    _hooks_see_every_use(graph)
    for node in graph.nodes:
        if node.stack_trace:
            node.stack_trace = _user_stack(node.stack_trace)
    gm.recompile()
    return CaptureResult(gm, tracer.output_spec, concrete_args, guards=tuple(guards))


_MISSING = object()


@contextlib.contextmanager
def python_state_kept(model: torch.nn.Module) -> Iterator[list[str]]:
    """Undo what a traced forward assigns to its modules; yields the list of the parameter,
    buffer and submodule slots it rebound (filled when the block ends).

    Tracing runs forward once on symbolic or fake values, so an assignment in forward
    (``self.seen += n`` rebinding a buffer, legacy ``spectral_norm`` setting
    ``module.weight``, a cache) would leave a proxy or fake tensor in the user's model:
    every attribute, parameter, buffer and submodule slot, and every hook dictionary, is put
    back as it was. (A
    public number or flag that forward changes is refused: ``guards.recorded_reads``.)
    """
    saved = [(mod, dict(mod.__dict__), *(dict(slots) for slots in _slots_of(mod)))
             for mod in model.modules()]
    hooks = [(table, dict(table)) for mod in model.modules() for table in _hook_tables(mod)]
    names = {id(mod): name for name, mod in model.named_modules()}
    rebound: list[str] = []
    try:
        yield rebound
    finally:
        for mod, attrs, *slot_copies in saved:
            for slots, before in zip(_slots_of(mod), slot_copies):
                if slots.keys() != before.keys() or any(slots[k] is not v
                                                        for k, v in before.items()):
                    rebound.extend(".".join(filter(None, (names.get(id(mod)), k)))
                                   for k in slots if slots[k] is not before.get(k))
                    slots.clear()
                    slots.update(before)
            for key in set(attrs) | set(mod.__dict__):
                if key not in attrs:
                    del mod.__dict__[key]
                elif mod.__dict__.get(key, _MISSING) is not attrs[key]:
                    mod.__dict__[key] = attrs[key]
        for table, before in hooks:  # hooks a library installs on its first call
            if table.keys() != before.keys():
                table.clear()
                table.update(before)


def _slots_of(mod: torch.nn.Module) -> tuple[dict[str, Any], ...]:
    return mod._parameters, mod._buffers, mod._modules


def _hook_tables(mod: torch.nn.Module) -> list[dict[Any, Any]]:
    """Every dict of hooks (and hook flags) a module keeps, as ``Module.__init__`` makes them."""
    return [v for k, v in vars(mod).items() if "hook" in k and isinstance(v, dict)]


def signature_of(model: torch.nn.Module) -> inspect.Signature:
    """The signature users call the model with (``forward``'s, without self)."""
    return inspect.signature(model.forward)
