"""The settings of the layers fx calls whole that the batch rules decide from: guarded.

Under torch.fx a torch layer (a loss, a softmax, a norm, a padding) is one
``call_module`` node. Its forward runs live on every call, but the batch rules read its
settings once, at compile: a loss's ``reduction`` decides whether the microbatches'
results are summed, averaged by their count or joined; a softmax's ``dim`` whether it
mixes the batch. Each setting a rule reads is guarded as an attribute forward reads is
(``guards.py``), so a later change compiles again, naming it, instead of running the old
decision. What only the layer's own forward reads (a loss's ``ignore_index``, a dropout's
``p``) stays live and unguarded; ``training`` is the mode key's (``mode_key.py``).

Before (``crit = nn.CrossEntropyLoss()`` under fx; ``model.crit.reduction = "sum"``
after compile)::

    cm(x, y)  # the mean: the sum of the microbatches' sums over the count, as compiled

After::

    cm(x, y)  # RecompileWarning "crit.reduction was 'mean', now 'sum'": the sum, as eager
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.fx as fx

from .guards import Guard, recorded_reads

__all__ = ["rule_reads"]


@contextlib.contextmanager
def rule_reads(gm: fx.GraphModule) -> Iterator[list[Guard]]:
    """While the block runs the batch rules on ``gm``: the settings they read off the
    layers its ``call_module`` nodes call, as guards (the list is filled when it ends)."""
    layers = {id(m): m for n in gm.graph.nodes if n.op == "call_module"  # and their own
              for m in gm.get_submodule(n.target).modules()}  # (a stack's attention layers)
    settings: list[Guard] = []
    with recorded_reads(gm, layers=list(layers.values())) as guards:
        yield settings
    settings.extend(g for g in guards if g.name != "training")
