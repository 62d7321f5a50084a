"""Activation checkpointing per block: the other way to trade compute for memory.

A model's repeated blocks (``blocks.0``, ``blocks.1``, ..., ``model.layers.11``: the
children of an ``nn.ModuleList`` or ``nn.Sequential``, read off each node's
``nn_module_stack``) each become a submodule called through non-reentrant
``torch.utils.checkpoint``: only a block's inputs are kept for backward, and its
activations are recomputed, block by block, during backward (with the RNG state of
the forward, so dropout draws the same masks: the result is unchanged; a block that
draws from a generator of the model's own replays it too, ``passes/generators.py``).

Before (a body)::

    blocks_0_ln = self.blocks_0_ln(x); ...; add_2 = add_1 + blocks_0_down
    blocks_1_ln = self.blocks_1_ln(add_2); ...

After::

    submod_1 = checkpoint_keeping_hooks(self.submod_1, x)       # checkpoint(..., use_reentrant
    submod_2 = checkpoint_keeping_hooks(self.submod_2, submod_1)  # =False) at the call

``torch.fx.passes.split_module`` cuts the graph; what lies outside the blocks
(embeddings, the head, the loss) runs as before.

A step called under the user's ``torch.autograd.graph.saved_tensors_hooks`` (activation
compression: pack to float16) runs its blocks without checkpointing: checkpoint's own
hooks would take the blocks' saved tensors past the user's, where eager packs every one
(``checkpoint_keeping_hooks``; a ``RecomputeBypassedWarning`` says so).
"""

from __future__ import annotations

import operator
import re
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.fx.passes.split_module import split_module

from .errors import MbcompileWarning
from .generators import checkpoint_replaying, generators_of
from .sources import user_stacklevel

__all__ = ["RecomputeBypassedWarning", "block_of", "checkpoint_blocks",
           "checkpoint_keeping_hooks"]


class RecomputeBypassedWarning(MbcompileWarning):
    """``recompute``: the step ran under the user's ``saved_tensors_hooks``, so its blocks
    ran without checkpointing, saving their tensors through those hooks as eager does."""


def users_hooks() -> tuple[Any, Any] | None:
    """The user's innermost saved-tensor hooks here, if any (not mbcompile's own, such as
    the memory probe's, nor an enclosing checkpoint's)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    owner = getattr(hooks[0], "__module__", None) or ""
    return None if owner.startswith(("mbcompile", "passes", "torch.utils.checkpoint")) \
        else hooks


class checkpoint_keeping_hooks(checkpoint_replaying):  # noqa: N801 (a graph op, like a function)
    """A block's call: ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)``
    (replaying the model's own ``generators`` too, where it has some), or, under the user's
    saved-tensor hooks, ``fn(*args)``: checkpoint's own hooks would save the block's tensors
    past the user's pack and unpack (a float16 compression), where eager packs every one.
    Run plainly, the block saves through them, exactly as eager, and keeps what they keep.
    Under torch.compile the block is always checkpointed (its graph decides what is saved).
    """

    __name__ = "checkpoint_keeping_hooks"

    def __call__(self, fn: Any, *args: Any) -> Any:
        if torch.compiler.is_compiling() or users_hooks() is None:
            if self.generators:
                return super().__call__(fn, *args)
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        warnings.warn(
            "recompute: the step runs under torch.autograd.graph.saved_tensors_hooks of "
            "yours; activation checkpointing would save the blocks' tensors past your hooks "
            "(eager packs every one), so the blocks ran without recomputation, saving through "
            "your hooks, exactly as eager. Memory is then what your hooks keep, not the plan's: "
            "compile with recompute=False to plan for that, or call outside the hooks",
            RecomputeBypassedWarning, stacklevel=user_stacklevel())
        return fn(*args)

    def __repr__(self) -> str:
        return f"checkpoint_keeping_hooks({len(self.generators)} generators)"

_INDEXED = re.compile(r"(^|\.)\d+$")  # a child of a ModuleList / Sequential


def block_of(node: fx.Node) -> str | None:
    """The outermost repeated block ``node`` runs in (``"blocks.0"``), if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in stack.items():  # outermost first
        path = value[0] if isinstance(value, tuple) else key
        if isinstance(path, str) and _INDEXED.search(path):
            return path
    return None


def _attribute(gm: fx.GraphModule, arg: object) -> object:
    """The value a ``get_attr`` argument reads (None for any other argument)."""
    if isinstance(arg, fx.Node) and arg.op == "get_attr":
        return operator.attrgetter(str(arg.target))(gm)
    return None


_CHECKPOINT = checkpoint_keeping_hooks(())  # one op for every block: blocks compare alike


def checkpoint_blocks(gm: fx.GraphModule) -> fx.GraphModule | None:
    """``gm`` with each repeated block run under activation checkpointing; None when it
    has fewer than two blocks (nothing worth recomputing)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    blocks = {n: block_of(n) for n in nodes}
    if len({b for b in blocks.values() if b is not None}) < 2:
        return None
    ids: dict[fx.Node, int] = {}
    is_block: dict[int, bool] = {}
    current, part = object(), -1
    for n in nodes:
        key = blocks[n]
        if n.op == "get_attr":  # parameters go with their first user (split_module's way)
            key = next((blocks[u] for u in n.users if u in blocks), key)
        if key != current:
            part, current = part + 1, key
            is_block[part] = key is not None
        ids[n] = part
    split = split_module(gm, gm, lambda n: ids[n], keep_original_order=True)
    for n in list(split.graph.nodes):
        if n.op != "call_module" or not n.target.startswith("submod_"):
            continue
        if not is_block.get(int(n.target.removeprefix("submod_")), False):
            continue
        generators = generators_of(getattr(split, n.target)) + tuple(  # or passed in
            g for g in (_attribute(split, a) for a in n.args) if isinstance(g, torch.Generator))
        with split.graph.inserting_before(n):  # the model's own generators are replayed too
            fn = split.graph.get_attr(n.target)
            op = checkpoint_keeping_hooks(generators) if generators else _CHECKPOINT
            call = split.graph.call_function(op, (fn, *n.args))
        call.meta = dict(n.meta)
        n.replace_all_uses_with(call)
        split.graph.erase_node(n)
    split.graph.lint()
    split.recompile()
    return split
