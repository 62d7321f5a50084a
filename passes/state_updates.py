"""State-updates pass: writes into buffers, frozen parameters and inputs become extra outputs.

A functionalized capture ends with the state the call changes written back in
place: ``copy_(self.center, new_center)`` for a buffer, ``copy_(x, new_x)`` for an
input mutated in place. Run per microbatch, such a write would happen once per
microbatch with that microbatch's values (DINO's centre: an EMA of each
microbatch's mean instead of the batch's). This pass removes the writes and
returns the new values as extra outputs instead, detached (state carries no
gradient), so every later pass treats them like any output: a batch-free value is
computed once, a linear function of batch reductions once from the global sums,
a per-sample value concatenated in order. The caller writes them back after the
step, once, as eager does.

Before::

    add_1 = aten.add(mul, mul_1)              # 0.9 * center + 0.1 * h.mean(0)
    copy_ = aten.copy_(center, add_1)
    return (loss,)

After (``StateUpdates.targets == (StateTarget("buffer", "center"),)``)::

    add_1 = aten.add(mul, mul_1)
    detach = aten.detach(add_1)
    return (loss, detach)
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError
from .sources import source_line

__all__ = ["IN_PLACE_OPERATORS", "StateTarget", "StateUpdates", "has_mutations",
           "lift_state_updates", "mutates"]

_COPIES = (torch.ops.aten.copy_.default, torch.Tensor.copy_, "copy_")


@dataclass(frozen=True)
class StateTarget:
    """Where an extra output is written back: a buffer (by qualified name) or an input."""

    kind: str  # "buffer", "parameter" (a frozen one: an EMA copy) or "input"
    name: str  # the buffer's qualified name, or the input's placeholder name
    #: written by a kernel that does not count it as a change (batch norm's running
    #: statistics: eager's kernel writes them in place, their version unchanged), so a
    #: backward that saved the buffer still runs after the write (``write_back``)
    quiet: bool = False


@dataclass(frozen=True)
class StateUpdates:
    """The graph with its state writes lifted to outputs ``n_outputs``, ``n_outputs+1``, ..."""

    graph_module: fx.GraphModule
    n_outputs: int  # the model's own outputs; the rest are state, in ``targets`` order
    targets: tuple[StateTarget, ...] = ()

    @property
    def written_inputs(self) -> tuple[str, ...]:
        """The inputs forward writes in place (written back after the step)."""
        return tuple(t.name for t in self.targets if t.kind == "input")

    def write_back(self, model: torch.nn.Module, new: Sequence[Any],
                   arguments: Mapping[str, Any]) -> None:
        """Write a step's ``new`` state (its outputs past ``n_outputs``) into ``model``'s
        buffers and frozen parameters and the call's ``arguments``, once, as eager did."""
        with torch.no_grad():
            for target, value in zip(self.targets, new):
                if target.kind == "buffer":
                    dest = model.get_buffer(target.name)
                    if dest.shape != value.shape:  # an observer's min_val, made empty, resized
                        dest.resize_(value.shape)  # by its first forward as eager resizes it
                elif target.kind == "parameter":  # under no_grad: it stays a leaf
                    dest = model.get_parameter(target.name)
                else:
                    dest = arguments[target.name]
                with (torch.autograd._unsafe_preserve_version_counter(dest) if target.quiet
                      else contextlib.nullcontext()):
                    dest.copy_(value)

    def refuse_plain_tensors(self, model: torch.nn.Module) -> None:
        """A ``CaptureError`` where a state forward writes in place is a plain tensor
        attribute of ``model`` (``self.ema = torch.tensor(0.)``): fx's graph holds it as a
        buffer, so the write-back raised "is not a buffer" after the step had run, and a
        variant at another batch size read a stale copy."""
        for target in self.targets:
            if target.kind == "buffer" and _plain_tensor(model, target.name):
                raise CaptureError(
                    f"forward writes in place into self.{target.name}, a tensor attribute "
                    "that is not a buffer; mbcompile writes a step's state back into "
                    "buffers and frozen parameters only. Fix: register it as a buffer "
                    f"(self.register_buffer({target.name.rpartition('.')[2]!r}, tensor), "
                    "persistent=False to keep it out of the state_dict); nothing was "
                    "changed")


def _plain_tensor(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model`` holds a tensor at the dotted ``name`` that is not a buffer."""
    owner, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return attr not in module._buffers and isinstance(vars(module).get(attr), torch.Tensor)


def _target(node: fx.Node, gm: fx.GraphModule) -> StateTarget | None:
    """The state a written-to node stands for (a buffer or an input), if any."""
    if node.op == "placeholder":
        return StateTarget("input", str(node.target))
    if node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        if name.startswith("_tensor_constant"):  # fx's: a tensor forward made, kept as one
            raise CaptureError(
                f"forward writes in place into a tensor it made itself ({source_line(node)}: "
                "torch.zeros(3).add_(...)); torch.fx keeps such a tensor as a constant of "
                "the graph, made once, where eager makes it anew each call. Fix: write it "
                "out of place (t = t + ...), or compile with capture='export' (it traces "
                "the tensor as made each call); nothing was changed")
        module = gm.get_submodule(owner) if owner else gm
        if name in dict(module.named_buffers(recurse=False)):
            return StateTarget("buffer", str(node.target))
        param = dict(module.named_parameters(recurse=False)).get(name)
        if param is not None:
            if param.requires_grad:
                raise CaptureError(
                    f"forward writes the trained parameter {node.target!r} in place "
                    f"({source_line(node)}); the uses after the write would read the new "
                    "value without a gradient to the parameter. Fix: update it outside "
                    "forward (in the optimizer step), or freeze it (requires_grad_(False)) "
                    "if it is an EMA copy")
            return StateTarget("parameter", str(node.target))  # an EMA copy, frozen
    return None


def _running_statistic(node: fx.Node) -> bool:
    """Whether ``node`` is a running statistic a functional batch norm returns (its outputs
    after the normalised value, the saved mean and the saved inverse deviation)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    op = node.args[0].target
    return isinstance(op, torch._ops.OpOverload) and "batch_norm" in op.name() \
        and node.args[1] >= 3


def _is_copy(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and node.target in _COPIES


def lift_state_updates(gm: fx.GraphModule) -> StateUpdates:
    """Lift every final, unread ``copy_`` into a buffer or an input to an extra output.

    Only the form functionalization leaves behind is lifted: one ``copy_`` per
    state, its result unread. Other in-place writes stay in the graph, where the
    batch analysis judges them.
    """
    graph = gm.graph
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    leaves = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    n_outputs = len(leaves)
    targets: list[StateTarget] = []
    for node in list(graph.nodes):
        if not _is_copy(node) or node.users:
            continue
        dst, src = node.args[0], node.args[1]
        target = _target(dst, gm) if isinstance(dst, fx.Node) else None
        if target is None or not isinstance(src, fx.Node):
            continue
        if _running_statistic(src):
            target = dataclasses.replace(target, quiet=True)
        with graph.inserting_before(node):
            value = graph.call_function(torch.ops.aten.detach.default, (src,))
        value.meta = dict(node.meta)  # the write's source line
        if "val" in src.meta:
            value.meta["val"] = src.meta["val"]
        graph.erase_node(node)
        leaves.append(value)
        targets.append(target)
    if targets:
        out.args = (tuple(leaves),)
        graph.lint()
        gm.recompile()
    return StateUpdates(gm, n_outputs, tuple(targets))


#: ``x += y`` and its kin (``operator.iadd``): what fx records for a proxy's ``+=``
IN_PLACE_OPERATORS = frozenset(getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
    "rshift", "matmul"))


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor in place (``x.add_(y)``, ``x += y``, ``aten.div_``,
    a call with ``out=``, a higher-order op such as export's ``torch.no_grad()`` region)."""
    target = node.target
    if isinstance(node.kwargs.get("out"), fx.Node):  # F.normalize(v, out=self._u)
        return True
    if node.op == "call_method":
        return isinstance(target, str) and target.endswith("_") and not target.startswith("_")
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    if target in IN_PLACE_OPERATORS:
        return True
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def has_mutations(gm: fx.GraphModule) -> bool:
    """Whether any node of ``gm`` (or of a graph it calls) writes in place."""
    return any(mutates(n) for m in gm.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes)
