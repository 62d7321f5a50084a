"""Sparse gradients (``nn.Embedding(sparse=True)``) on real ranks, and in one process.

A sparse ``.grad`` cannot go into a dense all-reduce bucket: the ranks' step crashed in
its first backward in ``_flatten_dense_tensors``. Like DistributedDataParallel,
mbcompile now reduces such gradients on their own (``distributed.all_reduce_sparse``),
and FSDP2, which has no sparse gradients, is refused at compile naming the fix.
"""

from __future__ import annotations

import copy

import pytest
import sparse_workers as w
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.check import relative_error
from mbcompile.execution.sparse_grads import has_sparse_gradients, sparse_gradient_params

TOL = 1e-12


def _eager(kind: str) -> dict:
    model = w.model_of(kind)
    return w.record(model, model, [w.batch_of(s) for s in range(w.STEPS)])


def _same(got: dict, want: dict) -> None:
    for step in range(w.STEPS):
        assert relative_error(got["loss"][step], want["loss"][step]) <= TOL, step
        assert got["layouts"][step] == want["layouts"][step], step  # None-ness, sparse-ness
        for name, g in want["grads"][step].items():
            if g is None:
                assert got["grads"][step][name] is None, (step, name)
            else:
                assert relative_error(got["grads"][step][name], g) <= TOL, (step, name)
    for name, p in want["params"].items():
        assert relative_error(got["params"][name], p) <= TOL, name


@pytest.mark.slow
@pytest.mark.parametrize("kind,capture,overlap,fsdp", [
    ("module", "fx", True, False),        # the overlapped all-reduce, sparse left out of it
    ("module", "export", True, False),
    ("functional", "export", True, False),  # aten.embedding(..., sparse=True) of a parameter
    ("functional", "fx", False, False),   # the all-reduce in backward (OVERLAP = False)
    ("tied", "fx", True, False),          # marked sparse, arrives dense: reduced alone
    ("coupled", "fx", True, False),       # a two-phase step's all-reduce
    ("module", "fx", True, True),         # FSDP2 with the embedding in ignored_params
])
def test_sparse_gradients_on_ranks_equal_eager(tmp_path, kind, capture, overlap, fsdp):
    from test_distributed import _run

    _run(w.sparse_steps, 2, str(tmp_path), kind, capture, overlap, fsdp)
    want = _eager(kind)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["two_phase"] == (kind == "coupled")
        _same(got, want)


@pytest.mark.slow
def test_sparse_embedding_sharded_by_fsdp2_is_refused(tmp_path):
    from test_distributed import _run

    _run(w.sharded_sparse_refused, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["outcome"].startswith("InputError: Embedding 'e' has sparse=True"), got
        assert "fully_shard(model, ignored_params={model.e.weight})" in got["outcome"]
        assert "sparse=False" in got["outcome"]
        assert got["same"] and all(g is None for g in got["grads"])


@pytest.mark.parametrize("kind", ["module", "functional", "tied"])
def test_sparse_gradients_in_one_process_float32(kind):
    """The step's gradient is scaled after the backwards; a float32 factor went through
    GradScaler's unscale kernel, which has no sparse kernel: the step crashed in backward."""
    model = w.model_of(kind).float()
    eager = copy.deepcopy(model)
    cm = mbcompile.compile(model, w.GBS, 2, w.MBS, example_inputs=w.batch_of(0),
                           cost_model=False)
    got = w.record(model, cm, [w.batch_of(s) for s in range(w.STEPS)])
    want = w.record(eager, eager, [w.batch_of(s) for s in range(w.STEPS)])
    for step in range(w.STEPS):
        assert got["layouts"][step] == want["layouts"][step]
        assert relative_error(got["loss"][step], want["loss"][step]) <= 1e-6
        for name, g in want["grads"][step].items():
            assert g is None or relative_error(got["grads"][step][name], g) <= 1e-5, name
    for name, p in want["params"].items():
        assert relative_error(got["params"][name], p) <= 1e-5, name


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 3, sparse=True)
        self.dense = nn.Embedding(10, 3)
        self.w = nn.Parameter(torch.randn(10, 3))
        self.u = nn.Parameter(torch.randn(10, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.bag(ids) + self.dense(ids).sum(1) + F.embedding(ids, self.w, sparse=True)
                .sum(1) + F.embedding(ids, self.u).sum(1)).sum()


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_which_parameters_may_get_a_sparse_gradient(capture):
    """Those of sparse embedding modules and of functional ``sparse=True`` lookups (fx's
    keyword, export's positional argument); not a dense embedding's or lookup's."""
    ids = torch.randint(0, 10, (4, 2))
    body = torch.fx.symbolic_trace(_Bag()) if capture == "fx" else \
        torch.export.export(_Bag(), (ids,)).module()
    names = {id(p): n for n, p in body.named_parameters()}
    assert sorted(names[id(p)] for p in sparse_gradient_params(body)) == ["bag.weight", "w"]
    assert has_sparse_gradients(body)
    assert not has_sparse_gradients(nn.Linear(2, 2))
