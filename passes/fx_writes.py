"""Writes-as-values pass: in a torch.fx capture, an in-place write reaches what reads after it.

torch.fx records ``w.mul_(2)`` as a node that nothing reads, and every later use of ``w``
reads ``w``'s own node. The microbatch rewrite follows values, so it would drop the write:
refused when the value written is batched, silently lost when it is not (an EMA of a
frozen copy, ``w = self.l.weight * 1; w.mul_(2)``). torch.export functionalizes every
write; this pass does what an fx graph needs of that, before any other pass sees it:

- a write into a tensor forward made (not a view of anything) stays in place, and what
  reads that tensor after the write reads the write's node instead (an in-place op
  returns the tensor it wrote, so the values are the same);
- a write into the model's state (a buffer, a frozen parameter) or into an input runs on a
  clone of it, later reads of it read that, and one ``copy_`` at the end of the graph
  writes the last value back: ``passes/state_updates.py`` lifts it to an output written
  once per step, after the step, as export's functionalized graphs are;
- a write through a view (``x[:, 0].mul_(2)``, ``p.detach().add_(1)``), into a tensor a
  view was taken of, or by ``x[i] = v`` is refused when anything can see it, naming the
  line: torch.export captures those (``capture="auto"`` falls back to it).

Before (``with torch.no_grad(): self.t.weight.mul_(0.9).add_(0.1 * self.l.weight)``)::

    t_weight = self.t.weight
    mul_ = t_weight.mul_(0.9)
    add_ = mul_.add_(mul)                 # nothing reads it
    t_weight_1 = self.t.weight            # reads the weight before the write
    linear = torch._C._nn.linear(x, t_weight_1, ...)

After::

    t_weight = self.t.weight
    clone = t_weight.clone()
    mul_ = clone.mul_(0.9)
    add_ = mul_.add_(mul)
    linear = torch._C._nn.linear(x, add_, ...)
    copy_ = t_weight.copy_(add_)          # lifted: written back once, after the step
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from .errors import CaptureError
from .facts import GRAD_ENABLED
from .sources import source_line
from .state_updates import IN_PLACE_OPERATORS

__all__ = ["aliases", "attribute_at", "is_write", "writes_as_values", "written_state",
           "written_tensor"]

_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "rename_", "retain_grad_"})

# ops whose result may share storage with their input: a write into either changes both
_ALIASING = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "transpose_", "t", "permute",
    "select", "narrow", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "getitem", "detach", "split", "chunk", "unbind", "diagonal", "as_strided", "unfold",
    "movedim", "moveaxis", "swapaxes", "swapdims", "real", "imag", "view_as_real",
    "view_as_complex", "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit",
    "__getitem__", "alias", "contiguous", "to", "type", "type_as", "float", "double", "half",
    "bfloat16", "long", "int", "bool", "cpu", "cuda", "requires_grad_", "getattr",
    "align_as", "rename", "refine_names", "indices", "values", "crow_indices", "col_indices",
    "squeeze_", "unsqueeze_", "t_", "as_strided_", "detach_", "resize_", "resize_as_"})


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def is_write(node: fx.Node) -> bool:
    """``x.mul_(2)``, ``x += y`` (fx's ``iadd``), ``x.__iadd__(y)``, ``x[i] = v``,
    ``torch.mul(a, 2, out=x)``: a call that changes the values of the tensor ``_written``
    returns (not ``x.requires_grad_()``, which changes what autograd records)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if isinstance(node.kwargs.get("out"), fx.Node):
        return True
    if node.op == "call_function":
        return node.target in IN_PLACE_OPERATORS or node.target is operator.setitem
    if not isinstance(node.args[0], fx.Node):
        return False
    name = _name(node)
    return (name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES) \
        or name == "__setitem__" or (
        name.startswith("__i") and name.endswith("__") and name != "__init__")


def written_tensor(node: fx.Node) -> Any:
    """The tensor a write changes: its ``out=``, or its first argument."""
    out = node.kwargs.get("out")
    return out if isinstance(out, fx.Node) else node.args[0]


def _is_setitem(node: fx.Node) -> bool:
    return node.target is operator.setitem or node.target == "__setitem__"


def _written_back(node: fx.Node) -> bool:
    """A ``copy_`` this pass put at the end: the last value of state or an input."""
    if node.target != "copy_" or node.users or node.args[0].op not in ("get_attr",
                                                                        "placeholder"):
        return False
    later = node.next
    while later.op != "output":
        if later.target != "copy_" or later.users:
            return False
        later = later.next
    return True


def _data_of(node: fx.Node) -> fx.Node | None:
    """``x`` of ``x.data`` (fx's ``getattr(x, "data")``): a write there writes ``x``."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2 \
            and node.args[1] == "data" and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def written_state(base: fx.Node) -> str | None:
    """The state (a buffer's or parameter's name) a write into ``base`` writes, if it is
    the state's own node or its ``.data``."""
    data = _data_of(base)
    node = base if data is None else data
    return str(node.target) if node.op == "get_attr" else None


def aliases(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with one of its inputs."""
    return node.op in ("call_method", "call_function") and _name(node) in _ALIASING


def _refused(node: fx.Node, why: str) -> CaptureError:
    return CaptureError(
        f"forward writes in place {why} ({source_line(node)}); torch.fx records the write "
        "but not what it changes, so the compiled step would lose it. Fix: compile with "
        "capture='auto' or capture='export' (torch.export turns the write into values), "
        "or use the out-of-place form and its result (x = x.mul(2), "
        "x = torch.where(mask, v, x))")


def _read_after(view: fx.Node, write: fx.Node, order: dict[fx.Node, int],
                skip: fx.Node | None = None) -> bool:
    """Whether ``view`` (or a view of it other than ``skip``) is read after ``write``: it
    would see the write."""
    return any(u is not skip and (order.get(u, -1) > order[write] or (
        aliases(u) and _read_after(u, write, order, skip))) for u in view.users)


def _read_later(tensor: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a node after ``write`` reads ``tensor`` itself."""
    return any(order.get(u, -1) > order[write] for u in tensor.users)


def _viewed(tensor: fx.Node) -> fx.Node:
    """What ``tensor`` may be a view of, through every op that may alias (itself if none)."""
    while aliases(tensor) and tensor.args and isinstance(tensor.args[0], fx.Node):
        tensor = tensor.args[0]
    return tensor


def _layer_reads_written(node: fx.Node, latest: dict[fx.Node, fx.Node], root: Any) -> None:
    """Refuse a layer kept as one call that holds state forward wrote before calling it: it
    would read the state as it was before the step (the write is written back after it).
    The state is compared by identity (a weight tied to another layer's)."""
    layer = root.get_submodule(str(node.target))
    held = {id(t) for t in (*layer.parameters(), *layer.buffers())}
    for tensor in latest:
        if tensor.op == "get_attr" and id(attribute_at(root, str(tensor.target))) in held:
            raise CaptureError(
                f"forward writes {tensor.target!r} in place and then calls {node.target!r}, "
                f"which reads it inside one call ({source_line(node)}); the compiled step "
                "would run that call on the value from before the write. Fix: compile the "
                "model itself (mbcompile traces into such a layer), or with capture='export'")


def attribute_at(root: Any, target: str) -> Any:
    """The tensor at a get_attr's dotted ``target`` under ``root``, or None. Read from the
    modules' own tables: while fx traces, ``Module.__getattr__`` returns proxies."""
    *path, name = target.split(".")
    for part in path:
        root = getattr(root, "_modules", {}).get(part)
    tables = (getattr(root, "_parameters", {}), getattr(root, "_buffers", {}),
              getattr(root, "__dict__", {}))
    return next((t[name] for t in tables if name in t), None)


def writes_as_values(graph: fx.Graph, root: Any) -> bool:
    """Make every in-place write of ``graph`` (an fx capture's, of the module ``root``) a
    value that what reads after it reads; returns whether the graph changed (its module's
    code is then stale). Raises
    ``CaptureError`` for a write whose effect cannot be followed as a value (through a
    view)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    tensor_of: dict[fx.Node, fx.Node] = {}  # a write's node -> the tensor it writes
    latest: dict[fx.Node, fx.Node] = {}  # a written tensor -> the node of its value now
    attrs: dict[str, fx.Node] = {}  # a get_attr's target -> its first node
    changed = False
    for node in list(graph.nodes):
        if node.op == "get_attr":  # fx makes one at every use: one node per state
            first = attrs.setdefault(str(node.target), node)
            if first is not node:
                node.replace_all_uses_with(latest.get(first, first))
                graph.erase_node(node)
                changed = True
                continue
        if node.op == "call_module" and latest:
            _layer_reads_written(node, latest, root)
        for arg in node.all_input_nodes:  # reads after a write read the written value
            now = latest.get(tensor_of.get(arg, arg))
            if now is not None and now is not arg:
                node.replace_input_with(arg, now)
                changed = True
        if not is_write(node) or not isinstance(written_tensor(node), fx.Node) or \
                _written_back(node):
            continue
        base = written_tensor(node)
        tensor = tensor_of.get(base, base)
        data = _data_of(tensor)
        if data is not None and data.op in ("get_attr", "placeholder"):
            tensor = data  # x.data.mul_(0.9): a write into x that autograd does not record
        if aliases(tensor):  # a view: the write changes what it views too
            viewed = _viewed(tensor)
            if viewed.op in ("get_attr", "placeholder") or aliases(viewed) or \
                    _read_after(viewed, node, order, skip=tensor):
                raise _refused(node, f"into {tensor.name!r}, a view of {viewed.name!r} "
                               "(read after the write, or the model's state or an input)")
        views = [u for m in (tensor, *(w for w, r in tensor_of.items() if r is tensor))
                 for u in m.users if aliases(u) and order.get(u, -1) < order[node]
                 and _read_after(u, node, order)]
        if views:
            raise _refused(node, f"into {tensor.name!r}, of which {views[0].name!r} is a view "
                           "read after the write")
        if node.target in IN_PLACE_OPERATORS and tensor.op not in ("get_attr", "placeholder") \
                and _read_later(base, node, order):
            # ``r = h; h += x`` then ``r`` read: a tensor sees the write, an int does not,
            # and the graph does not say which ``h`` is yet
            raise _refused(node, f"with {_name(node)} into {tensor.name!r}, which is read "
                           "again after it under another name")
        if _is_setitem(node):  # returns None: nothing can carry its value
            if _read_later(base, node, order) or tensor.op in ("get_attr", "placeholder"):
                raise _refused(node, f"by indexing into {tensor.name!r} (x[i] = v)")
            continue
        if tensor.op in ("get_attr", "placeholder") and tensor not in latest:
            with graph.inserting_before(node):  # the state's own tensor stays as it was
                clone = graph.call_method("clone", (base,))
            # the clone stands for the state or input itself, made outside every no-grad
            # region: written under no-grad, an input keeps its gradient (no_grad_writes.py)
            clone.meta = {**node.meta, GRAD_ENABLED: True}
            node.replace_input_with(base, clone)
            tensor_of[clone] = tensor
            changed = True
        tensor_of[node], latest[tensor] = tensor, node
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    for tensor, value in latest.items():  # the last value, written back once (state_updates)
        if tensor.op in ("get_attr", "placeholder"):
            with graph.inserting_before(out):
                write = graph.call_method("copy_", (tensor, value))
            write.meta = dict(value.meta)
    return changed
