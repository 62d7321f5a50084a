"""The fx tracer of the capture pass: source lines, flat outputs, and what fx would miss.

``FlatOutputTracer`` records the user's frames of every node's stack (``trace_stacks.py``:
fx's printouts then show the user's line), flattens forward's output into leaves
(``output_spec``), stamps grad-mode and autocast state on each node, keeps a tensor hook
forward registers as a ``tensor_hook`` node, traces into layers whose call runs more
than forward (hooks, parametrizations) and brackets the calls of FSDP2 units.
``StateAsProxies`` makes a node of a call fx would not see because no proxy flows in: a
random draw, or a write into the model's own parameters or buffers.

>>> tracer = FlatOutputTracer(model_name="Net")
>>> graph = tracer.trace(net)          # returns a tuple of leaves; tracer.output_spec
"""

from __future__ import annotations

import bisect
import dis
import functools
import inspect
import sys
import traceback
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .errors import CaptureError
from .forward_modes import autocast_state, differentiation_error, stamp_modes
from .fx_leaves import traced_through
from .fx_refusals import (
    HOOK_METHODS,
    OBSERVER_KERNELS,
    observer_kernel_error,
    refused_call,
    state_hook_error,
)
from .fx_writes import attribute_at, is_write, written_state, written_tensor
from .guard_values import NUMPY_NUMBERS
from .ops import TensorHook, fsdp_unit_enter, fsdp_unit_exit
from .output_spec import OutputSpec, flatten_output, through_leaves
from .sources import source_line, user_frame
from .state_updates import IN_PLACE_OPERATORS
from .trace_stacks import FX_STACK, traced_stack, user_stack
from .whose_code import user_code

__all__ = ["FlatOutputTracer", "StateAsProxies", "hooks_see_every_use", "user_stack"]


@functools.lru_cache(maxsize=256)
def _instructions(code: types.CodeType) -> tuple[list[dis.Instruction], list[int]]:
    """``code``'s instructions and their offsets, read once per code object."""
    found = list(dis.get_instructions(code))
    return found, [i.offset for i in found]


class _Proxy(fx.Proxy):
    """fx's proxy, with ``__iter__`` reading the calling function's instructions once per
    function: fx's reads the whole function at every ``b, t, c = x.shape`` (twice a layer
    of a GPT, about a fifth of tracing it). The same choice as fx's: an unpacking of n
    values is n ``getitem`` nodes, any other iteration the tracer's ``iter``."""

    def __iter__(self) -> Iterator[fx.Proxy]:
        frame = sys._getframe(1)
        found, offsets = _instructions(frame.f_code)
        index = bisect.bisect_left(offsets, frame.f_lasti) if sys.version_info >= (3, 11) \
            else frame.f_lasti // 2
        if found[index].opname == "UNPACK_SEQUENCE":
            return (self[i] for i in range(found[index].argval))
        return self.tracer.iter(self)

    def __getattr__(self, k: str) -> fx.Proxy:
        attribute = _Attribute(self, k)
        if k == "dtype":  # checked after the trace: read by an op, or only by Python
            self.tracer.dtype_reads.append((attribute, user_frame(traceback.extract_stack())))
        return attribute

    def __str__(self) -> str:
        return _as_text(self, fx.Proxy.__repr__(self))

    def __format__(self, spec: str) -> str:
        return _as_text(self, fx.Proxy.__repr__(self))


def _as_text(proxy: fx.Proxy, text: str) -> str:
    """``str(h.dtype)``, ``f"{h.shape[1]}"`` in the user's code: a CaptureError at its line
    (fx's text, ``Proxy(getattr_2)``, took a branch on it the wrong way, silently);
    ``capture="auto"`` then captures with torch.export, whose values are concrete there.
    Elsewhere (torch's, mbcompile's messages) fx's text."""
    frame = sys._getframe(2)
    if not user_code(frame.f_code.co_filename):
        return text
    where = user_frame(traceback.extract_stack(frame, limit=1))
    raise CaptureError(
        f"forward makes text of a traced value at {where} (str(x.dtype), f\"{{h.shape[1]}}\"); "
        "torch.fx traces symbols, so the text would be fx's (Proxy(...)) and a branch on it "
        "would go the wrong way. Fix: use the value itself: compare it (x.dtype == "
        "torch.float64, h.shape[1] == 3), or print it as its own argument (print('loss', "
        "loss.detach())); or compile with capture='export' (capture='auto' does)")


def _in_place_operator(op: Callable[[Any, Any], Any]) -> Callable[[fx.Proxy, Any], fx.Proxy]:
    def method(self: fx.Proxy, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    return method


# ``h += x`` as ``operator.iadd(h, x)``: fx's proxy has no in-place operators, so Python
# records ``h + x``, and a tensor another name holds (or the caller's input) would keep its
# old value; fx_writes.py follows the write
for _op in IN_PLACE_OPERATORS:
    setattr(_Proxy, f"__{_op.__name__}__", _in_place_operator(_op))


class _Attribute(_Proxy, fx.proxy.Attribute):
    """fx's attribute proxy (``x.shape``) with ``_Proxy``'s ``__iter__``."""


class FlatOutputTracer(fx.Tracer):
    """A tracer that records source lines and flattens the traced function's output.

    ``units``: the sharded submodules of an FSDP2 model (then every module is traced
    into, and each unit's call is bracketed by the enter/exit markers).
    """

    def __init__(self, units: Mapping[int, torch.nn.Module] | None = None,
                 model_name: str = "") -> None:
        super().__init__()
        self.model_name = model_name
        self.record_stack_traces = False  # per node, where fx's own text is needed
        self.output_spec: OutputSpec | None = None
        self.units = units
        self.ambient_autocast = autocast_state()
        self.written: dict[fx.Node, str] = {}  # a write into state (or its result) -> the state
        self.written_ids: set[int] = set()  # the tensors of the state written so far
        self.traced_no_grad: list[str] = []  # torch layers traced into in a no-grad region
        self.dtype_reads: list[tuple[fx.Proxy, str]] = []  # ``h.dtype`` and where

    def dtype_reads_refused(self) -> None:
        """Raise where forward read a traced tensor's dtype and no op took it: Python did
        (``x.dtype is torch.float32``, ``x.dtype in {...}``), on fx's stand-in, which is
        no dtype, so the branch took one side whatever the call's dtype (eager's other
        side at the example's own). fx makes a node of it only where an op reads it."""
        for attribute, where in self.dtype_reads:
            if attribute._node is None:
                raise CaptureError(
                    f"forward reads a tensor's dtype at {where} in Python (an `is` test, a "
                    "set lookup), where torch.fx has a traced value, no dtype: the test "
                    "would take one side for every call. Fix: compile with capture='auto' "
                    "or capture='export' (torch.export knows the dtype), or pass the dtype "
                    "to a torch op (x.to(h.dtype))")

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any], *rest: Any, **more: Any) -> fx.Proxy:
        refused = refused_call(kind, target, args, self.model_name)
        if refused is not None:  # a hook on a parameter, retain_grad() (fx_refusals.py)
            raise refused
        if kind == "call_method" and target == "register_hook":  # h.register_hook(fn)
            if len(args) != 2 or kwargs or not callable(args[1]):
                raise CaptureError("Tensor.register_hook in forward takes one hook function")
            node = self.create_node("call_function", TensorHook(args[1]), (args[0].node,), {})
            return _HookHandle(node, self)
        if target in _DIFFERENTIATIONS or (kind == "call_method" and target == "backward"):
            raise differentiation_error(self.model_name)
        return super().create_proxy(kind, target, args, kwargs, *rest, **more)

    def create_arg(self, a: Any) -> Any:
        # a numpy scalar (``np.cos`` of a schedule) as the Python number it equals: fx would
        # write ``np.float64(0.5)`` into the graph's code, which has no ``np``
        if isinstance(a, NUMPY_NUMBERS):
            return super().create_arg(a.item())
        return super().create_arg(a)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        # the user's frames of the stack, as fx would record it and user_stack keep them
        stack = traced_stack(sys._getframe(1))
        self.record_stack_traces = stack is FX_STACK
        node = super().create_node(*args, **kwargs)
        if isinstance(stack, str) and not node.stack_trace:
            node.stack_trace = stack
        # the grad mode and autocast state forward's own regions set (passes/forward_modes.py)
        stamp_modes(node, self.ambient_autocast)
        if is_write(node):  # a layer holding that state is traced into from now on
            base = written_tensor(node)
            state = (written_state(base) or self.written.get(base)) \
                if isinstance(base, fx.Node) else None
            if state is not None:
                self.written[node] = state
                self.written_ids.add(id(attribute_at(self.root, state)))
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
        if not torch.is_grad_enabled() and any(p.requires_grad for p in m.parameters()):
            if super().is_leaf_module(m, module_qualified_name):  # a torch layer: said if
                self.traced_no_grad.append(module_qualified_name)  # its own code fails
            return False  # traced into, so that its parameters are read (and detached) here
        if self.written_ids and self.written_ids & {id(t) for t in (*m.parameters(),
                                                                     *m.buffers())}:
            return False  # it reads state forward wrote: traced into, it reads the new value
        if traced_through(m):  # its hooks, parametrizations or own forward: part of the step
            return False
        # a sharded model holds DTensor shards: its layers become functions of stand-ins
        return self.units is None and super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any],
                    args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._installed(m):  # a stateless layer made in forward (loss = nn.CTCLoss())
            return forward(*args, **kwargs)  # traced through: its ops, as eager runs them
        if (m._backward_hooks or m._backward_pre_hooks) and torch.is_grad_enabled() and \
                not self.is_leaf_module(m, self.path_of_module(m)):
            fix = ("register it on the torch layers inside (their calls are kept with their "
                   "hooks, checked at compile), or remove it while training") \
                if self.units is None else (
                "a model sharded with FSDP2 has every layer traced through (its parameters "
                "are stand-ins for the shards), so remove it while training, or register a "
                "tensor hook on the layer's output in forward (h.register_hook(fn))")
            raise CaptureError(
                f"{type(m).__name__} {self.path_of_module(m)!r} has a backward hook "
                "(register_full_backward_hook) and torch.fx traces through its call, which "
                f"leaves no place for it: it would never run in the compiled step. Fix: {fix}")
        if self.units is None or id(m) not in self.units:
            return super().call_module(m, forward, args, kwargs)
        name = self.path_of_module(m)

        def bracketed(*a: Any, **k: Any) -> Any:
            a, k = self._marked(fsdp_unit_enter, name, (a, k))
            return self._marked(fsdp_unit_exit, name, forward(*a, **k))

        return super().call_module(m, bracketed, args, kwargs)

    def _installed(self, m: torch.nn.Module) -> bool:
        """Whether ``m`` is one of the model's layers (else fx has no name to call it by).
        A layer made in forward with state of its own is refused: made anew each call, its
        parameters are not the model's, and a trace would keep the first call's. One that
        holds the model's own (``nn.CrossEntropyLoss(weight=self.class_w)``) is traced."""
        try:
            self.path_of_module(m)
        except NameError:
            own = {id(t) for t in (*self.root.parameters(), *self.root.buffers())}
            if any(id(t) not in own for t in (*m.parameters(), *m.buffers())):
                raise CaptureError(
                    f"forward makes a {type(m).__name__} with parameters or buffers at "
                    f"{user_frame(traceback.extract_stack())} and calls it; made anew each "
                    "call, they are not the model's. Fix: make it in __init__ "
                    "(self.layer = ...)") from None
            return False
        return True

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


class StateAsProxies(TorchFunctionMode):
    """While fx traces: a call without any proxy argument that fx would not see becomes a
    node when it writes into the model's own state (``for p in self.teacher.parameters():
    p.mul_(0.9)``: the parameters enter as ``get_attr`` nodes), computes a tensor from a
    parameter or a buffer (the EMA's ``(1 - m) * p``, ``self.class_w / self.class_w.mean()``),
    or draws random numbers (``torch.randn(4, generator=self.g)``, ``Beta(a, b).sample()``);
    a value of the state read into Python (``.item()``, ``if self.flag:``) is refused.

    Without this such a call runs on real tensors at trace time: the EMA updates the
    teacher once, at compile, from the weights of compile time; a buffer the loop changes
    keeps compile's value; the draw advances the generator once, and its noise is a
    constant of every step. (A state tensor used together with a proxy is fx's own
    business: it becomes a ``get_attr``.)
    """

    def __init__(self, tracer: FlatOutputTracer, model: torch.nn.Module,
                 sharded: bool = False) -> None:
        super().__init__()
        self.tracer = tracer
        # a sharded (FSDP2) model's parameters are stand-ins the tracer makes: its
        # buffers and draws only
        self.state = {id(t): name for name, t in (
            *(() if sharded else model.named_parameters()), *model.named_buffers())}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if any(isinstance(v, fx.Proxy) for v in leaves):  # fx sees the call itself
            return func(*args, **kwargs)
        if func in _RANDOM_FACTORIES:
            return self.tracer.create_proxy("call_function", func, tuple(args), kwargs)
        state = [v for v in leaves if isinstance(v, torch.Tensor) and id(v) in self.state]
        if _draws(func) and not state:  # (a draw into the state is a write: below)
            return self._draw(func, args, kwargs)
        if not state:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in HOOK_METHODS and args and id(args[0]) in self.state:  # before it runs
            raise state_hook_error(self.tracer.model_name, self.state[id(args[0])], name)
        if name.startswith("_foreach_") and name.endswith("_") and args and any(
                id(v) in self.state for v in pytree.tree_leaves(args[0])):
            where = user_frame(traceback.extract_stack())
            raise CaptureError(  # before it runs: the model must stay as it was
                f"forward writes the model's state with torch.{name} ({where}), which "
                "torch.fx cannot record. Fix: write "
                "each tensor with its own in-place op (q.mul_(m) in a loop), or compile "
                "with capture='auto' or capture='export'")
        if getattr(func, "__self__", None) is torch._C.TensorBase.data:
            # p.data of the model's state: what fx makes of a proxy's .data, so that a write
            # there (the EMA's q.data.mul_(0.9)) is one into the state (fx_writes.py)
            return self.tracer.create_proxy("call_function", getattr,
                                            (self._as_proxy(args[0]), "data"), {})
        if name == "__get__":
            return func(*args, **kwargs)
        if name in OBSERVER_KERNELS:  # before it runs: it writes state fx cannot see
            raise observer_kernel_error(self.tracer.model_name, name)
        if _in_place(func):
            if not (args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.state):
                return func(*args, **kwargs)
        else:
            if name in _VALUE_READS:
                raise CaptureError(
                    f"forward reads the value of {self.state[id(state[0])]!r} as a Python "
                    f"value (Tensor.{name.strip('_')}) at "
                    f"{user_frame(traceback.extract_stack())}. torch.fx would keep the value "
                    "it has at compile, and a later change (an optimizer step, the loop "
                    "filling a buffer) would not reach the step. Fix: keep it a tensor "
                    "(o * self.scale, torch.where(self.flag, a, b)), or hold it as a plain "
                    "Python attribute (compiled again when it changes)")
            result = func(*args, **kwargs)  # pure: a count or a shape is kept as it is
            if not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(result)):
                return result
        # a write into the model's state, or a tensor computed from a parameter (the EMA's
        # ``(1 - m) * p``): run at trace time it would be a constant of compile's values
        args, kwargs = pytree.tree_map(self._as_proxy, (args, kwargs))
        if torch.overrides.is_tensor_method_or_property(func):
            # by name on the proxy: ``TensorBase.mul_`` is a descriptor that refuses
            # anything but a real tensor as its ``self``
            return self.tracer.create_proxy("call_method", func.__name__, tuple(args), kwargs)
        return func(*args, **kwargs)

    def _draw(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A draw that reads no traced value (``torch.bernoulli(p)`` of a constant
        ``p``, ``torch.distributions.Beta(a, b).sample()``): a node, drawn at each step as
        eager draws it (once, before the loop: ``draws.py``). Run at trace time it would be
        a constant of compile's draw, and the generator would not advance at each step."""
        name = getattr(func, "__name__", "")
        if _in_place(func) or getattr(func, "__self__", None) is not None and not \
                torch.overrides.is_tensor_method_or_property(func):
            raise CaptureError(
                f"forward draws random numbers with {name} into a tensor it made at "
                f"{user_frame(traceback.extract_stack())}, which torch.fx would draw once, at "
                "compile, and keep as a constant. Fix: draw it with a factory "
                "(torch.rand(()), torch.randn(shape)), or compile with capture='auto' or "
                "capture='export'")
        if torch.overrides.is_tensor_method_or_property(func):
            return self.tracer.create_proxy("call_method", name, tuple(args), kwargs)
        return self.tracer.create_proxy("call_function", func, tuple(args), kwargs)

    def _as_proxy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self.state:
            return self.tracer.create_proxy("get_attr", self.state[id(value)], (), {})
        return value


_RANDOM_FACTORIES = frozenset({torch.randn, torch.rand, torch.randint, torch.randperm,
                               torch.normal})


#: what reads a tensor's values into Python (not its shape, dtype or device)
_VALUE_READS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__",
                          "__complex__", "equal", "allclose", "is_nonzero", "numpy"})


def _draws(func: Any) -> bool:
    """Whether ``func`` draws random numbers (``draws.RANDOM_OPS``, by its name)."""
    from .draws import RANDOM_OPS  # the draws pass reads the rules, which read this module

    return getattr(func, "__name__", "") in RANDOM_OPS


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


def hooks_see_every_use(graph: fx.Graph) -> bool:
    """Each ``tensor_hook(h)`` node stands for ``h`` in every use, earlier ones too: in eager
    the hook sees the gradient of ``h`` from all its uses, whenever it was registered.
    Returns whether the graph has such a node (then it changed)."""
    changed = False
    for node in list(graph.nodes):
        if isinstance(node.target, TensorHook):
            (h,) = node.args
            h.replace_all_uses_with(node, delete_user_cb=lambda user, hook=node: user is not hook)
            h.append(node)
            changed = True
    return changed


_DIFFERENTIATIONS = (torch.autograd.backward,)  # grad: a penalty, kept (penalties.py)
