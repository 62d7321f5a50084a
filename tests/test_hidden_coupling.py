"""Ops whose output's shape hides that they read other samples run as eager's full batch.

Each of these was split before, silently (a hunt for coupled models, 2026-12-06): the
output's shape at two batch sizes looked per-sample, so the microbatches each computed
something else than the full batch does. Now each runs as a two-phase step (or, for
``cross`` without a dim, split with the dim the full batch uses), equal to eager on the
full batch in float64: the loss, every output and every gradient. The plan is uneven
(gbs 7 over 2 systems at mbs 2: microbatches 2, 2 | 2, 1), under both captures where
torch can capture the op. With ``coupling="reject"`` each coupled one is refused.

- a transformer layer on a 2-d (B, D) input: one sequence whose positions are samples;
- ``isin(a, b)`` and ``bucketize(a, b)`` with a batched ``b``: each element reads all of b;
- ``take_along_dim(x, idx)`` without a dim: it indexes the flattened batch;
- ``kron(a, x)`` with the batched operand second: the rows interleave the samples;
- ``as_strided`` of a batched tensor: its strides cross rows;
- a number computed from the batch size that agrees at gbs and gbs + 1
  (``x.size(0) > 4``, ``min(x.size(0), 4)``), which a microbatch would compute anew;
- ``EmbeddingBag`` with flat batch-free ids and per-sample offsets.

Also: a trained metric returned beside the loss (``return loss, h.std()``) is not taken
for the loss; a tensor constant in forward (``torch.tensor([...])``) leaves nothing on the
user's model and compiles once.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import TOL, assert_close_errors, step_errors

import mbcompile
from mbcompile import MixingError

D, CLASSES, VOCAB = 4, 3, 10
PLAN = (7, 2, 2)


class Net(nn.Module):
    """``fn(self, x, y)`` over a few layers; returns ``(loss, *outputs)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, CLASSES)
        self.layer = nn.TransformerEncoderLayer(D, 2, 8, dropout=0.0, batch_first=True)
        self.rnn = nn.GRU(D, D)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.fn(self, x, y)


def batch(n: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, D, generator=g, dtype=torch.float64),
            torch.randint(0, CLASSES, (n,), generator=g))


def transformer_2d(s, x, y):
    h = s.layer(torch.tanh(s.a(x)))  # (B, D): one sequence of B positions
    return F.cross_entropy(s.b(h), y), h


def gru_2d(s, x, y):
    h, _ = s.rnn(torch.tanh(s.a(x)))  # (B, D): B time steps of one sequence
    return F.cross_entropy(s.b(h), y), h


def isin_labels(s, x, y):
    logits = s.b(torch.tanh(s.a(x)))
    seen = torch.isin(logits.argmax(-1), y)  # is the prediction anyone's label?
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * (1 + seen)).mean(), seen


def bucketize_batch(s, x, y):
    h = torch.tanh(s.a(x))
    rank = torch.bucketize(h.detach(), x[:, 1].contiguous())  # among the batch's values
    return (h * rank).mean() + F.cross_entropy(s.b(h), y), rank


def take_without_dim(s, x, y):
    logp = F.log_softmax(s.b(torch.tanh(s.a(x))), -1)
    picked = torch.take_along_dim(logp, y[:, None])  # no dim: the flattened batch
    return -picked.mean(), picked


def kron_second(s, x, y):
    h = torch.tanh(s.a(x))
    k = torch.kron(torch.tensor([[1.0], [2.0]], dtype=h.dtype), h)  # rows j * B + i
    return F.cross_entropy(s.b(k.view(-1, 2, D)[:, 0]), y), k


def as_strided_rows(s, x, y):
    h = torch.tanh(s.a(x))
    t = h.as_strided((h.size(0), D), (1, h.size(0)))  # h.reshape(D, B).T
    return F.cross_entropy(s.b(t), y), t


def greater_than_size(s, x, y):
    h = torch.tanh(s.a(x)) * (x.size(0) > 4)  # True at 7 and 8; False for 2 rows
    return F.cross_entropy(s.b(h + x), y), h


def min_of_size(s, x, y):
    h = torch.tanh(s.a(x)) * min(x.size(0), 4)  # 4 at 7 and 8; 2 or 1 in a microbatch
    return F.cross_entropy(s.b(h), y), h


# (forward, captures torch can capture it with)
COUPLED = {
    "transformer_2d": (transformer_2d, ("fx", "export")),
    "gru_2d": (gru_2d, ("fx",)),
    "isin": (isin_labels, ("fx", "export")),
    "bucketize": (bucketize_batch, ("fx", "export")),
    "take_along_dim": (take_without_dim, ("fx", "export")),
    "kron": (kron_second, ("fx",)),
    "as_strided": (as_strided_rows, ("fx", "export")),
    "size_gt": (greater_than_size, ("fx", "export")),
    "size_min": (min_of_size, ("export",)),
}
CASES = [(name, capture) for name, (_, captures) in COUPLED.items() for capture in captures]


def compiled(model: nn.Module, inputs: tuple[Any, ...], capture: str, plan=PLAN,
             **options: Any) -> Any:
    gbs, num_csx, mbs = plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=inputs,
                                 capture=capture, **options)


@pytest.mark.parametrize("name,capture", CASES)
def test_runs_as_the_full_batch(name: str, capture: str) -> None:
    torch.manual_seed(0)
    model, inputs = Net(COUPLED[name][0]).double(), batch()
    cm = compiled(model, inputs, capture)
    assert cm.analysis.two_phase, f"{name} was split"
    assert_close_errors(step_errors(model, cm, inputs), TOL)
    # a second step, from the parameters the first one's gradients updated
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    assert_close_errors(step_errors(model, cm, batch(seed=2)), TOL)


@pytest.mark.parametrize("name,capture", CASES)
def test_refused_when_coupling_is_rejected(name: str, capture: str) -> None:
    torch.manual_seed(0)
    model, inputs = Net(COUPLED[name][0]).double(), batch()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MixingError):
        compiled(model, inputs, capture, coupling="reject")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def cross_no_dim(s, x, y):
    h = torch.tanh(s.a(x))[:, :3]
    c = torch.cross(h, x[:, 1:])  # the first dim of size 3: dim 1 at 7 rows, 0 at 3
    return F.cross_entropy(s.b(torch.cat([c, h[:, :1]], 1)), y), c


def test_cross_without_dim_takes_the_full_batch_dim() -> None:
    """Microbatches of 3 rows would cross along the batch dim; the node is specialised."""
    torch.manual_seed(0)
    model, inputs = Net(cross_no_dim).double(), batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own: cross without dim is deprecated
        cm = compiled(model, inputs, "fx", plan=(7, 1, 3))
        assert not cm.analysis.two_phase
        assert_close_errors(step_errors(model, cm, inputs), TOL)


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.EmbeddingBag(VOCAB, D, mode="mean")
        self.b = nn.Linear(D, CLASSES)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, y: torch.Tensor) -> Any:
        return F.cross_entropy(self.b(self.e(ids, offsets)), y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_embedding_bag_offsets_per_sample(capture: str) -> None:
    """Flat batch-free ids, per-sample offsets (DLRM's input): offsets index the whole list."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 4, (7,), generator=g)
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    inputs = (ids, offsets, torch.randint(0, CLASSES, (7,), generator=g))
    torch.manual_seed(0)
    model = Bag().double()
    cm = compiled(model, inputs, capture, in_dims=(None, 0, 0))
    assert cm.analysis.two_phase
    assert_close_errors(step_errors(model, cm, inputs), TOL)


def metric_beside_loss(s, x, y):
    h = torch.tanh(s.a(x))
    return F.cross_entropy(s.b(h), y), h.std()  # a collapse metric, logged, not detached


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_trained_metric_beside_the_loss_is_not_the_loss(capture: str) -> None:
    torch.manual_seed(0)
    model, inputs = Net(metric_beside_loss).double(), batch()
    cm = compiled(model, inputs, capture)
    assert cm.analysis.coupled_loss == 0
    assert_close_errors(step_errors(model, cm, inputs), TOL)


def with_constant(s, x, y):
    return F.cross_entropy(s.b(torch.tanh(s.a(x))) * torch.tensor([1.0, 2.0, 3.0]), y)


def test_a_tensor_constant_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, inputs = Net(with_constant).double(), batch()
    names = set(vars(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        cm = compiled(model, inputs, "fx")
        for seed in (1, 2, 3):
            assert_close_errors(step_errors(model, cm, batch(seed=seed)), TOL)
    assert set(vars(model)) == names
