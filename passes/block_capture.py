"""Capturing a deep model by its first two layers: trace two, copy the second N-2 times.

``torch.export`` costs about 0.2 s of CPU per transformer layer, most of a 70B-shaped
model's compile-only. Its layers are the children of one ``nn.ModuleList``, each of one
class with the same parameter shapes, so their graphs are copies of each other:

1. a shallow copy of the model whose list holds the first two layers only (the user's
   model is not touched; parameters are shared) is captured;
2. its graph must hold the two layers as a chain of isomorphic blocks
   (``repeated_blocks.find_blocks``);
3. the second block's nodes are copied for layers 2 .. N-1, each reading the one before,
   its parameters the model's own (``model.layers.1.mlp.up_proj.weight`` ->
   ``model.layers.5.mlp.up_proj.weight``), its module path renamed likewise; the head
   reads the last layer.

``export_blocks.capture_once_per_block`` calls this for plans and for training, after
the checks that make the copies run what each layer computes. A model whose layers
differ by index is captured whole: where
``config.layer_types`` says so (sliding-window and full attention taking turns), where
the layers' submodules differ in class, or where a plain value the two-layer trace read
in the second layer (``self.is_sliding``, ``self.use_rope``: the capture's guards) holds
another value in a later one, which the copies would silently not see.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .capture import CaptureResult
from .guards import Guard
from .repeated_blocks import alike, find_blocks
from .same_code import helpers_alike

__all__ = ["MIN_LAYERS", "capture_by_blocks", "repeated_layers"]

#: Fewer layers than this are captured whole.
MIN_LAYERS = 4


def repeated_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's longest ``nn.ModuleList`` of at least ``MIN_LAYERS`` alike layers, by
    path; None when there is none, or the config says the layers differ by index."""
    kinds = getattr(getattr(model, "config", None), "layer_types", None)
    if kinds is not None and len(set(kinds)) > 1:
        return None
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (isinstance(module, nn.ModuleList) and len(module) >= MIN_LAYERS
                and (best is None or len(module) > len(best[1]))
                and all(alike(module[0], m) for m in module)):
            best = (name, module)
    return best


def _with_layers(model: nn.Module, path: str, layers: nn.ModuleList) -> nn.Module:
    """A shallow copy of ``model`` whose module at ``path`` is ``layers``; the modules on
    the way are shallow copies too, everything else (parameters included) shared."""
    top = copy.copy(model)
    top._modules = dict(model._modules)
    here, names = top, path.split(".")
    for name in names[:-1]:
        child = copy.copy(here._modules[name])
        child._modules = dict(child._modules)
        here._modules[name] = child
        here = child
    here._modules[names[-1]] = layers
    return top


def capture_by_blocks(model: nn.Module, capture: Callable[[nn.Module], CaptureResult]
                      ) -> CaptureResult | None:
    """``capture`` of ``model`` made from its first two layers, or None when the model has
    no such layers or their graph is not a chain of two copies (then capture it whole)."""
    found = repeated_layers(model)
    if found is None:
        return None
    path, layers = found
    result = capture(_with_layers(model, path, nn.ModuleList(list(layers)[:2])))
    if not _reads_alike(result.guards, layers):
        return None
    gm = _expand(result.graph_module, model, path, len(layers))
    return replace(result, graph_module=gm) if gm is not None else None


def _reads_alike(guards: Sequence[Guard], layers: nn.ModuleList) -> bool:
    """Whether every plain value the trace read in the second layer (its guards) holds
    the same value in each later layer, which is copied from it: the same value, or, for
    a container, the same contents where a parameter-free helper module of a class made
    afresh for each layer runs the same code (``same_code.helpers_alike``)."""
    inside = {id(m): name for name, m in layers[1].named_modules()}

    def alike(guard: Guard, layer: nn.Module) -> bool:
        theirs = replace(guard, module=layer.get_submodule(inside[id(guard.module)]))
        return theirs.holds() or (guard.contents is not None
                                  and helpers_alike(guard.now(), theirs.now()))

    return all(alike(guard, layer) for guard in guards if id(guard.module) in inside
               for layer in list(layers)[2:])


def _renamed(path: str, k: int) -> Callable[[str], str]:
    pattern = re.compile(re.escape(f"{path}.1") + r"(?=$|\.)")
    return lambda text: pattern.sub(f"{path}.{k}", text, count=1)


def _expand(gm: fx.GraphModule, model: nn.Module, path: str, count: int
            ) -> fx.GraphModule | None:
    """The two-layer graph ``gm`` grown to ``count`` layers (None: not two blocks)."""
    blocks = find_blocks(gm, 2)
    if blocks is None or blocks.count != 2:
        return None
    first, second = blocks.nodes
    position = {n: i for i, n in enumerate(first)}
    for n in second:  # every layer-specific target must name the second layer
        if n.op in ("get_attr", "call_module") and _renamed(path, 2)(str(n.target)) == n.target:
            return None
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, Any] = {}
    last = second[-1]
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        if n.op in ("get_attr", "call_module"):
            root[str(n.target)] = operator.attrgetter(str(n.target))(gm)
        if n is not last:
            continue
        before = [env[x] for x in second]  # layer k-1's nodes, by position in a block
        for k in range(2, count):
            before = _copy_layer(graph, second, position, before, env, _renamed(path, k),
                                 model, root)
        for x, y in zip(second, before):  # the head reads the last layer
            env[x] = y
    graph.lint()
    return fx.GraphModule(root, graph, type(gm).__name__)


def _copy_layer(graph: fx.Graph, second: tuple[fx.Node, ...], position: dict[fx.Node, int],
                before: list[fx.Node], env: dict[fx.Node, fx.Node],
                rename: Callable[[str], str], model: nn.Module, root: dict[str, Any]
                ) -> list[fx.Node]:
    """One more layer: the second layer's nodes copied, reading ``before`` (the layer
    before it) where the second read the first, its targets and module paths renamed."""
    copies: dict[fx.Node, fx.Node] = {}

    def arg(a: fx.Node) -> fx.Node:
        if a in copies:
            return copies[a]
        if a in position:  # what the second layer read of the first: the layer before
            return before[position[a]]
        return env[a]

    for x in second:
        new = graph.node_copy(x, arg)
        copies[x] = new
        new.meta = dict(x.meta)
        stack = x.meta.get("nn_module_stack")
        if stack:
            new.meta["nn_module_stack"] = {
                key: (rename(v[0]), *v[1:]) if isinstance(v, tuple) and isinstance(v[0], str)
                else v for key, v in stack.items()}
        if new.op in ("get_attr", "call_module"):
            new.target = rename(str(x.target))
            root[new.target] = operator.attrgetter(new.target)(model)
    return [copies[x] for x in second]

