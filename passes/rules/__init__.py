"""Batch rules: one table, op -> rule, registered by family.

A rule gets a ``RuleContext`` (the node, its arguments' facts, the shapes of its
value at two batch sizes) and returns the node's fact, or calls ``ctx.mix(...)``
to reject the op. The table (``TABLE``, a ``RuleTable``) is keyed by module class,
function, ATen overload packet, method name or qualified name (``table``), and reads top
to bottom in ``registry``: one op or op group per line, its rule, and a comment on what it
does to the batch dim, the way JAX registers ``primitive_batchers[prim] = rule``.

The package, one job a module:

=====================  =============================================================
module                 holds
=====================  =============================================================
``table``              ``RuleTable`` and ``TABLE``: op -> rule, scoped registration,
                       a node's one lookup, and ``apply_rule``, which runs a rule
``context``            ``RuleContext``: what a rule sees of a node; how facts combine
``spellings``          every name an op goes by (``torch.X``, ``Tensor.X``, ``F.X``,
                       ``aten.X``) and the table key of each
``families``           the rule families: pointwise, per-sample, linear, ``along`` a
                       dim, channels-first, reductions
``dims``               which dims an op couples, read off its call (for ``along``)
``layout``             reshapes, squeezes, splits and joins, casts, Python-level access
``indexing``           indexing with tensors: ``x[idx]``, gather, scatter, index_put
``writes``             functional writes (``slice_scatter``, ``copy``, ...)
``creation``           creation ops: ``zeros(B, D)``, ``new_ones``, ``arange(B)``
``layers``             contractions, norms, attention, sequence layers, embeddings,
                       losses
``tokens``             token dispatch (MoE routing): its facts, and sorted rows seen
                       as samples by every other rule
``token_rules``        the sort, the counts and index arithmetic on a dispatch
``token_moves``        gathers and writes by token index
``grouped_matmuls``    grouped matmuls by qualified name (``GROUPED_MATMULS``)
``groups``             the op groups, spelled out
``registry``           the table itself, and ``register_batch_rule``, ``trust_module``
=====================  =============================================================

Each module imports only those above it in this order (no cycles): ``context``,
``spellings``; ``tokens``; ``table``; ``dims``, ``families``; the rule families;
``token_rules``, ``token_moves``, ``grouped_matmuls``; ``groups``; ``registry``.

As in JAX, an op without a rule is rejected, never guessed. Users add rules with
``register_batch_rule(op, rule)`` and trust whole layers with ``trust_module``;
``with scoped(): ...`` undoes whatever was registered inside it, and
``TABLE.snapshot()`` lets a test suite check that it left the table as it found it.

Worked example, ``loss = F.cross_entropy(self.head(x).view(-1, V), y.view(-1))``:

1. ``x`` is ``Batched(0)`` (an input); ``self.head`` is ``nn.Linear``, whose rule
   checks the batch dim is not the contracted last dim.
2. ``view(-1, V)`` merges (B, T) into B*T rows: ``reshape_rule`` sees from the
   shapes at gbs and gbs+1 that dim 0 scales as T*B, batch-major: ``Batched(0, T)``.
3. ``cross_entropy`` with ``reduction='mean'`` is a reduction over the batch:
   ``loss`` returns ``Reduced`` and records a ``ReductionSpec("mean",
   cross_entropy_partial)`` so the rewrite computes (sum, count) per microbatch.

Two values need more care than "which dim is the batch":

- ``BatchSize`` ints (``x.size(0)``) may shape tensors (``view(B, -1)``,
  ``zeros(B, D)``, ``arange(B)``) but never enter per-sample arithmetic: a
  microbatch would see its own size (``pointwise`` rejects ``x * x.size(0)``);
- ``torch.arange(B)`` is ``Batched(positions=True)``: each sample's index in
  its batch. It may index the batch dim of a batched tensor (the identity
  ``x[torch.arange(B), labels]``) and go through reshapes and casts, nothing
  else, since positions restart at 0 in every microbatch (``apply_rule``).

Facts are about the full-batch program. An op whose meaning depends on the batch
size is kept when the full batch keeps samples apart, and if a microbatch would
act differently the rule rewrites the node (``ctx.specialise``) into the call it
makes at the full batch: ``(B, 1, C).squeeze()`` drops dim 1 alone there (B > 1),
so it becomes ``squeeze((1,))``, which a 1-sample microbatch runs the same way.
``x.new_ones(T, T)`` of a batched ``x`` is batch-free (``x`` gives only its dtype),
``x.new_ones(B, T)`` per-sample, and a pad of ``(0, 0)`` leaves the batch dim alone.
"""

from . import registry  # noqa: F401  (fills TABLE, top to bottom)
from .context import MBS_NONE, Rejected, Rule, RuleContext
from .grouped_matmuls import GROUPED_MATMULS
from .groups import BATCH_NORMS
from .layers import loss_rule
from .registry import FAMILIES, register_batch_rule, trust_module
from .spellings import is_aten, node_name, rule_key
from .table import (
    BATCH_RULES,
    POSITION_PRESERVING,
    TABLE,
    TRUSTED_MODULES,
    RuleTable,
    TableState,
    apply_rule,
    lookup_rule,
    scoped,
)
from .tokens import (
    DispatchFact,
    GroupCounts,
    NoRule,
    Permuted,
    Sort,
    TokenIndex,
    Unsort,
    is_dispatch_fact,
    output_reason,
)

__all__ = [
    "BATCH_NORMS",
    "BATCH_RULES",
    "FAMILIES",
    "GROUPED_MATMULS",
    "MBS_NONE",
    "POSITION_PRESERVING",
    "TABLE",
    "TRUSTED_MODULES",
    "DispatchFact",
    "GroupCounts",
    "NoRule",
    "Permuted",
    "Rejected",
    "Rule",
    "RuleContext",
    "RuleTable",
    "Sort",
    "TableState",
    "TokenIndex",
    "Unsort",
    "apply_rule",
    "is_aten",
    "is_dispatch_fact",
    "loss_rule",
    "lookup_rule",
    "node_name",
    "output_reason",
    "register_batch_rule",
    "rule_key",
    "scoped",
    "trust_module",
]
