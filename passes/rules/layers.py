"""Rules of layers and their functional and ATen forms: contractions, norms, attention,
sequence layers, embeddings, losses. Each checks that the layer meets the batch where it
treats samples apart (the N of (N, C, ...), ``batch_first``, a leading dim of attention),
then hands over to ``per_sample``.

Losses are declared once each, in ``partials.LOSSES``, which gives both their partials
and, here, their rule: with ``reduction='mean'`` a loss is a reduction over the batch whose
``ReductionSpec`` lets the rewrite compute (sum, count) per microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
import torch.nn as nn

from .. import partials
from ..facts import REDUCTION, Batched, Container, Fact, Free, Reduced, ReductionSpec
from .context import Rule, RuleContext, batched_facts, join_facts
from .embedding_flags import check_embedding_flags
from .families import along, channels_first, check_batch_not_in, per_sample, pointwise
from .spellings import is_aten, node_name, rule_key

__all__ = [
    "batch_norm_rule",
    "embedding_bag_rule",
    "embedding_rule",
    "instance_norm_rule",
    "loss_rule",
    "matmul_rule",
    "multihead_attention_rule",
    "rnn_rule",
    "sdpa_rule",
    "transformer_layer_rule",
]


def matmul_rule(ctx: RuleContext) -> Fact:
    """a @ b: fine while the batch dim is a batch (not a contracted) dim of each side."""
    name = node_name(ctx.node)
    first = 1 if name in ("addmm", "baddbmm", "addbmm", "addmv", "addr") else 0
    a, b = ctx.arg(first, "mat1"), ctx.arg(first + 1, "mat2")
    check_batch_not_in(ctx, a, [-1], "contracts",
                       "put the batch dim before the contracted (last) dim of the left side")
    if ctx.ndim(b) >= 2:
        check_batch_not_in(ctx, b, [-2], "contracts",
                           "put the batch dim outside the contracted dim of the right side")
    if name == "addbmm":
        check_batch_not_in(ctx, a, [0], "sums the products over")
    return per_sample(ctx)



def batch_norm_rule(ctx: RuleContext) -> Fact:
    """BatchNorm: eval mode uses running statistics (per-sample); training mixes."""
    mod = ctx.module
    if mod is not None:
        uses_batch_stats = mod.training or not mod.track_running_stats
    elif node_name(ctx.node).endswith("no_training"):  # aten._native_batch_norm_legit_no_training
        uses_batch_stats = False
    else:  # F.batch_norm(x, mean, var, w, b, training), aten.batch_norm(x, w, b, mean, var, ...)
        mean_at = 3 if is_aten(ctx.node.target) else 1
        uses_batch_stats = bool(ctx.arg(5, "training", False)) or (
            ctx.arg(mean_at, "running_mean") is None)
    x = ctx.arg(0, "input")
    if uses_batch_stats and isinstance(ctx.fact(x), Batched):
        ctx.mix("BatchNorm in training mode normalises each channel with the mean and "
                "variance of the whole batch, so every sample's output depends on every "
                "other sample",
                "replace it with GroupNorm or LayerNorm (per-sample statistics)",
                "put it in eval mode (model.eval(), or the BatchNorm module's .eval()) to "
                "use its running statistics")
    return channels_first(0, "normalises")(ctx)


def instance_norm_rule(ctx: RuleContext) -> Fact:
    """InstanceNorm: per sample, but updating running stats in training averages samples."""
    mod = ctx.module
    if mod is not None:
        tracking = mod.training and mod.track_running_stats
    else:
        tracking = ctx.arg(1, "running_mean") is not None and bool(
            ctx.arg(5, "use_input_stats", True))
        if is_aten(ctx.node.target):  # aten.instance_norm(x, w, b, mean, var, use_input_stats)
            tracking = ctx.arg(3, "running_mean") is not None and bool(
                ctx.arg(5, "use_input_stats", True))
    if tracking and isinstance(ctx.fact(ctx.arg(0, "input")), Batched):
        ctx.mix("InstanceNorm with track_running_stats updates its running statistics with "
                "an average over the batch",
                "set track_running_stats=False, or use eval mode")
    return channels_first(0, "normalises")(ctx)


def sdpa_rule(ctx: RuleContext) -> Fact:
    """scaled_dot_product_attention: (..., L, E) inputs; the batch must be a leading dim."""
    for i, name in enumerate(("query", "key", "value", "attn_mask")):
        check_batch_not_in(ctx, ctx.arg(i, name), [-1, -2], "attends",
                           "keep the batch in a leading dim: (B, heads, L, E)")
    return per_sample(ctx)


def _batch_first(ctx: RuleContext) -> bool:
    """A sequence layer's batch_first: its own, its first attention layer's (transformer
    stacks), or ATen's argument (``aten.lstm.input(input, hx, params, has_biases, layers,
    dropout, train, bidirectional, batch_first)``)."""
    mod = ctx.module
    if mod is None:
        return bool(ctx.arg(8, "batch_first", False))
    if hasattr(mod, "batch_first"):
        return bool(mod.batch_first)
    attn = next((m for m in mod.modules() if isinstance(m, nn.MultiheadAttention)), None)
    return bool(attn.batch_first) if attn is not None else False


def _check_batch_first(ctx: RuleContext, inputs: Sequence[tuple[int, str]],
                       consequence: str) -> None:
    """A 3-d input of a sequence layer must have its batch dim where batch_first says; a
    batched 2-d input is one unbatched (L, features) sequence whose positions are samples."""
    want = 0 if _batch_first(ctx) else 1
    for index, name in inputs:
        value = ctx.arg(index, name)
        f = ctx.fact(value)
        if isinstance(f, Batched) and ctx.ndim(value) == 2:
            ctx.mix(f"it gets an unbatched (L, features) sequence whose positions are "
                    f"samples, so {consequence}",
                    "add the batch dim: (B, L, features) with batch_first=True")
        if isinstance(f, Batched) and ctx.ndim(value) == 3 and f.dim != want:
            ctx.mix(f"its batch dim is {want} (batch_first={want == 0}) but the input's batch "
                    f"dim is {f.dim}, so {consequence}",
                    "pass inputs with the batch dim where the layer expects it (or set "
                    "batch_first to match)")


def multihead_attention_rule(ctx: RuleContext) -> Fact:
    """nn.MultiheadAttention: per-sample along its batch dim (0 if batch_first else 1)."""
    _check_batch_first(ctx, ((0, "query"), (1, "key"), (2, "value")),
                       "samples would attend to each other")
    mask = ctx.arg(4, "attn_mask")
    mfact = ctx.fact(mask)
    if isinstance(mfact, Batched) and ctx.ndim(mask) == 2:
        ctx.mix("its 2-d attn_mask grows with the batch, so it would pair samples",
                "pass a per-sample mask as (B * num_heads, L, S) or key_padding_mask (B, S)")
    return per_sample(ctx)


def rnn_rule(ctx: RuleContext) -> Fact:
    """RNN/LSTM/GRU: per sample along dim 0 (batch_first) or 1; hidden states carry dim 1."""
    _check_batch_first(ctx, ((0, "input"),),
                       "it would run over samples as if they were time steps")
    hx = ctx.arg(1, "hx")
    states = list(hx) if isinstance(hx, (tuple, list)) else [hx]
    for s in states:
        sf = ctx.fact(s) if isinstance(s, fx.Node) else Free()
        for f in ([g for _, g in sf.items] if isinstance(sf, Container) else [sf]):
            if isinstance(f, Batched) and f.dim != 1:
                ctx.mix(f"its initial hidden state has the batch at dim {f.dim}; RNN states "
                        "are (layers, B, hidden) whatever batch_first says",
                        "pass h0 with the batch at dim 1")
    return per_sample(ctx)


def transformer_layer_rule(ctx: RuleContext) -> Fact:
    """nn.Transformer*Layer: like MultiheadAttention, per sample along its batch dim."""
    _check_batch_first(ctx, ((0, "src"), (1, "tgt"), (2, "memory")),
                       "samples would attend to each other")
    for name in ("mask", "src_mask", "tgt_mask", "memory_mask"):
        m = ctx._kwargs.get(name)
        if isinstance(ctx.fact(m), Batched) and ctx.ndim(m) == 2:
            ctx.mix(f"its 2-d {name} grows with the batch, so it would pair samples",
                    "pass per-sample masks as key_padding_mask (B, S)")
    return per_sample(ctx)


def embedding_rule(table_index: int, table_name: str = "weight") -> Rule:
    """embedding(ids, table): rows of a batch-free table picked per sample."""
    rows = along(lambda ctx: [0], "looks up rows", "look up rows of a batch-free table",
                 inputs=((table_index, table_name),))

    def rule(ctx: RuleContext) -> Fact:
        check_embedding_flags(ctx)
        return rows(ctx)

    return rule


def embedding_bag_rule(ctx: RuleContext) -> Fact:
    """EmbeddingBag: (B, L) ids pool per sample; flat ids with offsets are one bag list."""
    if ctx.module is not None:  # module(input, offsets=None)
        ids, offsets = ctx.arg(0, "input"), ctx.arg(1, "offsets")
    elif is_aten(ctx.node.target):  # aten.embedding_bag(weight, indices, offsets, ...)
        ids, offsets = ctx.arg(1, "indices"), ctx.arg(2, "offsets")
    else:  # F.embedding_bag(input, weight, offsets=None, ...)
        ids, offsets = ctx.arg(0, "input"), ctx.arg(2, "offsets")
    if offsets is not None and (isinstance(ctx.fact(ids), Batched)
                                or isinstance(ctx.fact(offsets), Batched)):
        ctx.mix("its bags are given by offsets into one flat index tensor, so the split "
                "points do not follow samples",
                "pass 2-d (B, L) indices (pad with padding_idx) so each row is one bag")
    check_batch_not_in(ctx, ids, [-1], "pools a bag")
    check_embedding_flags(ctx)
    return per_sample(ctx)



def loss_rule(ctx: RuleContext) -> Fact:
    """A loss of ``partials.LOSSES``: per-sample with reduction='none', else a reduction
    over the batch ('sum': a partial sum; 'mean': a (sum, count) pair)."""
    loss = partials.loss_for(ctx.module if ctx.module is not None else ctx.node.target)
    if loss is None:
        raise TypeError(f"{node_name(ctx.node)} is not a loss of partials.LOSSES")
    if ctx.module is not None:
        mode, partial = ctx.module.reduction, partials.module_loss_partial
    elif is_aten(ctx.node.target):
        mode, partial = _aten_reduction(ctx), loss.aten_partials[rule_key(ctx.node.target)]
    else:
        mode, partial = partials.loss_reduction(loss.fn, ctx._args, ctx._kwargs), loss.partial
    facts = ctx.arg_facts()
    if any(isinstance(f, Reduced) for f in facts):
        return pointwise(ctx)
    batched = batched_facts(facts)
    if not batched:
        return join_facts(facts, ctx)
    if loss.kind.n_first and any(f.dim != 0 for f in batched):
        ctx.mix("its batch dim is not dim 0 (the N of (N, C, ...)), so the loss "
                "would treat samples as classes",
                "move the batch dim to dim 0 (x.movedim(d, 0)) before the loss")
    if loss.kind is partials.LENGTHS:
        _check_ctc(ctx)
    if mode == "none":
        return ctx.batched_out()
    ctx.node.meta[REDUCTION] = ReductionSpec("sum" if mode == "sum" else "mean",
                                             None if mode == "sum" else partial)
    return Reduced()


def _check_ctc(ctx: RuleContext) -> None:
    """CTC: (T, N, C) log-probs with the batch at N, padded (N, S) targets and (N,) length
    tensors, each row one sample's; concatenated targets or lengths given as Python
    numbers do not split with the batch."""
    names = ("log_probs", "targets", "input_lengths", "target_lengths")
    lp, targets, *lengths = (ctx.arg(i, n) for i, n in enumerate(names))
    fact = ctx.fact(lp)
    if isinstance(fact, Batched) and ctx.ndim(lp) == 3 and fact.dim != 1:
        ctx.mix(f"its log-probs are (T, N, C), read with the batch at dim 1, but their batch "
                f"dim is {fact.dim}, so it would align samples as time steps",
                "pass log_probs.transpose(0, 1) of (N, T, C) scores")
    fact = ctx.fact(targets)
    if not (isinstance(fact, Batched) and fact.dim == 0 and ctx.ndim(targets) == 2):
        ctx.mix("its targets are not a padded (N, S) tensor with one row per sample (one "
                "concatenated 1-d tensor is cut by the lengths' values, not by samples)",
                "pass targets padded to (N, S), each row one sample's")
    for value in lengths:
        fact = ctx.fact(value)
        if not (isinstance(fact, Batched) and fact.dim == 0 and ctx.is_tensor(value)):
            ctx.mix("its input or target lengths are not an (N,) tensor of the batch (Python "
                    "numbers are fixed for the full batch)",
                    "pass input_lengths and target_lengths as (N,) tensors")


def _aten_reduction(ctx: RuleContext) -> str:
    """An ATen loss's ``reduction`` (0 none, 1 mean, 2 sum) as the string."""
    schema = ctx.node.target._schema
    names = [a.name for a in schema.arguments]
    value = ctx.arg(names.index("reduction"), "reduction", 1)
    return {0: "none", 1: "mean", 2: "sum"}[int(value)]
