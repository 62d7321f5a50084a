"""A global batch of another size than ``gbs`` on real ranks, through ``mbcompile.Trainer``
(which holds the global batch and shards it itself): the epoch's short last batch trains
and a smaller validation batch evaluates as one full-batch eager step on the same rows
(every rank runs its share of a plan for that size, 3 + 2 of 5, the counts global), on
replicated ranks and on FSDP2; a batch with fewer rows than ranks is refused on every
rank alike, changing nothing (``variants.for_global_batch``)."""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import pytest
import torch
from test_user_journeys import _batch

import mbcompile
from mbcompile.models import TinyGPT

GBS, MBS = 7, 2
# 7 rows (shares 4 + 3), then the epoch's short last batch: 5 rows (3 + 2; at mbs 2 rank 0
# runs 2 microbatches and rank 1 one), each at its own length
TRAIN = [_batch(9, GBS, seed=1), _batch(6, 5, seed=2)]
VALIDATE = [_batch(8, 4, seed=3), _batch(5, 3, seed=4)]  # 2 + 2 and 2 + 1 rows
ONE_ROW = [_batch(9, GBS, seed=1), _batch(6, 1, seed=2)]

RANKS = pytest.mark.xdist_group("user_journeys_4.ranks")  # one forkserver, one rank pair at a time


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter or gradient (an FSDP2 shard gathered)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainer_rank(rank: int, world: int, out_dir: str, train: list[Any], validate: list[Any],
                 fsdp: bool, mbs: Any = MBS) -> None:
    """``Trainer.fit`` on this rank (SGD with momentum, float64, validation at the end; at
    ``mbs="auto"`` the cost model chooses, the variants' from the first plan's figures);
    saves each row, what it raised, the full parameters and their ``.grad``."""
    from rich.console import Console

    torch.manual_seed(0)
    model = TinyGPT().double()
    trainer = mbcompile.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gbs=GBS,
        num_csx=world, console=Console(file=io.StringIO()), progress=False,
        compile_options={"cost_model": mbs == "auto"}, backend="torch.distributed",
        shard="fsdp" if fsdp else None, callbacks=[mbcompile.GlobalFlags(micro_batch_size=mbs)])
    outcome, rows = "ok", []
    try:
        rows = trainer.fit(train, validate or None, max_steps=len(train))
    except Exception as exc:  # what each rank saw is the result
        outcome = f"{type(exc).__name__}: {exc}"
    torch.save({"outcome": outcome, "rows": rows, "history": trainer.history,
                "params": {n: _full(p.detach()) for n, p in model.named_parameters()},
                "grads": {n: None if p.grad is None else _full(p.grad)
                          for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _eager(train: list[Any], validate: list[Any]) -> dict[str, Any]:
    """The same steps in one process, full batch, by hand."""
    torch.manual_seed(0)
    model = TinyGPT().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for batch in train:
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)[0]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        val = [float(model(*b)[0]) for b in validate]
    return {"losses": losses, "val": val, "model": model}


def _ranks(tmp_path: Any, train: list[Any], validate: list[Any], fsdp: bool, mbs: Any = MBS
           ) -> list[dict[str, Any]]:
    from test_distributed import _run

    _run(trainer_rank, 2, str(tmp_path), train, validate, fsdp, mbs, timeout_s=120,
         collective_timeout_s=30)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
@pytest.mark.parametrize("fsdp, mbs", [(False, MBS), (True, MBS), (False, "auto")],
                         ids=["replicated", "fsdp2", "replicated-auto"])
def test_a_short_last_batch_and_small_validation_batches_equal_eager_full_batch(
        tmp_path, fsdp, mbs):
    ref = _eager(TRAIN, VALIDATE)
    for rank, got in enumerate(_ranks(tmp_path, TRAIN, VALIDATE, fsdp, mbs)):
        assert got["outcome"] == "ok", (rank, got["outcome"])
        train = [r for r in got["rows"] if r["phase"] == "train"]
        val = [r for r in got["rows"] if r["phase"] == "validate"]
        assert [r["samples"] for r in train] == [GBS, 5], rank  # the short step's own plan
        assert [r["samples"] for r in val] == [4, 3], rank
        assert [r["loss"] for r in train] == pytest.approx(ref["losses"], rel=1e-12), rank
        assert [r["loss"] for r in val] == pytest.approx(ref["val"], rel=1e-12), rank
        for name, p in ref["model"].named_parameters():  # the short step's gradient, then SGD
            assert (got["grads"][name] - p.grad).abs().max() < 1e-12, (rank, name)
            assert (got["params"][name] - p.detach()).abs().max() < 1e-12, (rank, name)


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
def test_a_batch_of_fewer_rows_than_ranks_is_refused_on_every_rank(tmp_path, fsdp):
    ref = _eager(ONE_ROW[:1], [])
    for rank, got in enumerate(_ranks(tmp_path, ONE_ROW, [], fsdp)):
        assert got["outcome"].startswith("InputError: a global batch of 1 sample on 2 ranks"), (
            rank, got["outcome"])
        assert "rank 1 would have no sample" in got["outcome"], rank
        assert "drop_last=True" in got["outcome"], rank
        assert len(got["history"]) == 1, rank  # the first step trained, the second ran nothing
        for name, p in ref["model"].named_parameters():  # as after the first step alone
            assert (got["grads"][name] - p.grad).abs().max() < 1e-12, (rank, name)
            assert (got["params"][name] - p.detach()).abs().max() < 1e-12, (rank, name)


@pytest.mark.parametrize("rows, batch_sizes, shares, error", [
    (GBS, "any", (4, 3), None),                      # gbs: the module itself
    (5, "any", (3, 2), None),                        # the variant for 5 rows over 2 systems
    (1, "any", None, "rank 1 would have no sample"),  # fewer rows than systems
    (5, "fixed", None, "with batch_sizes='fixed'"),
])
def test_the_module_for_a_global_batch_and_its_shares(rows, batch_sizes, shares, error):
    """What every rank derives from the global batch (here on one process, the same
    arithmetic): the plan whose shares it cuts, or the same refusal, nothing compiled."""
    from mbcompile.variants import for_global_batch

    torch.manual_seed(0)
    cm = mbcompile.compile(TinyGPT().double(), GBS, 2, MBS, example_inputs=TRAIN[0],
                           cost_model=False, batch_sizes=batch_sizes)
    batch = _batch(6, rows, seed=2)
    if error is not None:
        with pytest.raises(mbcompile.InputError, match=f"global batch of .* on 2 ranks.*{error}"):
            for_global_batch(cm, batch, {})
        assert not cm._variants
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.BatchSizeWarning)
        runs = for_global_batch(cm, batch, {})
    assert (runs is cm) == (rows == GBS)
    assert tuple(runs.plan.per_system_batch_sizes) == shares
    assert cm.plan.gbs == rows  # the row the Trainer logs: the plan that ran
