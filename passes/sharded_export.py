"""Sharded export: torch.export of a model sharded with FSDP2 (``fully_shard``).

torch.export cannot trace FSDP2's sharded parameters (DTensors: "Cannot access data
pointer of Tensor"), nor would its graph keep FSDP's hooks, which run the all-gathers
and reshards. So a sharded model that only export can capture (a transformers model:
forward takes ``**kwargs``) is exported as its own computation, as ``capture`` does
for torch.fx (``passes/capture.py``):

1. FSDP's forward hooks are set aside (``capture.fsdp_view``);
2. each sharded parameter is swapped, for the trace, for a stand-in of its full shape
   that holds one element (``capture.stand_in``, naming the real one; one per tied
   parameter, in the dtype a ``MixedPrecisionPolicy`` gathers it in): export sees the
   gathered model and nothing of its size is allocated;
3. each sharded submodule's call is bracketed by the custom ops
   ``mbcompile::fsdp_unit_enter`` / ``fsdp_unit_exit`` (forward hooks on the unit, which
   first cast the arguments as FSDP's pre-forward does), which export records as it
   records any op; a unit called with no tensor, or returning none, is refused;
4. after export, each such op becomes the Python marker ``fsdp_unit_enter(unit, *values)``
   the fx path writes, and each parameter is read where first used, so every later
   pass, and the torch.distributed backend that runs FSDP's pre- and post-forward in
   their place (``execution/fsdp.py``), sees one form.

Before (``fully_shard`` on each ``LlamaDecoderLayer`` and on the model)::

    model.model.layers[0].self_attn.q_proj.weight     # DTensor, this rank's shard

After (``sharded_export(model, units, export)``)::

    enter = fsdp_unit_enter('model.layers.0', hidden, cos, sin, ...)
    linear = torch.ops.aten.linear.default(getitem, model_layers_0_self_attn_q_proj_weight)
    exit_ = fsdp_unit_exit('model.layers.0', add_3)

where ``model.layers.0.self_attn.q_proj.weight`` is the stand-in.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import CaptureResult, fsdp_view, gathered_dtypes, stand_in
from .errors import CaptureError
from .ops import fsdp_unit_enter, fsdp_unit_exit
from .output_spec import through_leaves

__all__ = ["sharded_export"]


@functools.cache
def _marker_ops() -> dict[Any, Callable[..., Any]]:
    """The custom ops export records for the markers, each mapped to its Python marker.

    Defined on first use, not at import: registering a custom op loads torch.library's
    machinery, which a model that is never sharded does not need. Each op is the
    identity (a copy, as a custom op may not return its input), with its gradient
    passed straight through, so the analysis' fake probes can differentiate the graph.
    """
    ops: dict[Any, Callable[..., Any]] = {}
    for marker in (fsdp_unit_enter, fsdp_unit_exit):

        @torch.library.custom_op(f"mbcompile::{marker.__name__}", mutates_args=())
        def op(unit: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
            return [v.clone() for v in values]

        @op.register_fake
        def _(unit: str, values: list[torch.Tensor]) -> list[torch.Tensor]:
            return [torch.empty_like(v) for v in values]

        def backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[None, list[torch.Tensor]]:
            return None, list(grads)

        op.register_autograd(backward)
        ops[getattr(torch.ops.mbcompile, marker.__name__).default] = marker
    return ops


def _through(op_name: str, unit: str, value: Any) -> Any:
    """``value`` with its tensor leaves passed through the marker op ``op_name``.

    A unit called with no tensor, or returning none, is refused: its marker would read
    no value and be read by none, so nothing would keep it in the loop's body beside the
    unit's computation, and its all-gather or reshard would run at the wrong place.
    """
    def call(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not tensors:
            what = "called with no tensor argument" if op_name.endswith("enter") else \
                "returns no tensor"
            raise CaptureError(
                f"{unit!r}, sharded with fully_shard on its own, is {what}; mbcompile runs "
                "each unit's FSDP all-gather and reshard where its tensors enter and leave "
                "it. Fix: leave its parameters to the unit around it (do not fully_shard it "
                "separately), or pass it the tensor it works on")
        return getattr(torch.ops.mbcompile, op_name)(unit, tensors)

    return through_leaves(value, torch.Tensor, call)


@contextlib.contextmanager
def _bracketed(units: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
    """Every unit but the root calls the enter op on its arguments and the exit op on its
    output, for as long as the block runs (the root's hooks are the runtime's own).

    Each unit's arguments, and the root's, are first cast as FSDP's pre-forward casts them
    under a ``MixedPrecisionPolicy`` (floating tensors to its ``param_dtype``): export
    bakes the dtypes it traces into the graph, so it must trace the ones the step sees.
    """
    _marker_ops()
    handles = []
    for name, module in units:
        state = module._get_fsdp_state()
        if not name:
            def cast(_: nn.Module, args: Any, kwargs: Any, state: Any = state) -> Any:
                return state._cast_forward_inputs(args, kwargs)

            handles.append(module.register_forward_pre_hook(cast, with_kwargs=True,
                                                            prepend=True))
            continue

        def enter(_: nn.Module, args: Any, kwargs: Any, name: str = name,
                  state: Any = state) -> Any:
            return _through("fsdp_unit_enter", name, state._cast_forward_inputs(args, kwargs))

        def leave(_: nn.Module, args: Any, output: Any, name: str = name) -> Any:
            return _through("fsdp_unit_exit", name, output)

        # first and last of the unit's hooks, as FSDP's own all-gather and reshard are
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True,
                                                        prepend=True))
        handles.append(module.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _stand_ins(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> Iterator[None]:
    """Every sharded parameter swapped for its stand-in while the block runs, in the dtype
    FSDP gathers it in: export bakes dtypes into the graph (``x.to(input_dtype)``)."""
    from torch.distributed.tensor import DTensor

    dtypes = gathered_dtypes(units)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    made: dict[int, nn.Parameter] = {}  # a tied parameter has one stand-in, as one tensor
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                full = f"{name}.{attr}" if name else attr
                swapped.append((module, attr, param))
                if id(param) not in made:
                    made[id(param)] = stand_in(param, model, full, dtypes.get(id(param)))
                module._parameters[attr] = made[id(param)]
    try:
        yield
    finally:
        for module, attr, param in swapped:
            module._parameters[attr] = param


def _as_fx_writes_it(gm: fx.GraphModule) -> None:
    """The graph in the form ``capture`` gives: each recorded marker op becomes the Python
    marker (the same unit name, its tensors as separate arguments, read back by index as
    before), and each parameter is read where it is first used, not at the top where
    export unlifts them all: the backend reads a sharded one there, inside its unit's
    all-gather (``execution/fsdp.py``)."""
    ops = _marker_ops()
    # moving a get_attr leaves its users where they are: one order serves every move
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in ops:
            unit, values = node.args
            node.target = ops[node.target]
            node.args = (unit, *values)
        elif node.op == "get_attr" and node.users:
            min(node.users, key=order.__getitem__).prepend(node)
    gm.graph.lint()
    gm.recompile()


def sharded_export(model: nn.Module, units: Sequence[tuple[str, nn.Module]],
                   export: Callable[[nn.Module], CaptureResult]) -> CaptureResult:
    """``export(model)`` on the sharded ``model`` (its FSDP2 ``units``, the root first):
    a graph of stand-ins and unit markers, as ``capture`` makes for torch.fx."""
    with fsdp_view(model, units), _stand_ins(model, units), _bracketed(units):
        captured = export(model)
    _as_fx_writes_it(captured.graph_module)
    return captured
