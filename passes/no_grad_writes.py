"""No-grad writes pass: a tensor written in place under no-grad keeps its gradient.

Eager's meaning of an in-place write inside ``torch.no_grad()`` into a tensor that
requires grad (a straight-through clip of an activation)::

    h = self.a(x)
    with torch.no_grad():
        h.clamp_(-0.1, 0.1)          # h's values change; its grad_fn stays layer a's
    return self.o(h)                 # the gradient reaches layer a, as if not clamped

The forward-modes pass detaches what a no-grad region reads, so the written value comes
back detached and layer ``a`` would get no gradient. Before it, every later use of the
written value (outside the region) reads it with the gradient of the tensor as it was
before the region, in ops every pass and capture knows::

    z = nan_to_num(sub(h, detach(h)))  # before the region: exactly 0, gradient 1 to h
    clamp_ = h.clamp_(-0.1, 0.1)       # then detached by the forward-modes pass
    st = add(detach(clamp_), z)        # clamp_'s value exactly, gradient straight to h
    o = self.o(st)

``nan_to_num`` keeps the value where ``h`` is infinite (``inf - inf``). A write that
changes the tensor's shape (``t_``, ``squeeze_``) cannot be read so, and is refused.

- ``torch.fx``: the writes are the no-grad nodes ``fx_writes.py`` made values
  (``straight_through_writes``); a write into the caller's input runs on its clone, made
  with grad on.
- ``torch.export``: a no-grad region's body writes into its argument, a value forward
  computed (its output is the written tensor, or, written through a view, the argument
  itself is read after it) (``straight_through_region``). A write into the model's state
  or an input is left to the state-updates pass.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError
from .facts import GRAD_ENABLED, SHAPES
from .fx_writes import is_write, written_tensor
from .sources import source_line

__all__ = ["straight_through_region", "straight_through_writes"]

_aten = torch.ops.aten


def _grad_on(node: fx.Node) -> bool:
    return node.op == "output" or node.meta.get(GRAD_ENABLED, True)


def _refused(node: fx.Node) -> CaptureError:
    return CaptureError(
        f"forward changes the shape of a tensor that requires grad in place inside a "
        f"no-grad region ({source_line(node)}); eager keeps its gradient, which the "
        "compiled step cannot give a value of another shape. Fix: compute the new value out "
        "of place and keep the gradient yourself: h = h + (new - h).detach()")


def _kept(graph: fx.Graph, before: fx.Node, root: fx.Node, meta: dict[str, Any]
          ) -> fx.Node:
    """``nan_to_num(root - detach(root))``, put before ``before``: zeros whose gradient
    goes to ``root`` as it is there."""
    with graph.inserting_before(before):
        same = graph.call_function(_aten.detach.default, (root,))
        zero = graph.call_function(_aten.sub.Tensor, (root, same))
        kept = graph.call_function(_aten.nan_to_num.default, (zero, 0.0, 0.0, 0.0))
    for node in (same, zero, kept):
        node.meta = {**meta, GRAD_ENABLED: True}
    return kept


def _through(graph: fx.Graph, after: fx.Node, value: fx.Node, kept: fx.Node,
             meta: dict[str, Any]) -> fx.Node:
    """``detach(value) + kept``, put after ``after``: ``value``'s value, ``kept``'s
    gradient."""
    with graph.inserting_after(after):
        same = graph.call_function(_aten.detach.default, (value,))
    with graph.inserting_after(same):
        out = graph.call_function(_aten.add.Tensor, (same, kept))
    for node in (same, out):
        node.meta = {**meta, GRAD_ENABLED: True}
    return out


# --------------------------------------------------------------------------- torch.fx


def _may_require_grad(node: fx.Node) -> bool:
    """A tensor made outside every no-grad region that can require grad: an input (or
    the clone ``fx_writes.py`` writes into for it), or a value forward computed; not the
    model's state (a buffer or frozen parameter does not require grad, and a trained
    parameter written in place is refused by the state-updates pass)."""
    info = node.meta.get(SHAPES)
    state = node.op == "get_attr" or (node.target == "clone" and bool(node.args) and
                                      getattr(node.args[0], "op", None) == "get_attr")
    return (not state and node.meta.get(GRAD_ENABLED, True)
            and getattr(info, "is_tensor", False)
            and (info.dtype.is_floating_point or info.dtype.is_complex))


def straight_through_writes(graph: fx.Graph) -> int:
    """Make every use outside a no-grad region of a value written in place inside it
    read the value with the written tensor's gradient (fx capture, shapes known).
    Returns how many writes were rewired."""
    roots: dict[fx.Node, fx.Node] = {}  # a no-grad write -> the tensor it writes
    for node in list(graph.nodes):
        if node.meta.get(GRAD_ENABLED, True) or not is_write(node):
            continue
        base = written_tensor(node)
        if not isinstance(base, fx.Node):
            continue
        root = roots.get(base, base)
        if _may_require_grad(root):
            roots[node] = root
    kept: dict[fx.Node, fx.Node] = {}
    done = 0
    for write, root in roots.items():
        readers = [u for u in write.users if _grad_on(u)]
        if not readers:
            continue
        a, b = write.meta.get(SHAPES), root.meta.get(SHAPES)
        if (getattr(a, "shape_a", None), getattr(a, "shape_b", None)) != (b.shape_a, b.shape_b):
            raise _refused(write)
        if root not in kept:  # before the first write into it: the value with its gradient
            first = next(w for w, r in roots.items() if r is root)
            kept[root] = _kept(graph, first, root, root.meta)
        value = _through(graph, write, write, kept[root], write.meta)
        for reader in readers:
            reader.replace_input_with(write, value)
        done += 1
    return done


# --------------------------------------------------------------------------- torch.export


def _aliased_input(node: Any) -> Any:
    """The input ``node``'s value may share storage with (a view's base, an in-place or
    ``out=`` op's written tensor), or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return _aliased_input(node.args[0]) and node.args[0]
    schema = getattr(node.target, "_schema", None)
    out = schema.returns[0].alias_info if schema is not None and schema.returns else None
    if out is None:
        return None
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.before_set == out.before_set:
            return node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
    return None


def _written_inputs(body: fx.Graph) -> dict[fx.Node, fx.Node]:
    """The placeholders of a region's ``body`` that it writes into, each with the op that
    writes (directly or through a view)."""
    found: dict[fx.Node, fx.Node] = {}
    for node in body.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            base = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            while _aliased_input(base) is not None:
                base = _aliased_input(base)
            if isinstance(base, fx.Node) and base.op == "placeholder":
                found.setdefault(base, node)
    return found


def _written_chain(value: Any) -> fx.Node | None:
    """The placeholder that ``value`` (a body output) is, after in-place writes only."""
    while isinstance(value, fx.Node) and value.op == "call_function":
        schema = getattr(value.target, "_schema", None)
        out = schema.returns[0].alias_info if schema is not None and schema.returns else None
        if out is None or not out.is_write:
            return None
        value = _aliased_input(value)
    return value if isinstance(value, fx.Node) and value.op == "placeholder" else None


def straight_through_region(module: fx.GraphModule, region: fx.Node) -> None:
    """Before export's no-grad ``region`` (a ``wrap_with_set_grad_enabled(False, body,
    *args)`` node of ``module``'s graph) has its arguments detached: the uses after it of
    what it wrote into an argument that requires grad read it with that argument's
    gradient."""
    graph = module.graph
    body = module.get_submodule(str(region.args[1].target)).graph
    inputs = [n for n in body.nodes if n.op == "placeholder"]
    written = _written_inputs(body)
    if not written:
        return
    results = list(next(n for n in body.nodes if n.op == "output").args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    outputs = {i: [u for u in region.users if u.target is operator.getitem and u.args[1] == i]
               for i in range(len(results))}
    for placeholder, writer in written.items():
        arg = region.args[2 + inputs.index(placeholder)]
        val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())):
            continue  # (export's values do not say whether they require grad)
        bases = [arg]
        while _aliased_input(bases[-1]) is not None:
            bases.append(_aliased_input(bases[-1]))
        if bases[-1].op == "placeholder":  # the model's state or an input: not followed
            continue
        if any(order.get(u, -1) > order[region] for b in bases[1:] for u in b.users) \
                and _from_parameters(arg):  # a view's base sees the write too
            raise _refused_view(writer)
        values = [g for i, r in enumerate(results) if _written_chain(r) is placeholder
                  for g in outputs[i]] + [arg]
        kept = None
        for value in values:
            readers = [u for u in value.users if order.get(u, -1) > order[region]]
            if tuple(getattr(value.meta.get("val"), "shape", val.shape)) != tuple(val.shape):
                raise _refused(writer)
            if not readers:
                continue
            kept = kept or _kept(graph, region, arg, arg.meta)
            through = _through(graph, value if value is not arg else region, value, kept,
                               arg.meta)
            for reader in readers:
                reader.replace_input_with(value, through)


def _from_parameters(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a parameter (export names them ``p_...``)."""
    seen, todo = set(), [node]
    while todo:
        node = todo.pop()
        if node.op == "placeholder" and node.name.startswith("p_"):
            return True
        fresh = [n for n in node.all_input_nodes if n not in seen]
        seen.update(fresh)
        todo += fresh
    return False


def _refused_view(node: fx.Node) -> CaptureError:
    return CaptureError(
        f"forward writes in place inside a no-grad region into a view of a tensor that "
        f"requires grad, and reads that tensor after it ({source_line(node)}); eager keeps "
        "its gradient, which the compiled step would lose. Fix: compute the new value out "
        "of place and keep the gradient yourself: h = h + (new - h).detach()")
