"""The rule table, read top to bottom: one op or op group per line, its rule, and a comment
on what it does to the batch dim, the way JAX registers ``primitive_batchers[prim] = rule``.

A group names all the spellings of its ops (``groups``); rules that need more than a line
are functions of the family modules (``families``, ``layout``, ``indexing``, ``writes``,
``creation``, ``layers``), and rules whose arguments are too long for their line are named
just above the table. Losses are declared once each, in ``partials.LOSSES``, which gives
both their partials and, here, their rule. The token-dispatch section at the end does not
replace lines: ``TABLE.layer`` wraps the rule an op already has with the op's meaning on
sorted rows (``tokens``), so the analysis asks the table once per node.

Users add lines with ``register_batch_rule(op, rule)`` and trust whole layers with
``trust_module`` (at the end of this file).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops, partials
from ..penalties import DIFFERENTIATIONS
from .context import Rule
from .creation import (
    arange_rule,
    new_full_rule,
    new_like_rule,
    new_tensor_rule,
    size_like_rule,
    value_arg,
)
from .differentiation import autograd_grad_rule
from .dims import (
    compared_dims,
    diagonal_dims,
    dim_arg,
    every_dim,
    flip_dims,
    last_dims,
    module_dim,
    normalized_dims,
    pad_dims,
    roll_dims,
    softmax_dims,
    tril_dims,
    unfold_dims,
)
from .families import (
    along,
    channels_first,
    free,
    linear,
    linear_arith,
    per_sample,
    pointwise,
    reduction,
)
from .grouped_matmuls import grouped_matmul
from .groups import (
    ACTIVATIONS,
    ADDS,
    AS_STRIDED,
    ATTENTIONS,
    BATCH_NORMS,
    BILINEARS,
    BINARY,
    CASTS,
    CONVOLUTIONS,
    CONVS_AND_POOLS,
    CREATIONS,
    CROSSES,
    DATA_SHAPED,
    DETACHES,
    DIAGONALS,
    DIM_MOVES,
    DIVS,
    DROPOUTS,
    EMBEDDING_BAGS,
    EXPORT_CHECKS,
    F_GROUPED_MMS,
    FLIPS,
    FULLS,
    GATHERS,
    GRID_SAMPLES,
    GROUP_NORMS,
    GROUPED_MMS,
    HF_GROUPED_MMS,
    INDEX_PUTS,
    INDEX_SELECTS,
    INSTANCE_NORMS,
    JOINS,
    KRONS,
    LAYER_NORMS,
    LINEARS,
    LOCAL_NORMS,
    LOSS_SPELLINGS,
    MATMULS,
    MATRIX_NORMS,
    MULS,
    NEGS,
    NEW_CREATIONS,
    NONLINEAR_REDUCTIONS,
    NUMBERS,
    OPERATORS,
    PADS,
    PDISTS,
    PRODUCTS,
    RANKS,
    REPEAT_INTERLEAVES,
    REPEATS,
    RESAMPLES,
    RESHAPES,
    RNN_CELLS,
    RNNS,
    ROLLS,
    SCANS,
    SEARCHES,
    SIZES,
    SOFTMAXES,
    SORTS,
    SPLITS,
    SQUEEZES,
    SUBS,
    TENSORS,
    TOKEN_BROADCASTS,
    TOKEN_CASTS,
    TOKEN_COUNTS,
    TOKEN_CUMSUMS,
    TOKEN_DIVS,
    TOKEN_FLOOR_DIVS,
    TOKEN_LIKES,
    TOKEN_MODS,
    TOKEN_NEWS,
    TOKEN_READS,
    TOKEN_SIZES,
    TOKEN_SORTS,
    TOKEN_WRITES,
    TRANSFORMERS,
    TRIANGLES,
    UNARY_MATH,
    UNFOLDS,
    VALUE_READS,
    VECTOR_NORMS,
    VECTOR_PAIRS,
)
from .hidden_reads import cross_rule, kron_rule, whole_argument
from .indexing import (
    aten_index_rule,
    gather_rule,
    getitem_rule,
    index_put_rule,
    index_select_rule,
)
from .layers import (
    batch_norm_rule,
    embedding_bag_rule,
    embedding_rule,
    instance_norm_rule,
    loss_rule,
    matmul_rule,
    multihead_attention_rule,
    rnn_rule,
    sdpa_rule,
    transformer_layer_rule,
)
from .layout import (
    cat_rule,
    chunk_rule,
    detach_rule,
    drop_rule,
    getattr_rule,
    read_value_rule,
    repeat_rule,
    reshape_rule,
    size_rule,
    squeeze_rule,
    unit_marker,
)
from .spellings import aten, rule_key, spellings
from .table import TABLE
from .token_moves import read, write
from .token_rules import (
    attribute,
    broadcast,
    cast,
    count_key,
    count_sorted_key,
    dispatching,
    div,
    floor_div,
    like,
    mod,
    new_of_values,
    offsets,
    resort,
    size,
    start_sort,
)
from .writes import (
    copy_rule,
    diagonal_scatter_rule,
    masked_scatter_rule,
    select_scatter_rule,
    slice_scatter_rule,
)

__all__ = ["FAMILIES", "MODE_FREE_RULES", "register_batch_rule", "trust_module"]

# Rules whose arguments are too long for their table line.
_PAIR = ((0, "x1"), (1, "x2"))
flip_rule = along(flip_dims, "reverses the order", "flip a non-batch dim")
roll_rule = along(roll_dims, "rolls elements", "roll a non-batch dim")
triangle_rule = along(tril_dims, "masks by position",
                      "build (T, T) masks from torch.arange(T) or a batch-free ones((T, T))")
linear_layer_rule = along(last_dims(1), "contracts features",
                          "put the batch dim before the feature dim")
bilinear_rule = along(last_dims(1), "contracts features", inputs=((0, "input1"), (1, "input2")))
softmax_rule = along(softmax_dims, "normalises", "normalise along a non-batch dim")
scan_rule = along(dim_arg(1, "dim"), "accumulates", "scan along time or features")
sort_rule = along(dim_arg(1, "dim", -1), "sorts", "sort along a non-batch dim")
rank_rule = along(dim_arg(2, "dim", -1), "ranks", "rank along features")
pad_rule = along(pad_dims, "pads", "pad only the trailing non-batch dims")
matrix_norm_rule = reduction(nonlinear="norm", dims=dim_arg(2, "dim", (-2, -1)))


# ---------------------------------------------------------------------------
# The table: one op or op group, its rule, what it does to the batch dim
# ---------------------------------------------------------------------------

FAMILIES: dict[str, Rule] = {"per_sample": per_sample, "pointwise": pointwise, "free": free,
                             "linear": linear}

# --- Elementwise: f per element, broadcast; the batch dim comes from the batched side ----
TABLE.add(UNARY_MATH, pointwise)  # f(x), f_(x): batch dim unchanged
TABLE.add(ACTIVATIONS, pointwise)  # act(x): functional, ATen and module
TABLE.add(DROPOUTS, per_sample)  # x * mask (its random mask is the one inexact op)
TABLE.add(BINARY, pointwise)  # f(a, b), f(a, b, c): batch dim from the batched side
TABLE.add(spellings("isin"), whole_argument(1, "test_elements", "tests elements against"))  # x in y
TABLE.add(spellings("bucketize"), whole_argument(1, "boundaries", "bins elements by"))  # bins of y
TABLE.add(OPERATORS, pointwise)  # a == b, a ** b, ~a, a // b: as above
TABLE.add(spellings("one_hot"), pointwise)  # (B, ...) ids -> (B, ..., classes)
# --- Linear arithmetic: a reduction may be added to, or scaled by, batch-free values -----
TABLE.add(ADDS, linear_arith("add"))  # a + b: linear in both
TABLE.add(SUBS, linear_arith("sub"))  # a - b: linear in both
TABLE.add(MULS, linear_arith("mul"))  # a * b: linear if one side is batch-free
TABLE.add(DIVS, linear_arith("div"))  # a / b: b batch-free, or a count (sum / count)
TABLE.add(NEGS, linear)  # -x, +x: reductions pass through
TABLE.add(spellings("real", "imag", "view_as_real", "view_as_complex"), linear)  # complex parts
# --- Casts and copies: same values, new dtype/device/memory; reductions pass through -----
TABLE.add(CASTS, detach_rule, keeps_positions=True)  # x.float(), x.to(dev), x.clone()
TABLE.add(DETACHES, detach_rule, keeps_positions=True)  # same values, no autograd history
TABLE.add([ops.TensorHook], detach_rule, keeps_positions=True)  # h with a gradient hook: same
TABLE.add([ops.fsdp_unit_enter, ops.fsdp_unit_exit], unit_marker)  # FSDP units: identities
TABLE.add(EXPORT_CHECKS, drop_rule)  # export's asserts: no value, batch-free
# --- Reshapes and dim moves: values untouched; the shapes locate the batch dim -----------
TABLE.add(RESHAPES, reshape_rule, keeps_positions=True)  # (B, T, C) -> (B*T, C) batch-major
TABLE.add(DIM_MOVES, per_sample, keeps_positions=True)  # permute, expand, select: dims move
TABLE.add(AS_STRIDED, along(every_dim, "reads memory by explicit strides"))  # any row
TABLE.add(SQUEEZES, squeeze_rule, keeps_positions=True)  # the size-1 dims of the full batch
TABLE.add(REPEATS, repeat_rule, keeps_positions=True)  # copies along the batch interleave
TABLE.add(REPEAT_INTERLEAVES, per_sample, keeps_positions=True)  # r copies of each sample, in order
# --- Order along a dim matters: fine unless that dim is the batch ------------------------
TABLE.add(FLIPS, flip_rule)  # x[..., ::-1] along a non-batch dim
TABLE.add([torch.fliplr, "fliplr"], along(lambda c: [1], "reverses the order"))  # flips dim 1
TABLE.add([torch.flipud, "flipud"], along(lambda c: [0], "reverses the order"))  # flips dim 0
TABLE.add(ROLLS, roll_rule)  # circular shift along a non-batch dim
TABLE.add(TRIANGLES, triangle_rule)  # tril/triu mask (T, T) positions, never the batch
TABLE.add(DIAGONALS, along(diagonal_dims, "takes a diagonal"))  # x[i, i] pairs positions
TABLE.add(spellings("diag_embed"), along(last_dims(1), "builds diagonals"))  # (B, n) -> (B, n, n)
TABLE.add(UNFOLDS, along(unfold_dims, "makes sliding windows"))  # x.unfold(dim, size, step)
# --- Splits and joins: along a non-batch dim every piece keeps the batch -----------------
TABLE.add(SPLITS, chunk_rule, keeps_positions=True)  # pieces along a non-batch dim
TABLE.add(JOINS, cat_rule, keeps_positions=True)  # join along a feature dim
# --- Python-level access: tuple items, shapes, attributes, values ------------------------
TABLE.add([operator.getitem, "__getitem__"], getitem_rule)  # x[..., :k] keeps the batch; table[t]
TABLE.add([getattr], getattr_rule)  # x.shape, x.dtype, result.values
TABLE.add(SIZES, size_rule)  # x.size(0): ints that are multiples of the batch size, or free
TABLE.add(NUMBERS, size_rule)  # Python numbers computed from sizes (fx, export's SymInt math)
TABLE.add(VALUE_READS, read_value_rule)  # x.item(), x.tolist(): data into Python, rejected
# --- Indexing with tensors: per-sample ids, or arange(B) on the batch dim ----------------
TABLE.add(aten("index", "_unsafe_index"), aten_index_rule)  # x[i0, i1, ...]
TABLE.add(INDEX_SELECTS, index_select_rule)  # x.index_select(dim, idx)
TABLE.add(GATHERS, gather_rule)  # out[i][j] = x[i][idx[i][j]] along a non-batch dim
TABLE.add(INDEX_PUTS, index_put_rule)  # x[mask] = v: per-sample masks only
# --- Functional writes (functionalization's forms of x[...] = y): per sample into its rows ---
TABLE.add(aten("copy"), copy_rule)  # copy(x, y): y broadcast into x's shape; batch from y
TABLE.add(aten("slice_scatter"), slice_scatter_rule)  # x[:, a:b] = y; batch rows only whole
TABLE.add(aten("select_scatter"), select_scatter_rule)  # x[:, i] = y; never a batch row
TABLE.add(aten("diagonal_scatter"), diagonal_scatter_rule)  # diagonal of two non-batch dims
TABLE.add(spellings("masked_scatter"), masked_scatter_rule)  # consumes y in order: batched mixes
TABLE.add(SEARCHES, along(last_dims(1), "searches a sorted row"))  # per row of sorted (B, K)
# --- Creation: shaped by the batch at most (B from x.size(0)); values batch-free ---------
TABLE.add(CREATIONS, size_like_rule)  # zeros(B, D), ones_like(x), ...
TABLE.add(NEW_CREATIONS, new_like_rule)  # x.new_ones(B, D): shaped by the sizes; x gives dtype
TABLE.add(FULLS, value_arg(1, "fill_value"))  # full(size, v), x.fill_(v): v not a batch size
TABLE.add(spellings("new_full", torch_ns=False), new_full_rule)  # x.new_full(size, v): as above
TABLE.add(TENSORS, value_arg(0, "data"))  # tensor(data): data not a batch size
TABLE.add(["new_tensor"], new_tensor_rule)  # x.new_tensor(data): data alone, x gives dtype
TABLE.add(spellings("arange", method=False) + aten("range"), arange_rule)  # arange(B): positions
# --- Contractions: the batch dim must not be contracted ----------------------------------
TABLE.add(MATMULS, matmul_rule)  # (B, n, k) @ (k, m)
TABLE.add(PRODUCTS, per_sample)  # the shapes show whether the batch survives (einsum's letter)
TABLE.add(KRONS, kron_rule)  # kron(x, a): a block of rows per sample; kron(a, x) interleaves
TABLE.add(CROSSES, cross_rule)  # along a dim of size 3; cross(a, b) picks it: specialised
TABLE.add(LINEARS, linear_layer_rule)  # (B, ..., in) -> (B, ..., out)
TABLE.add(BILINEARS, bilinear_rule)  # x1 A x2 per sample
# --- Embeddings: rows of a batch-free table picked by per-sample ids ---------------------
TABLE.add([nn.Embedding, F.embedding], embedding_rule(1))  # (B, T) ids -> (B, T, D)
TABLE.add(aten("embedding"), embedding_rule(0))  # aten.embedding(weight, ids)
TABLE.add(EMBEDDING_BAGS, embedding_bag_rule)  # (B, L) ids -> (B, D): one bag per sample
# --- Convolution, pooling, resampling, padding: (N, C, ...) per sample n -----------------
TABLE.add(CONVS_AND_POOLS, channels_first(None, "convolves, pools or resamples"))  # (N, C, *S)
TABLE.add(CONVOLUTIONS, channels_first(None, "convolves"))  # aten.convolution(x, w, ...)
TABLE.add(RESAMPLES, channels_first(None, "resamples or rearranges"))  # (N, C, *S) per n
TABLE.add(GRID_SAMPLES, channels_first(None, "samples a grid", extra=((1, "grid"),)))  # per n
TABLE.add(PADS, pad_rule)  # F.pad(x, pad): dims padded by (0, 0) may include the batch
# --- Norms: statistics per sample over feature dims; BatchNorm only in eval --------------
TABLE.add(LAYER_NORMS, along(normalized_dims, "normalises"))  # over the last k dims
TABLE.add(GROUP_NORMS, channels_first(0, "normalises"))  # (N, C, ...) per sample n
TABLE.add(BATCH_NORMS, batch_norm_rule)  # eval: running stats (per sample); training: mixes
TABLE.add(INSTANCE_NORMS, instance_norm_rule)  # per (sample, channel)
TABLE.add(LOCAL_NORMS, channels_first(0, "normalises across channels"))  # (N, C, ...) per n
TABLE.add([F.normalize], along(dim_arg(2, "dim", 1), "normalises"))  # x / ||x|| along dim
# --- Along-a-dim ops: normalise, sort, scan, compare; fine unless the dim is the batch ---
TABLE.add(SOFTMAXES, softmax_rule)  # softmax(x, d) along a non-batch dim
TABLE.add([nn.Softmax, nn.LogSoftmax, nn.Softmin], along(softmax_dims, "normalises"))  # .dim
TABLE.add([nn.Softmax2d], channels_first(2, "normalises across channels"))  # over C
TABLE.add([F.gumbel_softmax], along(dim_arg(4, "dim", -1), "normalises"))  # RNG + softmax
TABLE.add(SCANS, scan_rule)  # cumsum(x, d) along a non-batch dim
TABLE.add(SORTS, sort_rule)  # sort(x, d) along a non-batch dim
TABLE.add(RANKS, rank_rule)  # topk(x, k, d) along a non-batch dim
TABLE.add(spellings("glu"), along(dim_arg(1, "dim", -1), "pairs halves"))  # glu(x, d)
TABLE.add([nn.GLU], along(module_dim, "pairs halves"))  # nn.GLU(d)
TABLE.add(spellings("diff"), along(dim_arg(2, "dim", -1), "differences"))  # x[i+1] - x[i]
TABLE.add(VECTOR_PAIRS, along(compared_dims, "compares vectors", inputs=_PAIR))  # per row
TABLE.add(PDISTS, along(every_dim, "compares every pair of rows"))  # row pairs: batched mixes
# --- Attention and sequence layers: per sample along their batch dim ---------------------
TABLE.add(ATTENTIONS, sdpa_rule)  # (B, H, L, E) per sample
TABLE.add([nn.MultiheadAttention], multihead_attention_rule)  # (B, L, E) or (L, B, E)
TABLE.add(TRANSFORMERS, transformer_layer_rule)  # ditto, batch_first of the layer
TABLE.add(RNNS, rnn_rule)  # sequences per sample; states (layers, B, H)
TABLE.add(RNN_CELLS, along(last_dims(1), "contracts features"))  # (B, in) -> (B, hidden)
# --- Reductions: sum/mean over the batch become partial sums; max/var over it mix --------
TABLE.add(spellings("sum", "nansum"), reduction("sum"))  # Σ over the batch: a partial sum
TABLE.add(spellings("mean"), reduction("mean", partials.mean_partial))  # (Σ, count)
TABLE.add(NONLINEAR_REDUCTIONS, reduction(nonlinear=True))  # max, var, ... over the batch: mix
TABLE.add(VECTOR_NORMS, reduction(nonlinear="norm", dims=dim_arg(2, "dim")))  # norm(x, p, d)
TABLE.add(MATRIX_NORMS, matrix_norm_rule)  # over the last two dims by default
TABLE.add(DATA_SHAPED, along(every_dim, "counts or selects values"))  # sized by values: mixes
# --- Losses (partials.LOSSES): reduction 'none' per sample, 'sum' Σ, 'mean' (Σ, count) ---
TABLE.add(LOSS_SPELLINGS, loss_rule)  # batch at dim 0 of (N, C, ...) kinds, anywhere if elementwise
# --- Differentiation in forward (gradient penalties): per-sample outputs, per-sample inputs ---
TABLE.add(DIFFERENTIATIONS, autograd_grad_rule)  # ∂y[i]/∂x[i] per sample; a full sum of y too
# --- Token dispatch (tokens.py): these ops keep their rule above and add their meaning on ---
# --- sorted rows x', a sort's permutation p and its inverse inv (token_rules, token_moves) ---
TABLE.layer(TOKEN_SORTS, dispatching(resort, start=start_sort))  # sort(ids) -> ids', p
TABLE.layer(TOKEN_COUNTS, dispatching(count_sorted_key, start=count_key))  # histc(ids'): counts
TABLE.layer(TOKEN_CUMSUMS, dispatching(offsets))  # cumsum(counts): group offsets
TABLE.layer(TOKEN_CASTS, dispatching(cast))  # exact casts keep p, inv, counts and the sorted key
TABLE.layer(TOKEN_LIKES, dispatching(like))  # empty_like(p): sorted rows; zeros_like(inv): x
TABLE.layer(TOKEN_BROADCASTS, dispatching(broadcast))  # p[:, None].expand(-1, H): still p
TABLE.layer(TOKEN_FLOOR_DIVS, dispatching(floor_div))  # p // k: the token of each slot
TABLE.layer(TOKEN_MODS, dispatching(mod))  # p % k: each slot's place in its token, per row
TABLE.layer(TOKEN_DIVS, dispatching(div))  # div(p, k, rounding_mode='floor'): p // k
TABLE.layer(TOKEN_READS, dispatching(read))  # x[p], gather(x, 0, p): x'; x'[inv]: x
TABLE.layer(TOKEN_WRITES, dispatching(write))  # index_add(0, p // k, x'): x; inv[p] = arange
TABLE.layer(TOKEN_SIZES, dispatching(size))  # x'.size(0), len(p): numbers, as of any tensor
TABLE.layer([getattr], dispatching(attribute))  # (ids', p).indices; x'.shape
TABLE.layer(TOKEN_NEWS, new_of_values)  # p.new_zeros(n): p gives only dtype and device
# --- Grouped matmuls (grouped_matmuls.py), keyed by qualified name: a library loads late ----
TABLE.add(GROUPED_MMS, grouped_matmul("self", "mat2", "offs"))  # run g of x' meets W[g]
TABLE.add(F_GROUPED_MMS, grouped_matmul("mat_a", "mat_b", "offs"))  # F.grouped_mm: as above
TABLE.add(HF_GROUPED_MMS, grouped_matmul("input", "weight", "offs"))  # transformers': as above

#: The rules a layer called whole gets the same fact from in train and eval mode: every
#: layer rule above but BatchNorm's and InstanceNorm's (they read ``ctx.module.training``),
#: and the families a user names. A train/eval switch keeps a graph's facts where no layer
#: with another rule changed mode (``mbcompile/captures.py``).
MODE_FREE_RULES = frozenset(
    [rule for op, rule in TABLE.rules.items() if isinstance(op, type)] + list(FAMILIES.values())
) - {batch_norm_rule, instance_norm_rule}


# ---------------------------------------------------------------------------
# Users' lines
# ---------------------------------------------------------------------------

def register_batch_rule(op: Any, rule: Rule | str) -> None:
    """Register ``rule`` for ``op`` (a module class, function, method name or ATen op).

    ``rule`` is a function ``(RuleContext) -> Fact`` or the name of a built-in
    family: ``"per_sample"`` (the op never mixes samples: the output's batch dim
    is found from its shape), ``"pointwise"`` (elementwise: also rejects a
    non-linear function of a batch reduction), ``"linear"`` (linear in its
    inputs, so reductions pass through), ``"free"`` (batch-free unless shaped
    by the batch). Inside ``with scoped():`` the rule lasts for the block. An op of the
    token-dispatch section keeps its meaning on sorted rows; ``rule`` decides the rest.

    >>> mbcompile.register_batch_rule(my_ops.fused_gelu, "per_sample")
    >>> mbcompile.register_batch_rule("my_method", lambda ctx: ctx.batched_out())
    """
    if isinstance(rule, str):
        try:
            rule = FAMILIES[rule]
        except KeyError:
            raise ValueError(f"unknown rule family {rule!r}; one of {sorted(FAMILIES)}") from None
    if not callable(rule):
        raise TypeError(f"a batch rule is a function (RuleContext) -> Fact or a family name, "
                        f"got {rule!r}")
    key = rule_key(op)
    rewrap = getattr(TABLE.rules.get(key), "rewrap", None)  # a token-dispatch line's wrap
    TABLE.rules[key] = rewrap(rule) if rewrap is not None else rule


def trust_module(module_type: type[nn.Module]) -> type[nn.Module]:
    """Trust every instance of ``module_type`` as per-sample (a leaf, never traced into).

    Use it for your own layers that you know treat samples independently
    (custom kernels, code fx cannot trace): ``torch.fx`` capture keeps them as
    single ``call_module`` nodes, and the batch analysis finds their output's
    batch dim from its shape. Works as a class decorator too.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"trust_module takes an nn.Module subclass, got {module_type!r}")
    register_batch_rule(module_type, per_sample)
    TABLE.trusted.add(module_type)
    return module_type

