# ruff: noqa: E501  (the expected messages are held line for line)
"""Errors that teach: every kind of rejection, held to its full text.

Each model below is rejected for one reason (with ``coupling="reject"``: the
default runs a model whose ops mix samples as a two-phase step). The test
compares the whole message with the expected text, after replacing this file's
path and line numbers with ``<file>:<line>`` (so moving code around does not break it, but
changing what a message says does). A message names the op, the node, the
user's source line, the path of nodes from the batched input (found with
networkx), why the op mixes samples, and what to do.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile import MixingError, UnsupportedOpError
from mbcompile.passes.rules import BATCH_RULES

GBS, FEAT = 6, 4


class Net(nn.Module):
    """``body(self, x, y)`` after a Linear; ``layer`` is whatever the kind needs."""

    def __init__(self, body, layer: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.lin = nn.Linear(FEAT, FEAT)
        self.layer = layer if layer is not None else nn.Identity()

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return self.body(self, self.lin(x), y)


def batchnorm_training(s, h, y):
    return s.layer(h).pow(2).mean()


def no_rule_function(s, h, y):
    return torch.fft.fft(h).abs().mean()


def no_rule_module(s, h, y):  # a torch.nn layer whose rule the test removes
    return s.layer(h).pow(2).mean()


def softmax_over_batch(s, h, y):
    return torch.softmax(h, dim=0).pow(2).mean()


def max_over_batch(s, h, y):
    return h.max(0).values.sum()


def minus_batch_mean(s, h, y):
    return (h - h.mean(0)).pow(2).mean()


def sqrt_of_loss(s, h, y):
    return F.cross_entropy(h, y).sqrt()


def gram_matrix(s, h, y):
    return (h @ h.T).mean()


def contract_batch(s, h, y):
    return (h.T @ h).mean()


def baked_batch_size(s, h, y):
    return h.view(6, -1).pow(2).mean()


def bool_mask_index(s, h, y):
    return h[h > 0].sum()


def first_sample(s, h, y):
    return (h - h[0]).pow(2).mean()


def shuffled(s, h, y):
    return h[torch.randperm(h.size(0))].pow(2).mean()


def batch_size_value(s, h, y):
    return (h * h.size(0)).pow(2).mean()


def positions_value(s, h, y):
    return (h + torch.arange(h.size(0))[:, None]).pow(2).mean()


def wrong_layer_batch_dim(s, h, y):
    return s.layer(h.unsqueeze(1))[0].pow(2).mean()


def loss_batch_not_first(s, h, y):
    return F.cross_entropy(h.T.unsqueeze(0), y[None, :])


def interleaved_output(s, h, y):
    out = h.repeat(2, 1)
    return out.pow(2).mean(), out


def product_of_reductions(s, h, y):
    return F.cross_entropy(h, y) * h.pow(2).mean()


def in_place_unused(s, h, y):  # a write into a tensor nothing reads after it
    g = h * 2
    g.masked_fill_(g > 1, 1.0)
    return h.pow(2).mean()


# name -> (body, layer factory, error class, expected message)
KINDS = {
    "batchnorm-training": (batchnorm_training, lambda: nn.BatchNorm1d(FEAT), MixingError, """\
torch.nn.BatchNorm1d (module 'layer') at node 'layer' cannot be microbatched
  at <file>:<line>: return s.layer(h).pow(2).mean()
  path from the batched input: x -> lin -> layer
  why: BatchNorm in training mode normalises each channel with the mean and variance of the whole batch, so every sample's output depends on every other sample
  fix:
    - replace it with GroupNorm or LayerNorm (per-sample statistics)
    - put it in eval mode (model.eval(), or the BatchNorm module's .eval()) to use its running statistics
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "no-rule-function": (no_rule_function, None, UnsupportedOpError, """\
torch.fft.fft at node 'fft_fft' cannot be microbatched
  at <file>:<line>: return torch.fft.fft(h).abs().mean()
  path from the batched input: x -> lin -> fft_fft
  why: mbcompile has no batch rule for this op, and it does not guess whether an op keeps samples independent
  fix:
    - if it treats samples independently, register a rule: mbcompile.register_batch_rule(torch.fft.fft, 'per_sample')
    - or move the call into an nn.Module of yours and trust it: mbcompile.trust_module(YourModule)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "no-rule-module": (no_rule_module, lambda: nn.Hardshrink(), UnsupportedOpError, """\
torch.nn.Hardshrink (module 'layer') at node 'layer' cannot be microbatched
  at <file>:<line>: return s.layer(h).pow(2).mean()
  path from the batched input: x -> lin -> layer
  why: mbcompile has no batch rule for this op, and it does not guess whether an op keeps samples independent
  fix:
    - if it treats samples independently, register a rule: mbcompile.register_batch_rule(torch.nn.Hardshrink, 'per_sample')
    - or trust the layer as per-sample: mbcompile.trust_module(torch.nn.Hardshrink)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "softmax-over-batch": (softmax_over_batch, None, MixingError, """\
torch.softmax at node 'softmax' cannot be microbatched
  at <file>:<line>: return torch.softmax(h, dim=0).pow(2).mean()
  path from the batched input: x -> lin -> softmax
  why: it normalises along dim 0, which is the batch dim
  fix:
    - normalise along a non-batch dim
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "max-over-batch": (max_over_batch, None, MixingError, """\
Tensor.max at node 'max_1' cannot be microbatched
  at <file>:<line>: return h.max(0).values.sum()
  path from the batched input: x -> lin -> max_1
  why: it takes the max over the batch dim, which couples samples non-linearly (the result of a microbatch is not a part of the batch's)
  fix:
    - take the max over the non-batch dims only
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "minus-batch-mean": (minus_batch_mean, None, MixingError, """\
operator.sub at node 'sub' cannot be microbatched
  at <file>:<line>: return (h - h.mean(0)).pow(2).mean()
  path from the batched input: x -> lin -> sub
  why: it combines per-sample values with a statistic of the whole batch (such as x - x.mean(0)): each microbatch would see only its own statistic
  fix:
    - use per-sample normalisation (LayerNorm, GroupNorm) or statistics over the non-batch dims
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "sqrt-of-loss": (sqrt_of_loss, None, MixingError, """\
Tensor.sqrt at node 'sqrt' cannot be microbatched
  at <file>:<line>: return F.cross_entropy(h, y).sqrt()
  path from the batched input: y -> cross_entropy -> sqrt
  why: it applies a non-linear function to a reduction over the batch (such as loss.sqrt() or acc ** 2); mbcompile combines reductions across microbatches linearly and only divides sums by counts
  fix:
    - apply the non-linear function per sample before reducing, or return the reduction and transform it outside the model
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "gram-matrix": (gram_matrix, None, MixingError, """\
operator.matmul at node 'matmul' cannot be microbatched
  at <file>:<line>: return (h @ h.T).mean()
  path from the batched input: x -> lin -> matmul
  why: its output has 2 dims that grow with the batch (shape (6, 6) at batch 6), so it pairs every sample with every other sample
  fix:
    - compute the interaction within each sample (in-batch negatives, x @ x.T and similar need the whole batch)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "contract-batch": (contract_batch, None, MixingError, """\
operator.matmul at node 'matmul' cannot be microbatched
  at <file>:<line>: return (h.T @ h).mean()
  path from the batched input: x -> lin -> matmul
  why: it contracts along dim 1, which is the batch dim
  fix:
    - put the batch dim before the contracted (last) dim of the left side
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "baked-batch-size": (baked_batch_size, None, MixingError, """\
Tensor.view at node 'view' cannot be microbatched
  at <file>:<line>: return h.view(6, -1).pow(2).mean()
  path from the batched input: x -> lin -> view
  why: it runs at batch 6 but fails at batch 7 (RuntimeError: shape '[6, -1]' is invalid for input of size 28): a batch size is baked in as a constant (such as x.view(32, -1)), so it cannot run on a microbatch of any other size
  fix:
    - derive the batch size from the input: x.view(x.size(0), -1), x.flatten(1) or -1 instead of a constant
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "bool-mask-index": (bool_mask_index, None, MixingError, """\
operator.getitem at node 'getitem' cannot be microbatched
  at <file>:<line>: return h[h > 0].sum()
  path from the batched input: x -> lin -> getitem
  why: its output shape (or a Python value it produces) depends on the values in the tensors, not only on their shapes (nonzero, boolean-mask indexing, .item(), .tolist()), so mbcompile cannot prove the batch splits cleanly (DynamicOutputShapeException: aten.nonzero.default)
  fix:
    - keep shapes independent of tensor values: use torch.where(mask, x, 0) or a multiplication by the mask instead of x[mask]
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "first-sample": (first_sample, None, MixingError, """\
operator.getitem at node 'getitem' cannot be microbatched
  at <file>:<line>: return (h - h[0]).pow(2).mean()
  path from the batched input: x -> lin -> getitem
  why: its output no longer has a batch dim: it selects, drops or combines samples (indexing, slicing or reducing the batch dim)
  fix:
    - keep the batch dim whole: index, slice and reduce only the other dims
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "shuffled": (shuffled, None, MixingError, """\
operator.getitem at node 'getitem' cannot be microbatched
  at <file>:<line>: return h[torch.randperm(h.size(0))].pow(2).mean()
  path from the batched input: x -> lin -> getitem
  why: it selects rows of the batch dim with an index tensor (x[idx] along the batch): sample i of the output can come from any sample
  fix:
    - index only the non-batch dims; to pick one row per sample use x[torch.arange(x.size(0)), idx] or torch.gather along a feature dim
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "batch-size-value": (batch_size_value, None, MixingError, """\
operator.mul at node 'mul' cannot be microbatched
  at <file>:<line>: return (h * h.size(0)).pow(2).mean()
  path from the batched input: x -> lin -> mul
  why: it uses the batch size (x.size(0), len(x)) as a value in per-sample work: inside the microbatch loop it is the microbatch's size, not the batch's
  fix:
    - use the batch size only for shapes (view, expand, zeros), or divide a reduction by it (loss.sum() / x.size(0)), which mbcompile keeps global
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "positions-value": (positions_value, None, MixingError, """\
operator.add at node 'add' cannot be microbatched
  at <file>:<line>: return (h + torch.arange(h.size(0))[:, None]).pow(2).mean()
  path from the batched input: x -> lin -> add
  why: it uses each sample's position in the batch (torch.arange(B)) as a value; positions restart at 0 in every microbatch, so sample i would see a different number
  fix:
    - use arange(B) only to index the batch dim (x[torch.arange(B), idx]); for positions along the sequence use torch.arange(T)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "wrong-layer-batch-dim": (wrong_layer_batch_dim, lambda: nn.LSTM(FEAT, FEAT), MixingError, """\
torch.nn.LSTM (module 'layer') at node 'layer' cannot be microbatched
  at <file>:<line>: return s.layer(h.unsqueeze(1))[0].pow(2).mean()
  path from the batched input: x -> lin -> unsqueeze -> layer
  why: its batch dim is 1 (batch_first=False) but the input's batch dim is 0, so it would run over samples as if they were time steps
  fix:
    - pass inputs with the batch dim where the layer expects it (or set batch_first to match)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "loss-batch-not-first": (loss_batch_not_first, None, MixingError, """\
torch.nn.functional.cross_entropy at node 'cross_entropy' cannot be microbatched
  at <file>:<line>: return F.cross_entropy(h.T.unsqueeze(0), y[None, :])
  path from the batched input: y -> getitem -> cross_entropy
  why: its batch dim is not dim 0 (the N of (N, C, ...)), so the loss would treat samples as classes
  fix:
    - move the batch dim to dim 0 (x.movedim(d, 0)) before the loss
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "interleaved-output": (interleaved_output, None, MixingError, """\
Tensor.repeat at node 'repeat' cannot be microbatched
  at <file>:<line>: out = h.repeat(2, 1)
  path from the batched input: x -> lin -> repeat
  why: it is returned with samples interleaved with another dim, so microbatch outputs cannot be concatenated in order
  fix:
    - reshape so the batch dim leads before returning it
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "product-of-reductions": (product_of_reductions, None, MixingError, """\
operator.mul at node 'mul' cannot be microbatched
  at <file>:<line>: return F.cross_entropy(h, y) * h.pow(2).mean()
  path from the batched input: y -> cross_entropy -> mul
  why: it multiplies or divides two reductions over the batch, which is not linear in the samples
  fix:
    - divide only by counts computed from the inputs (mask.sum(), (labels != -100).sum()), which mbcompile adds up before dividing
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
    "in-place-unused": (in_place_unused, None, MixingError, """\
Tensor.masked_fill_ at node 'masked_fill_' cannot be microbatched
  at <file>:<line>: g.masked_fill_(g > 1, 1.0)
  path from the batched input: x -> lin -> mul -> masked_fill_
  why: it changes a batched tensor in place and nothing reads its result; mbcompile's rewrite follows values, not mutations
  fix:
    - use the out-of-place form and its result: x = x.masked_fill(m, v), x = torch.where(mask, v, x)
    - run the batch unsplit: mbcompile.compile(model, gbs, num_csx=1, mbs='none') (one system, one microbatch)"""),
}


def normalise(message: str) -> str:
    """This file's path and line numbers as ``<file>:<line>``."""
    return re.sub(r"\S*test_error_messages\.py:\d+", "<file>:<line>", message)


def compile_kind(name: str) -> MixingError:
    body, layer, cls, _ = KINDS[name]
    torch.manual_seed(0)
    model = Net(body, layer() if layer else None).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GBS, FEAT, generator=g, dtype=torch.float64)
    y = torch.randint(0, FEAT, (GBS,), generator=g)
    with pytest.raises(cls) as info:  # fx: the messages name the user's own lines and ops
        mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, y), capture="fx",
                          coupling="reject")  # the default runs what mixes as two-phase
    return info.value


@pytest.fixture
def hardshrink_without_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.nn layer mbcompile has no rule for (the test table lacks one)."""
    monkeypatch.delitem(BATCH_RULES, nn.Hardshrink)


@pytest.mark.parametrize("name", KINDS)
def test_message_text(name: str, hardshrink_without_rule: None) -> None:
    err = compile_kind(name)
    assert normalise(str(err)) == KINDS[name][3]


@pytest.mark.parametrize("name", KINDS)
def test_message_parts_are_attributes(name: str, hardshrink_without_rule: None) -> None:
    """Tools (the CLI, reports) read the parts without parsing the text."""
    err = compile_kind(name)
    message = str(err)
    assert message.startswith(f"{err.op} at node {err.node!r}")
    assert f"path from the batched input: {err.path}" in message
    assert f"why: {err.reason}" in message
    assert err.fixes[-1].startswith("run the batch unsplit") and all(
        f"    - {f}" in message for f in err.fixes)
    assert normalise(err.source_line).startswith("<file>:<line>: ")
    assert err.path.split(" -> ")[-1] == err.node


def test_long_paths_are_elided_in_the_middle() -> None:
    def deep(s, h, y):
        for _ in range(20):
            h = torch.tanh(h) + 1
        return (h - h.mean(0)).pow(2).mean()

    torch.manual_seed(0)
    model = Net(deep).double()
    x = torch.randn(GBS, FEAT, dtype=torch.float64)
    with pytest.raises(MixingError) as info:
        mbcompile.compile(model, GBS, 2, 2, example_inputs=(x, x[:, 0].long()),
                          coupling="reject")
    path = info.value.path.split(" -> ")
    assert path[:2] == ["x", "lin"] and path[-1] == "sub" and len(path) == 12
    assert re.fullmatch(r"\.\.\. \(\d+ more\)", path[4]), path


def test_export_graph_errors_name_aten_ops_and_the_layer_line() -> None:
    """Through torch.export the op is the ATen op and the line is the layer's own."""

    class Block(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return torch.softmax(h, dim=0)  # mixes

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.block = nn.Linear(FEAT, FEAT), Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.lin(x)).pow(2).mean()

    x = torch.randn(GBS, FEAT, dtype=torch.float64)
    with pytest.raises(MixingError) as info:
        mbcompile.compile(Model().double(), GBS, 2, 2, example_inputs=(x,), capture="export",
                          coupling="reject")
    err = info.value
    assert err.op == "torch.ops.aten.softmax"
    assert normalise(err.source_line) == "<file>:<line>: return torch.softmax(h, dim=0)  # mixes"
    assert err.path == "x -> linear -> softmax"


@pytest.mark.parametrize("name", KINDS)
def test_the_unsplit_remedy_every_message_offers_works(name: str,
                                                       hardshrink_without_rule: None) -> None:
    """compile(model, gbs, num_csx=1, mbs='none') runs the batch as it is, whatever mixes."""
    body, layer, _, _ = KINDS[name]
    torch.manual_seed(0)
    model = Net(body, layer() if layer else None).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(GBS, FEAT, generator=g, dtype=torch.float64)
    y = torch.randint(0, FEAT, (GBS,), generator=g)
    cm = mbcompile.compile(model, GBS, num_csx=1, mbs="none", example_inputs=(x, y))
    with torch.no_grad():
        got, want = cm(x, y), model(x, y)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(got, want))
