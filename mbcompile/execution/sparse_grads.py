"""Which parameters of a compiled body may get a sparse gradient (``nn.Embedding(sparse=True)``).

A sparse ``.grad`` (a ``torch.sparse_coo`` tensor) cannot be flattened into a dense
all-reduce bucket, and ``torch.func.grad`` hands back a dense one. Like
``torch.nn.parallel.DistributedDataParallel`` (its ``expect_sparse_gradient``), the
runtime decides which gradients may be sparse from the model, before the step, so that
every rank lays its collectives out alike whatever its step does:

>>> body.e = nn.Embedding(20, 4, sparse=True)          # a module: its weight
>>> F.embedding(ids, self.w, sparse=True)               # fx: the weight it reads
>>> aten.embedding.default(w, ids, -1, False, True)     # export: the same
>>> sparse_gradient_params(body)                        # [body.e.weight, body.w]

Over-inclusion is harmless: such a parameter's gradient is reduced on its own, whatever
layout it arrives in (a weight tied to a dense head gets a dense one).
"""

from __future__ import annotations

import torch
from torch import fx

from mbcompile.passes.errors import InputError

__all__ = ["has_sparse_gradients", "sharded_sparse_refused", "sparse_gradient_params"]

# the position of ``sparse`` in each op's arguments (where it is not a keyword)
_SPARSE_ARG = {
    torch.nn.functional.embedding: 6,
    torch.nn.functional.embedding_bag: 7,
    torch.ops.aten.embedding.default: 4,
    torch.ops.aten.embedding_bag.default: 5,
    torch.ops.aten.embedding_bag.padding_idx: 5,
    torch.ops.aten._embedding_bag.default: 5,
}


def _asks_sparse(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.kwargs.get("sparse") is True:
        return True
    at = _SPARSE_ARG.get(node.target)
    return at is not None and len(node.args) > at and node.args[at] is True


def sparse_gradient_params(body: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``body`` whose gradient may be sparse, in ``parameters()`` order."""
    ids = {id(m.weight) for m in body.modules()
           if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse}
    graph = getattr(body, "graph", None)
    for node in graph.nodes if isinstance(graph, fx.Graph) else ():
        if _asks_sparse(node):
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    try:
                        ids.add(id(body.get_parameter(str(arg.target))))
                    except AttributeError:  # a buffer or a constant: no gradient
                        pass
    return [p for p in body.parameters() if id(p) in ids]


def has_sparse_gradients(body: torch.nn.Module) -> bool:
    """Whether any gradient of ``body``'s step may be sparse (a functional ``sparse=True``
    op on a computed weight counts too: its gradient flows into a parameter sparse)."""
    return bool(sparse_gradient_params(body)) or (
        isinstance(getattr(body, "graph", None), fx.Graph)
        and any(_asks_sparse(n) for n in body.graph.nodes))


def sharded_sparse_refused(model: torch.nn.Module) -> None:
    """Refuse, before anything is traced, a sparse embedding whose weight FSDP2 shards:
    ``fully_shard`` reduce-scatters dense gradients only (eager FSDP2 fails in its
    backward, in ``fsdp::chunk_cat``)."""
    sparse = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if not sparse or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    for name, m in sparse:
        if isinstance(m.weight, DTensor):
            where = f"model.{name}.weight" if name else "model.weight"
            raise InputError(
                f"{type(m).__name__} '{name}' has sparse=True, but its weight is sharded by "
                "fully_shard (FSDP2), which reduce-scatters dense gradients only (the model "
                "fails the same way in eager FSDP2's backward). Build it with sparse=False, or "
                "keep its weight out of the shards: "
                f"fully_shard(model, ignored_params={{{where}}}) (mbcompile then all-reduces "
                "its sparse gradient as on unsharded ranks). Nothing was compiled or changed")
