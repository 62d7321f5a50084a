"""A catalogue of small models and op patterns, each with its expected verdict.

Every entry is one forward written the way users write it. ``ACCEPT`` entries
must compile as an ordinary split (with ``coupling="reject"``: no op found mixing)
and equal eager PyTorch on the full batch, outputs and every gradient, in float64
(the plan: gbs 6 over 2 systems, mbs 2, so each system runs a microbatch of 2 and
one of 1). ``REJECT`` entries mix samples: with
``coupling="reject"`` they must raise a ``MixingError`` whose op names the
offending op and whose source line is the entry's own line marked
``# offending``; with the default (``coupling="two_phase"``) those that a
two-phase step can run (all but ``STILL_REJECTED``) must compile to one and equal
eager on the same uneven plan: outputs, every gradient and every buffer, in
float64. Entries marked ``EXPORT`` are also compiled through ``torch.export`` (the
ATen spellings of the same rules).

The shared inputs: ``x`` (B, T, F) features, ``mask`` (B, T) right padding
(1 = real token), ``y`` (B,) class ids, ``tok`` (B, T) token labels with -100 on
padding, ``img`` (B, C, H, W) images.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    TOL,
    assert_close_errors,
    grad_errors,
    grads_of,
    plan_free,
    rel_err,
    step_errors,
    tensor_leaves,
)

import mbcompile
from mbcompile import MixingError, UnsupportedOpError
from mbcompile.passes.batch_analysis import analyse_batch
from mbcompile.passes.facts import FACT, Batched, Free
from mbcompile.passes.shape_prop import propagate_shapes

# A bias that a normalisation cancels (InstanceNorm after a Linear) has a gradient that is
# zero up to rounding: each gradient is measured against at least this fraction of the largest.
GRAD_FLOOR = 1e-4
B, T, FEAT, HID, CLASSES, CH, HW = 6, 5, 6, 8, 4, 3, 8
GBS, NUM_CSX, MBS = 6, 2, 2


class Pattern(nn.Module):
    """``fn(self, x, mask, y, tok, img)`` with the layers it needs. ``fn`` returns a tuple
    whose first item is the loss, or per-sample features, which get a loss (their mean
    cube, which no normalisation makes constant) in front: every entry trains through a
    loss computed inside the model."""

    def __init__(self, fn: Callable[..., Any], **layers: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.layers = nn.ModuleDict(layers)
        self.lin = nn.Linear(FEAT, HID)
        self.head = nn.Linear(HID, CLASSES)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor,
                tok: torch.Tensor, img: torch.Tensor) -> Any:
        out = self.fn(self, x, mask, y, tok, img)  # the call site
        if not isinstance(out, tuple):  # per-sample features (a Proxy while tracing)
            return (out + 0.5).pow(3).mean(), out
        return out


@dataclass
class Entry:
    fn: Callable[..., Any]
    layers: dict[str, Callable[[], nn.Module]] = field(default_factory=dict)
    op: str = ""  # REJECT: a substring of the MixingError's op
    export: bool = False  # also compile through torch.export
    eval: bool = False  # compile and compare in eval mode
    unsupported: bool = False  # rejected for want of a rule (UnsupportedOpError)

    def build(self) -> Pattern:
        torch.manual_seed(0)
        model = Pattern(self.fn, **{k: make() for k, make in self.layers.items()}).double()
        return model.eval() if self.eval else model


def batch(seed: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, FEAT, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 2, 4, 1, 5, 3])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    y = torch.randint(0, CLASSES, (B,), generator=g)
    tok = torch.randint(0, CLASSES, (B, T), generator=g).masked_fill(mask == 0, -100)
    img = torch.randn(B, CH, HW, HW, generator=g, dtype=torch.float64)
    return x, mask, y, tok, img


def pooled(self: Pattern, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over time of tanh(lin(x)): (B, HID)."""
    h = torch.tanh(self.lin(x)) * mask.unsqueeze(-1)
    return h.sum(1) / mask.sum(1, keepdim=True).clamp_min(1)


# --------------------------------------------------------------------------- #
# Accepted: per-sample work, linear statistics, batch-size-dependent shapes
# --------------------------------------------------------------------------- #

def _mlp_mse(s, x, mask, y, tok, img):
    return (F.mse_loss(s.head(F.gelu(s.lin(x))), x.new_zeros(x.size(0), T, CLASSES)),)


def _cnn_groupnorm(s, x, mask, y, tok, img):
    h = s.layers.pool(F.relu(s.layers.gn(s.layers.conv(img))))
    logits = s.layers.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
    return F.cross_entropy(logits, y), logits


def _conv1d_time(s, x, mask, y, tok, img):
    return F.relu(s.layers.conv(s.lin(x).transpose(1, 2))).transpose(1, 2)


def _lstm_batch_first(s, x, mask, y, tok, img):
    out, (h, c) = s.layers.rnn(s.lin(x))
    logits = s.head(h[-1])
    return F.cross_entropy(logits, y), out, c


def _gru_time_major(s, x, mask, y, tok, img):
    out, h = s.layers.rnn(s.lin(x).transpose(0, 1))  # (T, B, H)
    return out.transpose(0, 1)


def _rnn_tanh(s, x, mask, y, tok, img):
    return s.layers.rnn(s.lin(x))[0]


def _embedding_bag(s, x, mask, y, tok, img):
    ids = tok.clamp_min(0)
    return s.layers.bag(ids)


def _embedding_positions(s, x, mask, y, tok, img):
    positions = torch.arange(x.size(1), device=x.device)
    return s.layers.tok(tok.clamp_min(0)) + s.layers.pos(positions)


def _mha_padding_mask(s, x, mask, y, tok, img):
    h = s.lin(x)
    out, weights = s.layers.mha(h, h, h, key_padding_mask=mask == 0)
    return out, weights


def _mha_pair(s, x, mask, y, tok, img):
    out, weights = _mha_padding_mask(s, x, mask, y, tok, img)
    return (out * mask.unsqueeze(-1)).pow(2).mean(), out, weights


def _encoder_layer(s, x, mask, y, tok, img):
    return s.layers.enc(s.lin(x), src_key_padding_mask=mask == 0) * mask.unsqueeze(-1)


def _sdpa_causal_tril(s, x, mask, y, tok, img):
    h = s.lin(x).view(x.size(0), T, 2, HID // 2).transpose(1, 2)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return F.scaled_dot_product_attention(h, h, h, attn_mask=causal)


def _interpolate(s, x, mask, y, tok, img):
    up = F.interpolate(img, scale_factor=2, mode="bilinear", align_corners=False)
    return s.layers.conv(up)


def _pad_time(s, x, mask, y, tok, img):
    return F.pad(s.lin(x).transpose(1, 2), (2, 0)).transpose(1, 2)


def _where_masked_fill(s, x, mask, y, tok, img):
    h = s.lin(x)
    h = torch.where(mask.unsqueeze(-1).bool(), h, torch.zeros_like(h))
    return h.masked_fill(mask.unsqueeze(-1) == 0, -1.0).softmax(-1)


def _gather_label_logit(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    picked = logits.gather(1, y[:, None]).squeeze(1)
    return -picked.mean(), picked


def _index_select_features(s, x, mask, y, tok, img):
    keep = torch.tensor([0, 2, 5], device=x.device)
    return s.lin(x).index_select(-1, keep)


def _einsum_batch_letter(s, x, mask, y, tok, img):
    h = torch.einsum("btf,fh->bth", x, s.lin.weight.t())
    return torch.einsum("bth,bth->bt", h, h)


def _cumsum_time(s, x, mask, y, tok, img):
    return torch.cumsum(s.lin(x) * mask.unsqueeze(-1), dim=1)


def _topk_features(s, x, mask, y, tok, img):
    return s.lin(x).topk(3, dim=-1).values


def _one_hot(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    return (logits * F.one_hot(y, CLASSES).to(logits.dtype)).sum(-1)


def _arange_batch_index(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    picked = logits[torch.arange(x.size(0)), y]  # one logit per sample
    return picked


def _view_size0(s, x, mask, y, tok, img):
    return s.head(s.lin(x).view(x.size(0), -1)[:, :HID])


def _sum_over_shape0(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    loss = F.cross_entropy(logits, y, reduction="sum") / y.shape[0]
    return loss, logits


def _likes(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h + torch.ones_like(h) + torch.full_like(h, 0.5) - torch.zeros_like(h)


def _casts(s, x, mask, y, tok, img):
    h = s.lin(x.float().double()).to(torch.float64)
    return h.type_as(x).contiguous()


def _expand_repeat_features(s, x, mask, y, tok, img):
    h = s.lin(x)[:, :, :2]
    return h.unsqueeze(2).expand(-1, -1, 3, -1).reshape(x.size(0), T, 6) + h.repeat(1, 1, 3)


def _tril_triu_time(s, x, mask, y, tok, img):
    h = s.lin(x)
    scores = h @ h.transpose(1, 2)  # (B, T, T) per sample
    return torch.tril(scores) - torch.triu(scores, diagonal=1)


def _chunk_split_cat_stack(s, x, mask, y, tok, img):
    a, b = s.lin(x).chunk(2, dim=-1)
    c, d = torch.split(a, 2, dim=-1)
    return torch.cat([c, d, b], dim=-1) + torch.stack([a, b], dim=2).sum(2).repeat(1, 1, 2)


def _split_sizes(s, x, mask, y, tok, img):
    a, b, c = torch.split(s.lin(x), [2, 4, 2], dim=-1)
    return torch.cat([c, a, b.tanh()], dim=-1)


class _Schedule(nn.Module):
    """A diffusion model's noise schedule: ``alphas_cumprod`` as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("alphas_cumprod", torch.linspace(0.99, 0.1, 10).cumprod(0))


def _schedule_at_timestep(s, x, mask, y, tok, img):
    t = y * 2 + 1  # a per-sample timestep
    a = s.layers.sched.alphas_cumprod[t]  # a buffer indexed by a per-sample tensor
    return s.lin(x) * a.sqrt()[:, None, None] + (1 - a)[:, None, None]


def _masked_mean_stat(s, x, mask, y, tok, img):
    h = torch.tanh(s.lin(x))
    m = mask.unsqueeze(-1).to(h.dtype)
    masked_mean = (h * m).sum() / (m.sum() * HID)  # weighted by the attention mask
    logits = s.head(pooled(s, x, mask))
    return F.cross_entropy(logits, y), masked_mean


def _accuracy_and_token_counts(s, x, mask, y, tok, img):
    logits = s.head(torch.tanh(s.lin(x)))
    loss = F.cross_entropy(logits.view(-1, CLASSES), tok.view(-1), ignore_index=-100)
    correct = ((logits.argmax(-1) == tok) & (tok != -100)).sum()
    tokens = (tok != -100).sum()
    return loss, correct, tokens, correct.double() / tokens


def _accuracy_mean(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    accuracy = (logits.argmax(-1) == y).float().mean()
    return F.cross_entropy(logits, y), accuracy


def _log_softmax_nll(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    return F.nll_loss(F.log_softmax(logits, dim=-1), y), logits


def _norms(s, x, mask, y, tok, img):
    return s.layers.rms(s.layers.ln(s.lin(x)))


def _batchnorm_eval(s, x, mask, y, tok, img):
    return s.layers.bn(s.lin(x).transpose(1, 2))


def _instance_norm(s, x, mask, y, tok, img):
    return s.layers.inorm(s.lin(x).transpose(1, 2))


def _dropout_zero(s, x, mask, y, tok, img):
    return F.dropout(s.layers.drop(s.lin(x)), p=0.0, training=s.training)


def _sort_features(s, x, mask, y, tok, img):
    return torch.sort(s.lin(x), dim=-1, descending=True).values


def _pixel_shuffle(s, x, mask, y, tok, img):
    return F.pixel_shuffle(s.layers.conv(img), 2)


def _two_losses(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    return F.cross_entropy(logits, y) + 0.1 * logits.pow(2).mean(), logits


def _bce_smoothl1_kldiv(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    target = F.one_hot(y, CLASSES).to(logits.dtype)
    loss = (F.binary_cross_entropy_with_logits(logits, target)
            + F.smooth_l1_loss(logits, target)
            + F.kl_div(F.log_softmax(logits, -1), target * 0.9 + 0.025, reduction="batchmean"))
    return loss, logits


def _metric_losses(s, x, mask, y, tok, img):
    a = pooled(s, x, mask)
    p, n = torch.tanh(s.layers.proj(a)), torch.roll(a, 1, dims=-1)
    sign = (y % 2 * 2 - 1).to(a.dtype)
    loss = (s.layers.triplet(a, p, n) + F.cosine_embedding_loss(a, p, sign)
            + F.margin_ranking_loss(a.sum(-1), p.sum(-1), sign))
    return loss, a


def _token_ce_smoothing(s, x, mask, y, tok, img):
    logits = s.head(torch.tanh(s.lin(x)))
    return F.cross_entropy(logits.view(-1, CLASSES), tok.view(-1), ignore_index=-100,
                           label_smoothing=0.1), logits


def _take_along_dim(s, x, mask, y, tok, img):
    h = s.lin(x)
    idx = h.detach().argsort(-1)[..., :3]
    return torch.take_along_dim(h, idx, dim=-1)


def _flatten_module(s, x, mask, y, tok, img):
    return s.layers.mlp(x)


def _squeeze_feature(s, x, mask, y, tok, img):
    return s.layers.score(s.lin(x)).squeeze(-1)


def _hidden_from_arange(s, x, mask, y, tok, img):
    """The last real token of each sequence, HuggingFace style."""
    h = torch.tanh(s.lin(x))
    last = mask.sum(1) - 1
    return h[torch.arange(x.size(0), device=x.device), last]


def _sum_over_batch_size(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h.pow(2).sum() / x.size(0), h


# --------------------------------------------------------------------------- #
# Rejected: each mixes samples (or hides a batch size), at the "# offending" line
# --------------------------------------------------------------------------- #

def _r_batchnorm_train(s, x, mask, y, tok, img):
    return s.layers.bn(s.lin(x).transpose(1, 2))  # offending


def _r_softmax_batch(s, x, mask, y, tok, img):
    return torch.softmax(s.lin(x), dim=0)  # offending


def _r_center_batch_mean(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h - h.mean(0)  # offending


def _r_gram(s, x, mask, y, tok, img):
    z = pooled(s, x, mask)
    return z @ z.T  # offending


def _r_baked_batch_size(s, x, mask, y, tok, img):
    return s.lin(x).view(6, -1)  # offending


def _r_bool_mask_index(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h[mask.bool()]  # offending


def _r_sqrt_of_loss(s, x, mask, y, tok, img):
    loss = F.cross_entropy(s.head(pooled(s, x, mask)), y)
    return loss.sqrt(), loss  # offending


def _r_max_batch(s, x, mask, y, tok, img):
    return s.lin(x).max(0).values  # offending


def _r_cumsum_batch(s, x, mask, y, tok, img):
    return s.lin(x).cumsum(0)  # offending


def _r_flip_batch(s, x, mask, y, tok, img):
    return s.lin(x).flip(0)  # offending


def _r_roll_batch(s, x, mask, y, tok, img):
    return torch.roll(s.lin(x), 1, 0)  # offending


def _r_in_batch_negatives(s, x, mask, y, tok, img):
    q, k = pooled(s, x, mask), torch.tanh(pooled(s, x, mask))
    scores = q @ k.t()  # offending
    return F.cross_entropy(scores, torch.arange(x.size(0))), scores


def _r_batch_size_value(s, x, mask, y, tok, img):
    return s.lin(x) * x.size(0)  # offending


def _r_positions_value(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h + torch.arange(x.size(0))[:, None, None]  # offending


def _r_shuffle(s, x, mask, y, tok, img):
    perm = torch.randperm(x.size(0))
    return s.lin(x)[perm]  # offending


def _r_first_sample(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h - h[0]  # offending


def _r_lstm_wrong_batch_dim(s, x, mask, y, tok, img):
    return s.layers.rnn(s.lin(x))[0]  # offending


def _r_mha_wrong_batch_dim(s, x, mask, y, tok, img):
    h = s.lin(x)
    return s.layers.mha(h, h, h)[0]  # offending


def _r_fft(s, x, mask, y, tok, img):
    return torch.fft.fft(s.lin(x)).abs()  # offending


def _squeeze_all(s, x, mask, y, tok, img):
    return s.lin(x)[:, :1].squeeze()  # the batch dim is kept: B > 1 at the full batch


def _r_contract_batch(s, x, mask, y, tok, img):
    z = pooled(s, x, mask)
    return z.T @ z  # offending


def _r_cat_batch(s, x, mask, y, tok, img):
    h = s.lin(x)
    return torch.cat([h, h], dim=0)  # offending


def _r_product_of_reductions(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    loss = F.cross_entropy(logits, y)
    acc = (logits.argmax(-1) == y).double().mean()
    return loss * F.mse_loss(logits, torch.zeros_like(logits)), acc  # offending


def _r_var_batch(s, x, mask, y, tok, img):
    return s.lin(x).var(0)  # offending


def _r_instance_norm_running(s, x, mask, y, tok, img):
    return s.layers.inorm(s.lin(x).transpose(1, 2))  # offending


def _r_pad_batch(s, x, mask, y, tok, img):
    return F.pad(s.lin(x), (0, 0, 0, 0, 1, 1))  # offending


def _r_tril_batch(s, x, mask, y, tok, img):
    return torch.tril(pooled(s, x, mask))  # offending


def _r_gather_batch(s, x, mask, y, tok, img):
    z = pooled(s, x, mask)
    return z.gather(0, y[:, None].expand(-1, HID))  # offending


def _r_square_of_accuracy(s, x, mask, y, tok, img):
    logits = s.head(pooled(s, x, mask))
    acc = (logits.argmax(-1) == y).double().mean()
    return F.cross_entropy(logits, y), acc ** 2  # offending


def _r_normalise_by_batch_sum(s, x, mask, y, tok, img):
    h = s.lin(x).exp()
    return h / h.sum(0)  # offending


def _r_repeat_batch(s, x, mask, y, tok, img):
    return s.lin(x).repeat(2, 1, 1)  # offending


def _conv2d(cin: int = CH, cout: int = 4) -> Callable[[], nn.Module]:
    return lambda: nn.Conv2d(cin, cout, 3, padding=1)


ACCEPT: dict[str, Entry] = {
    "mlp-mse": Entry(_mlp_mse, export=True),
    "squeeze-all-keeps-batch": Entry(_squeeze_all, export=True),
    "cnn-groupnorm-pool": Entry(_cnn_groupnorm, {
        "conv": _conv2d(), "gn": lambda: nn.GroupNorm(2, 4), "pool": lambda: nn.MaxPool2d(2),
        "fc": lambda: nn.Linear(4, CLASSES)}, export=True),
    "conv1d-over-time": Entry(_conv1d_time, {"conv": lambda: nn.Conv1d(HID, HID, 3, padding=1)}),
    "lstm-batch-first": Entry(_lstm_batch_first, {
        "rnn": lambda: nn.LSTM(HID, HID, batch_first=True)}, export=True),
    "gru-time-major": Entry(_gru_time_major, {"rnn": lambda: nn.GRU(HID, HID)}, export=True),
    "rnn-tanh-2-layers": Entry(_rnn_tanh, {
        "rnn": lambda: nn.RNN(HID, HID, num_layers=2, batch_first=True)}),
    "embedding-bag-2d": Entry(_embedding_bag, {
        "bag": lambda: nn.EmbeddingBag(CLASSES, HID, mode="mean")}),
    "embedding-plus-positions": Entry(_embedding_positions, {
        "tok": lambda: nn.Embedding(CLASSES, HID), "pos": lambda: nn.Embedding(T, HID)},
        export=True),
    "mha-key-padding-mask": Entry(_mha_pair, {
        "mha": lambda: nn.MultiheadAttention(HID, 2, batch_first=True)}, export=True),
    "transformer-encoder-layer": Entry(_encoder_layer, {
        "enc": lambda: nn.TransformerEncoderLayer(HID, 2, 16, dropout=0.0,
                                                  batch_first=True)}),
    "sdpa-tril-mask": Entry(_sdpa_causal_tril, export=True),
    "interpolate-bilinear": Entry(_interpolate, {"conv": _conv2d()}, export=True),
    "pad-time": Entry(_pad_time, export=True),
    "where-masked-fill": Entry(_where_masked_fill, export=True),
    "gather-label-logit": Entry(_gather_label_logit, export=True),
    "index-select-features": Entry(_index_select_features, export=True),
    "einsum-batch-letter": Entry(_einsum_batch_letter, export=True),
    "cumsum-over-time": Entry(_cumsum_time, export=True),
    "topk-over-features": Entry(_topk_features, export=True),
    "one-hot": Entry(_one_hot, export=True),
    "arange-batch-index": Entry(_arange_batch_index, export=True),
    "view-size0": Entry(_view_size0, export=True),
    "sum-over-labels-shape0": Entry(_sum_over_shape0, export=True),
    "ones-zeros-full-like": Entry(_likes, export=True),
    "casts": Entry(_casts, export=True),
    "expand-repeat-features": Entry(_expand_repeat_features, export=True),
    "tril-triu-over-time": Entry(_tril_triu_time, export=True),
    "chunk-split-cat-stack": Entry(_chunk_split_cat_stack, export=True),
    "masked-mean-statistic": Entry(_masked_mean_stat, export=True),
    "accuracy-and-token-counts": Entry(_accuracy_and_token_counts, export=True),
    "accuracy-mean": Entry(_accuracy_mean, export=True),
    "log-softmax-nll": Entry(_log_softmax_nll, export=True),
    "layernorm-rmsnorm": Entry(_norms, {"ln": lambda: nn.LayerNorm(HID),
                                        "rms": lambda: nn.RMSNorm(HID)}, export=True),
    "batchnorm-eval": Entry(_batchnorm_eval, {"bn": lambda: nn.BatchNorm1d(HID)}, eval=True,
                            export=True),
    "instance-norm": Entry(_instance_norm, {"inorm": lambda: nn.InstanceNorm1d(HID)}),
    "dropout-p0": Entry(_dropout_zero, {"drop": lambda: nn.Dropout(0.0)}),
    "sort-over-features": Entry(_sort_features, export=True),
    "pixel-shuffle": Entry(_pixel_shuffle, {"conv": _conv2d(CH, 8)}),
    "two-losses": Entry(_two_losses),
    "bce-smoothl1-kldiv": Entry(_bce_smoothl1_kldiv, export=True),
    "triplet-cosine-ranking": Entry(_metric_losses, {
        "proj": lambda: nn.Linear(HID, HID), "triplet": lambda: nn.TripletMarginLoss()},
        export=True),
    "token-ce-label-smoothing": Entry(_token_ce_smoothing, export=True),
    "take-along-dim": Entry(_take_along_dim),  # export specialises its batch size
    "flatten-module": Entry(_flatten_module, {"mlp": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(T * FEAT, HID), nn.Tanh())}, export=True),
    "squeeze-feature": Entry(_squeeze_feature, {"score": lambda: nn.Linear(HID, 1)},
                             export=True),
    "last-token-by-arange": Entry(_hidden_from_arange, export=True),
    "sum-over-batch-size": Entry(_sum_over_batch_size, export=True),
    "split-with-sizes": Entry(_split_sizes, export=True),  # torch.split(h, [2, 4, 2], -1)
    "schedule-at-timestep": Entry(_schedule_at_timestep, {"sched": _Schedule}, export=True),
}

REJECT: dict[str, Entry] = {
    "batchnorm-training": Entry(_r_batchnorm_train, {"bn": lambda: nn.BatchNorm1d(HID)},
                                op="BatchNorm1d"),
    "softmax-over-batch": Entry(_r_softmax_batch, op="softmax"),
    "minus-batch-mean": Entry(_r_center_batch_mean, op="sub"),
    "gram-matrix": Entry(_r_gram, op="matmul"),
    "baked-batch-size": Entry(_r_baked_batch_size, op="view"),
    "bool-mask-index": Entry(_r_bool_mask_index, op="getitem"),
    "sqrt-of-loss": Entry(_r_sqrt_of_loss, op="sqrt"),
    "max-over-batch": Entry(_r_max_batch, op="max"),
    "cumsum-over-batch": Entry(_r_cumsum_batch, op="cumsum"),
    "flip-batch": Entry(_r_flip_batch, op="flip"),
    "roll-batch": Entry(_r_roll_batch, op="roll"),
    "in-batch-negatives": Entry(_r_in_batch_negatives, op="matmul"),
    "batch-size-as-value": Entry(_r_batch_size_value, op="mul"),
    "positions-as-value": Entry(_r_positions_value, op="add"),
    "shuffle-batch": Entry(_r_shuffle, op="getitem"),
    "first-sample": Entry(_r_first_sample, op="getitem"),
    "lstm-wrong-batch-dim": Entry(_r_lstm_wrong_batch_dim, {"rnn": lambda: nn.LSTM(HID, HID)},
                                  op="LSTM"),
    "mha-wrong-batch-dim": Entry(_r_mha_wrong_batch_dim, {
        "mha": lambda: nn.MultiheadAttention(HID, 2)}, op="MultiheadAttention"),
    "fft-without-rule": Entry(_r_fft, op="fft", unsupported=True),
    "contract-batch": Entry(_r_contract_batch, op="matmul"),
    "cat-batch": Entry(_r_cat_batch, op="cat"),
    "product-of-reductions": Entry(_r_product_of_reductions, op="mul"),
    "var-over-batch": Entry(_r_var_batch, op="var"),
    "instance-norm-running-stats": Entry(_r_instance_norm_running, {
        "inorm": lambda: nn.InstanceNorm1d(HID, track_running_stats=True)},
        op="InstanceNorm1d"),
    "pad-batch": Entry(_r_pad_batch, op="pad"),
    "tril-over-batch": Entry(_r_tril_batch, op="tril"),
    "gather-over-batch": Entry(_r_gather_batch, op="gather"),
    "square-of-accuracy": Entry(_r_square_of_accuracy, op="pow"),
    "normalise-by-batch-sum": Entry(_r_normalise_by_batch_sum, op="truediv"),
    "repeat-batch-returned": Entry(_r_repeat_batch, op="repeat"),
}
# The ATen spellings reject the same patterns (the op as export spells it).
REJECT_EXPORT: dict[str, str] = {
    "batchnorm-training": "batch_norm",
    "softmax-over-batch": "aten.softmax",
    "minus-batch-mean": "aten.sub",
    "gram-matrix": "aten.matmul",
    "max-over-batch": "aten.max",
    "cumsum-over-batch": "aten.cumsum",
    "flip-batch": "aten.flip",
    "batch-size-as-value": "aten.mul",
    "positions-as-value": "aten.add",
    "first-sample": "aten.select",
    "cat-batch": "aten.cat",
    "var-over-batch": "aten.var",
    "gather-over-batch": "aten.gather",
    "square-of-accuracy": "aten.pow",
    "normalise-by-batch-sum": "aten.div",
    "pad-batch": "aten.pad",
}


def _compile(model: nn.Module, inputs: tuple[torch.Tensor, ...], capture: str = "auto",
             coupling: str | None = None) -> mbcompile.CompiledModule:
    """``coupling=None``: compile's default."""
    options = {} if coupling is None else {"coupling": coupling}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RetainedActivationsWarning for two-losses
        return mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=inputs,
                                 capture=capture, **plan_free(MBS, **options))


def check_exact(entry: Entry, capture: str, coupling: str | None = None
                ) -> mbcompile.CompiledModule:
    """Compile ``entry``, run one compiled and one eager step: outputs and gradients equal."""
    model, inputs = entry.build(), batch()
    cm = _compile(model, inputs, capture, coupling)
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = cm(*inputs)
    out[0].backward()
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    want = model(*inputs)
    want[0].backward()
    got_leaves, want_leaves = tensor_leaves(out), tensor_leaves(want)
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        if not w.is_floating_point():
            assert torch.equal(g, w), (path, g, w)
    assert_close_errors({p: rel_err(g, w) for (p, g), (_, w) in zip(got_leaves, want_leaves)
                         if w.is_floating_point()}, TOL)
    assert_close_errors(grad_errors(got, grads_of(model), GRAD_FLOOR), TOL)
    return cm


def check_split(entry: Entry, capture: str) -> None:
    """An accepted entry compiles as an ordinary split: its rules alone prove it per-sample
    (a rule that wrongly found mixing would still be exact, run as a two-phase step)."""
    cm = check_exact(entry, capture, coupling="reject")
    assert cm.analysis.rejected is None and cm.analysis.two_phase is False, cm.analysis.rejected


@pytest.mark.parametrize("name", ACCEPT)
def test_accepted_and_exact(name: str) -> None:
    check_split(ACCEPT[name], "fx")


@pytest.mark.parametrize("name", [n for n, e in ACCEPT.items() if e.export])
def test_accepted_and_exact_through_export(name: str) -> None:
    check_split(ACCEPT[name], "export")


_CALL_LINE = next(i + 1 for i, line in enumerate(open(__file__).read().splitlines())
                  if line.endswith("# the call site"))


def _offending_line(entry: Entry) -> int:
    code = entry.fn.__code__
    import inspect

    lines, start = inspect.getsourcelines(code)
    return start + next(i for i, line in enumerate(lines) if line.rstrip().endswith(
        "# offending"))


@pytest.mark.parametrize("name", REJECT)
def test_rejected_naming_the_op(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        _compile(entry.build(), batch(), "fx", "reject")
    err = info.value
    assert isinstance(err, UnsupportedOpError) == entry.unsupported, str(err)
    assert entry.op in err.op, (err.op, str(err))
    assert f"test_rules_catalogue.py:{_offending_line(entry)}" in str(err), str(err)


@pytest.mark.parametrize("name", REJECT_EXPORT)
def test_rejected_through_export(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        _compile(entry.build(), batch(), "export", "reject")
    assert REJECT_EXPORT[name] in info.value.op, (info.value.op, str(info.value))
    # torch.export records the frames of module forwards only: the line in a layer's
    # forward, or, for these plain functions, the line of Pattern.forward that calls them.
    lines = (_offending_line(entry), _CALL_LINE)
    assert any(f"test_rules_catalogue.py:{n}:" in str(info.value) for n in lines), str(
        info.value)


# A two-phase step cannot help these: a batch size baked into a shape, a data-dependent
# number of rows, an op without a rule, an output whose rows interleave the samples.
STILL_REJECTED = {"baked-batch-size", "bool-mask-index", "fft-without-rule",
                  "repeat-batch-returned"}


@pytest.mark.parametrize("name", sorted(STILL_REJECTED))  # one order for every xdist worker
def test_what_a_two_phase_step_cannot_run_is_rejected_by_default(name: str) -> None:
    entry = REJECT[name]
    with pytest.raises(MixingError) as info:
        _compile(entry.build(), batch(), "fx")
    assert isinstance(info.value, UnsupportedOpError) == entry.unsupported, str(info.value)
    assert entry.op in info.value.op, (info.value.op, str(info.value))


def check_two_phase(name: str, capture: str) -> None:
    """The default compile runs the mixing entry as a two-phase step on the uneven plan
    (2 + 1 per system), equal to one eager full-batch step of a copy of the model."""
    model, inputs = REJECT[name].build(), batch()
    cm = _compile(model, inputs, capture)
    assert cm.analysis.rejected is not None and "two-phase step" in cm.plan.reason
    assert cm.plan.microbatch_sizes == ((2, 1), (2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TwoPhaseWarning: C holds most of the memory
        errors = step_errors(model, cm, inputs, floor=GRAD_FLOOR)
    assert_close_errors(errors, TOL)


@pytest.mark.parametrize("name", [n for n in REJECT if n not in STILL_REJECTED])
def test_mixing_runs_as_an_exact_two_phase_step(name: str) -> None:
    check_two_phase(name, "fx")


@pytest.mark.parametrize("name", REJECT_EXPORT)
def test_mixing_runs_as_an_exact_two_phase_step_through_export(name: str) -> None:
    check_two_phase(name, "export")


def test_baked_batch_size_through_export_names_the_constant() -> None:
    """export itself refuses the specialised batch dim; the error says what that means."""
    with pytest.raises(mbcompile.CaptureError) as info:
        _compile(REJECT["baked-batch-size"].build(), batch(), "export")
    assert "baked in" in str(info.value) and "x.view(6, -1)" in str(info.value)


def test_catalogue_is_large_enough() -> None:
    assert len(ACCEPT) + len(REJECT) >= 40


# --------------------------------------------------------------------------- #
# Linear statistics, trusted layers and user rules
# --------------------------------------------------------------------------- #


def test_statistics_next_to_the_loss_keep_one_microbatch_of_memory() -> None:
    """Accuracy and token counts carry no gradient: the loss alone is trained, so the step
    still runs backward per microbatch (no RetainedActivationsWarning)."""
    model, inputs = ACCEPT["accuracy-and-token-counts"].build(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RetainedActivationsWarning)
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=inputs)
        loss, correct, tokens, accuracy = cm(*inputs)
    loss.backward()
    assert tokens.item() == (inputs[3] != -100).sum().item() == 20
    assert correct.dtype == torch.int64 and 0 <= correct.item() <= 20


def test_masked_mean_uses_the_global_mask_count() -> None:
    """Microbatches hold 7, 4, 6 and 3 real tokens: a mean of per-microbatch means is wrong,
    the exact masked mean divides the global sum by the global count."""
    model, inputs = ACCEPT["masked-mean-statistic"].build(), batch()
    x, mask = inputs[0], inputs[1]
    cm = _compile(model, inputs)
    with torch.no_grad():
        _, masked_mean = cm(*inputs)
        h = torch.tanh(model.lin(x)) * mask.unsqueeze(-1)
        per_mb = [h[a:b].sum() / (mask[a:b].sum() * HID) for a, b in ((0, 2), (2, 3), (3, 5),
                                                                      (5, 6))]
    want = h.sum() / (mask.sum() * HID)
    assert rel_err(masked_mean, want) <= TOL
    assert rel_err(torch.stack(per_mb).mean(), want) > 1e-3  # the naive combination differs


class NoisyGate(nn.Module):
    """A layer fx cannot trace (a Python branch on values) that treats samples independently."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if bool((h.abs() > 1e6).any()):
            h = h.clamp(-1e6, 1e6)
        return h * torch.sigmoid(self.scale * h)


def _trusted(s, x, mask, y, tok, img):
    return s.layers.gate(s.lin(x))


def test_trusted_layer_is_a_per_sample_leaf() -> None:
    from mbcompile.passes.rules import BATCH_RULES, TRUSTED_MODULES

    entry = Entry(_trusted, {"gate": NoisyGate})
    with pytest.raises(mbcompile.MbcompileError):  # fx cannot trace it, nor export
        _compile(entry.build(), batch(), "fx")
    try:
        assert mbcompile.trust_module(NoisyGate) is NoisyGate
        check_exact(entry, "fx")
        cm = _compile(entry.build(), batch(), "fx")
        assert "layers.gate" in [n.target for n in cm.original_graph_module.graph.nodes
                                 if n.op == "call_module"]
    finally:
        TRUSTED_MODULES.discard(NoisyGate)
        BATCH_RULES.pop(NoisyGate, None)


def scaled_rows(h: torch.Tensor) -> torch.Tensor:
    """A function fx keeps as one call (torch.fx.wrap): mbcompile has no rule for it."""
    return h * torch.arange(1, h.shape[-1] + 1, dtype=h.dtype)


torch.fx.wrap("scaled_rows")


def _wrapped(s, x, mask, y, tok, img):
    return scaled_rows(s.lin(x))


def test_user_rule_for_a_wrapped_function() -> None:
    from mbcompile.passes.rules import BATCH_RULES

    entry = Entry(_wrapped)
    with pytest.raises(UnsupportedOpError, match="register_batch_rule"):
        _compile(entry.build(), batch(), "fx")
    try:
        mbcompile.register_batch_rule(scaled_rows, "per_sample")
        check_exact(entry, "fx")
        # A rule is a function of the RuleContext too: this one finds the batch dim itself.
        mbcompile.register_batch_rule(scaled_rows, lambda ctx: ctx.batched_out())
        check_exact(entry, "fx")
    finally:
        BATCH_RULES.pop(scaled_rows, None)


# --------------------------------------------------------------------------- #
# Functional writes: what functionalization makes of x[...] = y (issue 12, item 1)
# --------------------------------------------------------------------------- #
# torch.export's functionalization turns ``x[:, 1:] = y`` into ``slice_scatter(x,
# copy(x[:, 1:], y), 1, 1)``, ``x[:, 0] = v`` into ``select_scatter``, ``x.diagonal()
# .copy_(y)`` into ``diagonal_scatter`` and ``x[mask] = v`` into ``index_put``; the
# capture spells ``copy`` as ``clone(expand_as(_to_copy(y), x))``, which autograd can
# differentiate. Each pattern compiles with coupling="reject" (so nothing runs as a
# two-phase step: the rules alone prove it per-sample) and equals eager in float64.

def _w_shift_tokens_right(s, x, mask, y, tok, img):
    """transformers' shift_tokens_right (BART, T5): a new_zeros of the batch's shape."""
    ids = tok.masked_fill(tok == -100, 0)
    shifted = ids.new_zeros(ids.shape)
    shifted[:, 1:] = ids[:, :-1].clone()  # slice_scatter along dim 1
    shifted[:, 0] = 2  # select_scatter along dim 1
    shifted.masked_fill_(shifted == -100, 0)
    return torch.tanh(s.lin(x)) * (shifted.unsqueeze(-1) + 1)


def _w_copy_broadcast(s, x, mask, y, tok, img):
    """copy_ of a (B, 1, H) value that needs grad into a (B, T, H) buffer: a broadcast."""
    h = s.lin(x).mean(1, keepdim=True)
    out = h.new_zeros(h.size(0), T, HID)
    out.copy_(h)
    return out * mask.unsqueeze(-1)


def _w_whole_batch_slice(s, x, mask, y, tok, img):
    """out[:] = h: a slice_scatter along the batch dim that keeps every sample."""
    h = s.lin(x)
    out = torch.zeros_like(h)
    out[:] = torch.tanh(h)
    return out


def _w_diagonal(s, x, mask, y, tok, img):
    """A per-sample diagonal matrix written through x.diagonal(): diagonal_scatter."""
    h = s.lin(x).mean(1)
    m = h.new_zeros(h.size(0), HID, HID)
    m.diagonal(dim1=1, dim2=2).copy_(torch.tanh(h))
    return m @ s.lin.weight


def _w_mask_write(s, x, mask, y, tok, img):
    """h[mask == 0] = 0.5 with a per-sample (B, T) mask: index_put."""
    h = torch.tanh(s.lin(x)).clone()  # tanh's backward reads its own output
    h[mask == 0] = 0.5
    return h


def _w_int_into_float(s, x, mask, y, tok, img):
    """An int mask written into a float column: the copy converts the dtype."""
    out = torch.tanh(s.lin(x)).clone()
    out[..., 0] = mask
    return out


WRITES: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "shift-tokens-right": (_w_shift_tokens_right, ("slice_scatter", "select_scatter")),
    "copy-broadcast": (_w_copy_broadcast, ("expand_as",)),
    "whole-batch-slice": (_w_whole_batch_slice, ("slice_scatter",)),
    "diagonal": (_w_diagonal, ("diagonal_scatter",)),
    "mask-write": (_w_mask_write, ("index_put",)),
    "int-into-float": (_w_int_into_float, ("select_scatter", "_to_copy")),
}


def _aten_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target).split(".")[1] for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("aten.")]


@pytest.mark.parametrize("name", WRITES)
def test_functional_write_is_per_sample_and_exact(name: str) -> None:
    fn, ops = WRITES[name]
    cm = check_exact(Entry(fn), "export", coupling="reject")
    assert cm.plan.per_system_batch_sizes == (3, 3) and cm.plan.mbs == 2  # 2 + 1 each
    found = _aten_ops(cm.original_graph_module)
    assert set(ops) <= set(found), found
    assert "copy" not in found  # ATen's copy has no derivative: the capture respells it


def test_whole_batch_slice_write_is_along_the_batch_dim() -> None:
    """The accepted out[:] = h really scatters along dim 0, the batch dim, whole."""
    cm = _compile(Entry(_w_whole_batch_slice).build(), batch(), "export", "reject")
    (node,) = [n for n in cm.original_graph_module.graph.nodes
               if n.target is torch.ops.aten.slice_scatter.default]
    assert node.args[2:3] in ((), (0,)) and node.meta[FACT] == Batched(0)


def _r_masked_scatter(s, x, mask, y, tok, img):
    h = s.lin(x)
    return h.masked_scatter(mask.bool().unsqueeze(-1), h * 2)  # offending


def _r_interleaved_rows_written(s, x, mask, y, tok, img):
    h = s.lin(x)
    out = h.flatten(0, 1).clone()  # (B*T, H) sample-major
    out[:, :2] = h.transpose(0, 1).flatten(0, 1)[:, :2]  # (T*B, 2) time-major rows
    return out.view(x.size(0), T, HID)


WRITE_REJECTS: dict[str, tuple[Callable[..., Any], str, str]] = {
    "masked-scatter": (_r_masked_scatter, "masked_scatter", "in order over the whole batch"),
    "interleaved-rows-written": (_r_interleaved_rows_written, "slice_scatter",
                                 "into another sample's rows"),
}


@pytest.mark.parametrize("name", WRITE_REJECTS)
def test_functional_write_that_mixes_is_rejected_with_its_reason(name: str) -> None:
    fn, op, reason = WRITE_REJECTS[name]
    with pytest.raises(MixingError) as info:
        _compile(Entry(fn).build(), batch(), "export", "reject")
    assert op in info.value.op and reason in str(info.value), str(info.value)


# The writes into rows of the batch dim that a model cannot reach (the slice or select of
# the batch dim that export puts before them is rejected first), on graphs written in ATen.
_ATEN_WRITES: dict[str, tuple[Callable[..., Any], str | None]] = {
    "slice-of-batch": (lambda x, v: torch.ops.aten.slice_scatter.default(x, v[:2], 0, 0, 2),
                       "writes into a slice of the batch dim"),
    "whole-batch-to-maxsize": (
        lambda x, v: torch.ops.aten.slice_scatter.default(x, x * 2, 0, 0, 2 ** 62), None),
    "slice-of-features": (
        lambda x, v: torch.ops.aten.slice_scatter.default(x, x[:, 1:3] * 2, 1, 1, 3), None),
    "row-of-batch": (lambda x, v: torch.ops.aten.select_scatter.default(x, v[0], 0, 0),
                     "writes into row 0 of the batch dim"),
    "column": (lambda x, v: torch.ops.aten.select_scatter.default(x, x[:, 0] * 2, 1, 0), None),
    "diagonal-with-batch": (
        lambda x, v: torch.ops.aten.diagonal_scatter.default(
            x[:, :3, None].expand(-1, 3, 3), v[:3, :3], 0, 0, 1),
        "writes the diagonal of a pair of dims that includes the batch dim"),
    "copy-free-into-batch": (lambda x, v: torch.ops.aten.copy.default(x, v[0]), None),
}


@pytest.mark.parametrize("name", _ATEN_WRITES)
def test_write_rule_on_aten_graph(name: str) -> None:
    """x (B, HID) is batched, v (4, HID) batch-free; None: accepted as per-sample dim 0."""
    fn, reason = _ATEN_WRITES[name]
    gm = torch.fx.symbolic_trace(fn)
    inputs = (torch.randn(GBS, HID, dtype=torch.float64), torch.randn(4, HID,
                                                                      dtype=torch.float64))
    propagate_shapes(gm, inputs, (0, None), GBS)
    x, v = [n for n in gm.graph.nodes if n.op == "placeholder"]
    result = analyse_batch(gm, {x.target: Batched(0), v.target: Free()}, GBS)
    if reason is None:
        assert result.rejected is None, str(result.rejected)
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        assert out.meta[FACT] == Batched(0)
    else:
        assert result.rejected is not None and reason in str(result.rejected), result.rejected


def test_cumulative_batch_norm_is_refused_for_its_own_reason():
    """``BatchNorm(momentum=None)`` reads ``1 / num_batches_tracked`` as a Python number: the
    refusal says so and how to fix it, not that a shape depends on values."""
    model = Entry(_r_batchnorm_train, {"bn": lambda: nn.BatchNorm1d(HID, momentum=None)}).build()
    with pytest.raises(MixingError, match="momentum=None keeps a cumulative average") as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(),
                              **plan_free(MBS))
    assert "give it a momentum" in str(info.value)


class _GradientPenalty(nn.Module):
    """WGAN-GP's penalty: ``torch.autograd.grad(..., create_graph=True)`` inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(FEAT, HID), nn.Tanh(), nn.Linear(HID, 1))

    def forward(self, x, mask, y, tok, img):
        x = x.detach().requires_grad_(True)
        out = self.critic(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)  # offending
        return out.mean() + 10 * ((g.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


def test_a_gradient_penalty_in_forward_is_refused_at_its_line():
    """The step runs each microbatch's backward itself and cannot keep a differentiation
    nested in forward: refused at capture, naming the line, with the model unchanged."""
    torch.manual_seed(0)
    model = _GradientPenalty().double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mbcompile.CaptureError, match="differentiates inside forward") as info:
        mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=batch(), **plan_free(MBS))
    assert "# offending" in str(info.value)
    assert all(torch.equal(p, q) and p.grad is None for p, q in zip(model.parameters(), before))
