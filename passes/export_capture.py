"""Capture pass, export flavour: ``torch.export`` with a dynamic batch dimension.

``torch.fx.symbolic_trace`` cannot trace HuggingFace ``transformers`` 5 models
(nor any forward with data-dependent Python it cannot see through);
``torch.export.export`` can, into a training-IR graph of a few dozen ATen ops
(``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss``, ``aten.sym_size``, ...). This pass turns the
exported program into the same thing ``capture`` gives: a ``GraphModule`` with
one placeholder per ``forward`` parameter, flat outputs, and an ``OutputSpec``
that rebuilds the model's own output type (``CausalLMOutputWithPast``, a dict, ...).

Before (``GPT2LMHeadModel``; ``forward(input_ids, cache, attention_mask, ..., labels, ...)``)::

    out = model(input_ids=ids, attention_mask=mask, labels=labels)   # CausalLMOutput...

After (``export_capture(model, example, in_dims)``)::

    def forward(self, input_ids, cache, attention_mask, ..., labels, use_cache, ...):
        sym_size_int = torch.ops.aten.sym_size.int(attention_mask, 0)     # the batch size
        view = torch.ops.aten.view.default(input_ids, [-1, 8])
        embedding = torch.ops.aten.embedding.default(self.lm_head.weight, view)
        ...
        return (cross_entropy_loss, view_23)     # output_spec rebuilds CausalLMOutput(loss, logits)

Steps:

1. export with the batch dim of every batched tensor input marked
   ``torch.export.Dim("batch")`` (one symbol shared by all), ``use_cache=False``
   when the call leaves it unset (as an argument when forward has that switch, else
   on the model's configs for the duration of the export), and the example batch
   grown to 2 samples if it has fewer (export specialises sizes 0 and 1);
2. ``ep.module()`` unlifts parameters and buffers back into attributes: they
   are the user's own tensors, so gradients land in the user's ``.grad``;
3. the graph is copied into a plain one: placeholders renamed to forward's
   parameters in order (non-tensor ones are fixed at compile time, as with
   ``capture``'s ``concrete_args``), the input-guard call and the metadata
   assertions export adds dropped (mbcompile checks inputs itself), every
   ``get_attr`` resolved on the user's model first;
4. the output spec comes from export's pytree spec, so ``ModelOutput``
   dataclasses, dicts and tuples come back as the model returns them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.fx._pytree as fx_pytree
from torch.utils import _pytree as pytree

from .autocast_regions import autocast_entered
from .capture import CaptureResult, effects_as_outputs
from .code_reach import reached_code
from .custom_functions import checked_in_export
from .errors import CaptureError
from .export_autograd import autograd_state_refused
from .export_errors import SPECIALISED, export_error
from .export_hooks import backward_hooks_refused, global_hooks_refused, tensor_hooks_refused
from .export_losses import layers_export_refuses, losses_read_values_refused
from .export_shapes import export_kwargs, has_tensor
from .export_writes import TensorWrites, export_warning_dropped, refuse_tensors
from .forward_modes import (
    detach_no_grad_regions,
    differentiation_refused,
    inference_mode_as_no_grad,
)
from .generators import generators_made_refused, generators_of
from .guards import recorded_reads, unwritten
from .hf_cache import cache_off
from .keyword_view import keyword_view
from .output_spec import flatten_output
from .python_state import python_state_kept
from .root_hooks import root_hooks_watched
from .side_effects import prints_recorded, rewiring_refused
from .slot_guards import slot_guards
from .state_updates import has_mutations, mutates

__all__ = ["EXPORT_ASSERTIONS", "export_capture"]

#: ATen ops export inserts to check metadata and symbolic ranges: no values, dropped.
EXPORT_ASSERTIONS = frozenset({
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_async.default,
})


class _Leaf:
    """A marker standing for one flat input or output while specs are unflattened."""

    def __init__(self, index: int, path: tuple[Any, ...] = ()) -> None:
        self.index = index
        self.path = path

    def __repr__(self) -> str:
        return f"_Leaf({self.index}, {self.path})"


def _export(model: torch.nn.Module, kwargs: dict[str, Any], dynamic: Any, strict: bool,
            after: TensorWrites | None = None) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` called with ``kwargs``, without fake tensors'
    dispatch cache: ``_export(model, {"input_ids": ids}, {"input_ids": {0: batch}}, False)``.

    With a symbolic dim (the batch dim always is) an op's cache entry is kept in the
    export's own shape environment, thrown away with it, and making an entry builds the
    op's output a second time to check it: on ``bench_dynamic.py``'s GPT-2, a third of
    export's time (1.5 s of CPU against 1.0 s without), for the few hits one trace
    has. The cache only replays outputs it checked: the graph has the same ops (the
    numbering of a node's name may differ: ``benchmarks/RESULTS.md``, "Where compile()'s
    fixed cost goes"). With ``after``, the program returns ``(output, after())``: the
    tensors forward wrote into Python state (``export_writes.py``).
    """
    from torch._dynamo import config  # imported with torch.export already

    # example inputs made under torch.inference_mode: export fakes only normal tensors
    kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.clone() if t.is_inference() else t,
                                  kwargs)
    with config.patch(fake_tensor_cache_enabled=False), export_warning_dropped():
        return torch.export.export(keyword_view(model, list(kwargs), after), (), kwargs,
                                   dynamic_shapes=dynamic, strict=strict)


def _resolve(root: torch.nn.Module, fallback: torch.nn.Module, target: str) -> Any:
    """``root.<target>`` if it exists (the user's own tensor), else the exported one."""
    for module in (root, fallback):
        obj: Any = module
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise CaptureError(f"exported graph reads {target!r}, which neither the model nor the "
                       "exported program has")


def _own_generator(value: Any, owned: Sequence[tuple[torch.Generator, torch.Tensor]]) -> Any:
    """The model's own generator where ``value`` is export's copy of it (``self.g`` made in
    ``__init__``: export lifts a copy, whose draws would leave the model's where it was):
    the one whose state the copy has, where exactly one has it; else ``value``."""
    if not isinstance(value, torch.Generator) or any(value is g for g, _ in owned):
        return value
    state = value.get_state()
    same = [g for g, s in owned if torch.equal(s, state)]
    return same[0] if len(same) == 1 else value


def _input_getter(graph: fx.Graph, node: fx.Node, path: Sequence[Any]) -> fx.Node:
    """Nodes that pick the leaf at ``path`` out of a nested input."""
    for key in path:
        if isinstance(key, pytree.SequenceKey):
            node = graph.call_function(operator.getitem, (node, key.idx))
        elif isinstance(key, pytree.MappingKey):
            node = graph.call_function(operator.getitem, (node, key.key))
        elif isinstance(key, pytree.GetAttrKey):
            node = graph.call_function(getattr, (node, key.name))
        else:
            raise CaptureError(f"cannot map input path element {key!r} of an exported graph")
    return node


def _read_len_symbolically(model: torch.nn.Module, kwargs: dict[str, Any],
                           dynamic: dict[str, Any], example: Mapping[str, Any], name: str
                           ) -> torch.export.ExportedProgram | None:
    """The program traced by TorchDynamo (``strict=True``) where the Python-level trace
    turned the batch size into a constant; None where that does not capture it either.

    Python's ``len(x)`` must return an int, so the Python-level trace (``strict=False``)
    reads a batched tensor's length as the example's batch size, and export refuses the
    specialised batch dim. transformers' contrastive losses (CLIP, ALIGN, OWL-ViT, ...)
    build their targets so: ``cross_entropy(logits, torch.arange(len(logits)))``.
    TorchDynamo reads the bytecode and keeps ``len(x)`` the symbol ``x.size(0)``, so the
    graph holds ``arange(sym_size(x, 0))``, as if the code had said ``x.size(0)``; the
    batch analysis then decides as for any batch size read off a shape: a shape is kept,
    a coupled loss runs at the full batch in a two-phase step, and so does a value in
    per-sample work (refused with ``coupling="reject"``). A constant in the code
    (``x.view(32, -1)``, ``range(len(x))``) specialises under both traces: refused.

    The Python-level recorders (attribute reads and writes, hooks, differentiation) ran
    on the first trace, which went through the whole forward; TorchDynamo cannot trace
    through them, so this trace runs without them.
    """
    try:
        with python_state_kept(model), cache_off(model, example), checked_in_export(name), \
                torch.enable_grad(), _quiet_dynamo():
            return _export(model, kwargs, dynamic, strict=True)
    except CaptureError:  # a custom Function's check: about the model, reported as it is
        raise
    except Exception:  # noqa: BLE001 - the first trace's error is the one to report
        return None


@contextlib.contextmanager
def _quiet_dynamo() -> Iterator[None]:
    """TorchDynamo logs a failed guard at ERROR level before export raises; the failure is
    reported once, as the first trace's error, so its log stays silent meanwhile."""
    logger = logging.getLogger("torch._guards")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def _changes_state(node: fx.Node) -> bool:
    """Kept even when unused: fx's own impure nodes, in-place ops, higher-order ops."""
    return node.is_impure() or mutates(node)


def _view_as_reshape(node: fx.Node) -> None:
    """Export's ``aten.view`` becomes ``aten.reshape``: the view is only valid for the strides
    export traced with.

    Export spells ``x.reshape(...)`` (and a ``.contiguous()`` it finds a no-op) as a plain
    ``view`` when the tensor it traced happened to be contiguous, and that depends on the
    kernel its fake mode picked. T5's attention output, ``sdpa(...).transpose(1, 2)
    .reshape(B, T, -1)``, was traced with the strides of CPU flash attention, so the graph
    views a transposed tensor that the math kernel (what runs with a float mask that needs
    grad) leaves non-contiguous: the captured graph fails on fake and real tensors alike.
    ``reshape`` is the same op wherever ``view`` works (no copy) and copies where eager's
    own ``reshape`` does; after functionalization (or with no in-place op to begin with)
    nothing writes through the alias, so the values are equal.
    """
    if node.target is torch.ops.aten.view.default:
        node.target = torch.ops.aten.reshape.default


def _differentiable_copy(graph: fx.Graph, node: fx.Node, env: Mapping[fx.Node, fx.Node]
                         ) -> fx.Node:
    """``aten.copy(self, src)`` spelled as ops autograd can differentiate.

    Functionalization writes ``x[:, 1:] = y`` and ``x.copy_(y)`` as ``copy(x, y)``: src's
    values broadcast into a fresh tensor of self's shape, dtype and device. ATen's
    ``copy`` has no derivative, so a step through one whose src needs grad fails in its
    backward. ``clone(expand_as(_to_copy(src), self))`` computes the same values (the
    conversion only where dtype or device differ), and its gradient is src's.
    """
    dst, src = (env[a] if isinstance(a, fx.Node) else a for a in node.args[:2])
    want = node.meta.get("val")
    have = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    lines = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
    value = src
    if not (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor)
            and (want.dtype, want.device) == (have.dtype, have.device)):
        value = graph.call_function(torch.ops.aten._to_copy.default, (value,),
                                    {"dtype": getattr(want, "dtype", None),
                                     "device": getattr(want, "device", None)})
        value.meta = dict(lines)
    value = graph.call_function(torch.ops.aten.expand_as.default, (value, dst))
    value.meta = dict(lines)
    out = graph.call_function(torch.ops.aten.clone.default, (value,))
    out.meta = dict(node.meta)  # the source line survives the rewrite
    return out


def export_capture(model: torch.nn.Module, example: Mapping[str, Any],
                   in_dims: Mapping[str, int | None], *,
                   fx_error: BaseException | None = None,
                   symbolic: Mapping[str, Mapping[int, Any]] | None = None) -> CaptureResult:
    """Capture ``model`` with ``torch.export`` into a graph with flat outputs.

    ``example`` maps every ``forward`` parameter (in signature order) to its
    example value, ``in_dims`` each to its batch dim (None: unbatched).
    Placeholders follow ``example``'s order; non-tensor values are fixed in
    the graph and returned as ``concrete_args``. ``fx_error``, when symbolic
    tracing failed first, is quoted if export fails too. ``symbolic``: the non-batch dims
    that vary between calls, by input (``mbcompile/dynamic_shapes.py``).
    """
    names = list(example)
    kwargs, dynamic = export_kwargs(model, example, in_dims, symbolic)
    owned = [(g, g.get_state()) for g in generators_of(model)]  # export draws from copies
    specialised: BaseException | None = None
    try:
        name = type(model).__name__
        backward_hooks_refused(model, name, fx_error)
        global_hooks_refused(name, fx_error)
        layers_export_refuses(model, name, fx_error)
        concrete = {n: v for n, v in example.items() if not has_tensor(v)}
        # what forward wrote is read after the inner block has put back its own switches
        with python_state_kept(model, concrete) as snapshot, prints_recorded() as prints:
            writes: dict[Any, Any] = {}  # export puts back what forward assigned: kept here
            tensor_writes: TensorWrites | None = TensorWrites(snapshot, prints)  # read in the trace
            with cache_off(model, example), recorded_reads(model, name, writes=writes) as \
                    guards, \
                    checked_in_export(name), inference_mode_as_no_grad(), \
                    tensor_hooks_refused(name), autograd_state_refused(name), \
                    differentiation_refused(name, fx_error), \
                    losses_read_values_refused(name, fx_error), \
                    root_hooks_watched(model, name, fx_error), \
                    torch.enable_grad(), reached_code(model, snapshot.add_slot, name) as reach, \
                    autocast_entered() as regions:
                try:
                    program = _export(model, kwargs, dynamic, strict=False, after=tensor_writes)
                except Exception as exc:
                    # export traced the whole forward before it refused the specialised
                    # batch dim: the recorders above still judge that trace when it ends
                    if not SPECIALISED.search(str(exc)):
                        raise
                    specialised = exc
            changes = snapshot.changes() + snapshot.unseen_assignments(writes)
            rewired = snapshot.rewired()
        rewiring_refused(rewired, name)
        # a size is symbolic in the trace; a tensor is an output of the one traced (not of
        # the TorchDynamo trace taken where that one specialised the batch)
        refuse_tensors(changes, prints, name, fx_error, tensors=specialised is not None)
        read = slot_guards(reach.slots, name, model)  # the globals as the user holds them again
        if specialised is not None:
            tensor_writes = None
            program = _read_len_symbolically(model, kwargs, dynamic, example, name)
            if program is None:
                raise export_error(model, specialised, fx_error, in_dims) from specialised
    except CaptureError:
        raise
    except Exception as exc:  # any export failure becomes one clear error
        raise export_error(model, exc, fx_error, in_dims) from exc
    if has_mutations(program.graph_module):
        # In-place writes, grad-mode and autocast regions: functionalize, so that ops become
        # values, state writes one final copy_ each (the state-updates pass lifts those) and
        # autocast regions explicit casts. Lowering inlines a no-grad region as if grad were
        # on: what it reads is detached first, which keeps it no-grad.
        detach_no_grad_regions(program.graph_module)
        try:
            program = program.run_decompositions({})
        except Exception as exc:  # export's own lowering (a written weight another layer ties)
            raise export_error(model, exc, fx_error, in_dims) from exc
    exported = program.module()
    old = exported.graph

    # Flat inputs of the exported graph, mapped to (forward parameter, path inside it).
    in_spec = exported._in_spec
    markers = {n: pytree.tree_map_with_path(lambda p, _, n=n: _Leaf(names.index(n), p),
                                            kwargs[n]) for n in kwargs}
    flat_inputs = fx_pytree.tree_flatten_spec(((), markers), in_spec)  # by key, in its order

    graph = fx.Graph()
    params = inspect.signature(model.forward).parameters
    new_inputs: dict[str, fx.Node] = {}
    defaults = [params[n].default if n in params else inspect.Parameter.empty for n in names]
    for i, name in enumerate(names):  # a default only where every later one has one too
        if all(d is not inspect.Parameter.empty for d in defaults[i:]):
            new_inputs[name] = graph.placeholder(name, default_value=defaults[i])
        else:
            new_inputs[name] = graph.placeholder(name)
    env: dict[fx.Node, fx.Node] = {}
    old_inputs = [n for n in old.nodes if n.op == "placeholder"]
    if len(old_inputs) != len(flat_inputs):
        raise CaptureError(f"exported graph of {type(model).__name__} has {len(old_inputs)} "
                           f"inputs where {len(flat_inputs)} were expected")
    for node, leaf in zip(old_inputs, flat_inputs):
        env[node] = _input_getter(graph, new_inputs[names[leaf.index]], leaf.path)
        env[node].meta = dict(node.meta)
    root: dict[str, Any] = {}
    output: fx.Node | None = None
    for node in old.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            output = node
            continue
        if node.op == "call_module" and node.target == "_guards_fn":
            continue  # export's input guards: mbcompile checks the inputs itself
        if node.op == "call_function" and node.target in EXPORT_ASSERTIONS:
            continue
        if node.op in ("get_attr", "call_module"):
            root[node.target] = _own_generator(_resolve(model, exported, node.target), owned)
        if node.target is torch.ops.aten.copy.default and not node.kwargs.get("non_blocking"):
            env[node] = _differentiable_copy(graph, node, env)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
        _view_as_reshape(env[node])
    assert output is not None

    # Outputs: flat leaves, and the spec that rebuilds the model's own output type.
    flat_out = list(output.args[0])
    structured = pytree.tree_unflatten([_Leaf(i) for i in range(len(flat_out))],
                                       exported._out_spec)

    def copied(leaf: _Leaf) -> Any:  # a flat output as the new graph has it
        value = flat_out[leaf.index]
        return fx.node.map_arg(value, lambda n: env[n]) if isinstance(value, fx.Node) else value

    written: list[Any] = []
    if tensor_writes is not None:
        structured, extra = structured
        written = [copied(leaf) for leaf in extra]
    leaves: list[Any] = []
    spec = flatten_output(structured, leaves, lambda v: isinstance(v, _Leaf))
    graph.output(tuple(copied(leaf) for leaf in leaves))
    if tensor_writes is not None:
        changes, prints = tensor_writes.merged(changes, prints, written)
    effects = effects_as_outputs(graph, changes, prints, type(model).__name__)
    # Getters the dropped guards read go (placeholders stay); what changes state does not:
    # export puts a torch.no_grad() region that updates buffers into a higher-order op whose
    # result nobody reads, and dropping it would silently skip the update.
    graph.eliminate_dead_code(is_impure_node=_changes_state)
    graph.lint()
    gm = fx.GraphModule(root, graph, type(model).__name__)
    generators_made_refused(gm, [*generators_of(model), *(s.owner.get(s.key) for s in reach.slots)],
                            type(model).__name__)
    guards = (*unwritten((*guards, *read), effects.written, effects.keys_set()),
              *effects.guards)
    return CaptureResult(gm, spec, concrete, "export", guards, effects, tuple(regions))
