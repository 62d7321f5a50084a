"""A two-phase step on gloo ranks: only the frontier is gathered, C runs on every rank, its
own gradients count once, and the result is the single-process full batch's (float64)."""

from __future__ import annotations

import pytest
import torch
import two_phase_workers as workers
from test_distributed import TIMEOUT_S, _run

from mbcompile.check import relative_error


def _launch(fn, nproc: int, *args, timeout_s: float) -> None:
    """``mbdist.launch(fn, nproc, *args, timeout_s=timeout_s)`` with the ranks forked from
    the tests' forkserver (tests/test_distributed.py ``_run``): collectives time out after
    ``timeout_s``, the whole run after twice that."""
    _run(fn, nproc, *args, collective_timeout_s=timeout_s,
         timeout_s=max(TIMEOUT_S, 2 * timeout_s))


@pytest.mark.parametrize("name,world,gbs,mbs", [
    ("clip", 2, 7, 2),      # 4 + 3 samples: uneven shares, a short last microbatch
    ("clip", 3, 7, 1),      # 3 + 2 + 2 samples, microbatches of one
    ("centered", 2, 7, 3),  # per-sample rows and a partial sum in the frontier
    ("centered", 3, 8, 2),
])
def test_ranks_equal_the_full_batch(tmp_path, name, world, gbs, mbs):
    _launch(workers.step, world, str(tmp_path), name, gbs, mbs, timeout_s=60.0)
    model, batch = workers.make(name, gbs)
    loss = model(*batch)
    loss.backward()
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert "two-phase" in got["reason"]
        assert relative_error(got["loss"], loss) <= 1e-10
        # over all gradients at once: centering makes a bias's gradient zero up to rounding
        names = [n for n, _ in model.named_parameters()]
        mine = torch.cat([got["grads"][n].flatten() for n in names])
        eager = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert relative_error(mine, eager) <= 1e-10, rank
        assert relative_error(got["grads"]["f.weight" if name == "centered" else "scale"],
                              dict(model.named_parameters())["f.weight" if name == "centered"
                                                             else "scale"].grad) <= 1e-10


@pytest.mark.parametrize("name,phase", [("clip", 1), ("centered", 2), ("clip", 3), ("clip", 0)])
def test_a_failing_rank_stops_every_rank(tmp_path, name, phase):
    """Rank 1 fails in one phase (0: a call under no_grad); a rank that failed before the
    frontier's gather still joins it (with zeros), so nobody hangs, and the step's one
    status read stops all."""
    _launch(workers.failing_step, 2, str(tmp_path), name, 7, phase, timeout_s=60.0)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["error"], rank
        assert got["kept"], rank
    assert "injected failure" in torch.load(tmp_path / "rank1.pt")["error"]


def test_one_status_read_per_step(tmp_path):
    """The step's status read, and, since the embeddings' width may differ between ranks
    (``dynamic="auto"``: any rank's call may make it symbolic), one read of the frontier's
    shapes, exchanged before its gather (``frontier_gather.py``)."""
    _launch(workers.counted_step, 2, str(tmp_path), "clip", 7, 2, timeout_s=60.0)
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt")["reads"] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("world,gbs,mbs", [(2, 7, 2), (3, 8, 1)])
def test_every_family_on_ranks(tmp_path, world, gbs, mbs):
    """Every family of tests/coupled_models.py (CLIP, SigLIP, SimCLR, batch-hard triplet,
    centring, RMSE, RMSE + CE, BatchNorm, loss + logits): loss, gradients and buffers on
    each rank equal the single-process full batch's."""
    from coupled_models import COUPLED

    _launch(workers.families_step, world, str(tmp_path), gbs, mbs, timeout_s=120.0)
    got = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for family, make in COUPLED.items():
        model, batch = make(gbs)
        out = model(*batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        eager = torch.cat([p.grad.flatten() for p in model.parameters()])
        for rank in range(world):
            mine = got[rank][family]
            assert mine["two_phase"], family
            assert relative_error(mine["loss"], loss) <= 1e-10, (family, rank)
            grads = torch.cat([mine["grads"][n].flatten() for n, _ in model.named_parameters()])
            assert relative_error(grads, eager) <= 1e-10, (family, rank)
            for n, b in model.named_buffers():
                assert relative_error(mine["buffers"][n], b) <= 1e-10, (family, rank, n)
            # the per-sample outputs are this rank's rows, as a split step returns them
            start, stop = mine["rows"]
            for i, o in enumerate(out[1:] if isinstance(out, tuple) else ()):
                assert relative_error(mine["outputs"][i], o.detach()[start:stop]) <= 1e-10, (
                    family, rank, i)


@pytest.mark.slow
@pytest.mark.zoo  # two-phase steps on ranks in CI: test_every_family_on_ranks
def test_mixtral_with_its_router_aux_loss_on_ranks(tmp_path):
    """The global-batch load-balancing loss: each rank's loss and gradients equal the
    single-process full batch's, in float32 (grouped_mm has no float64) to its rounding."""
    pytest.importorskip("transformers")
    import zoo

    _launch(workers.mixtral_step, 2, str(tmp_path), 7, 2, timeout_s=240.0)
    model = zoo.hf("MixtralForCausalLM", "MixtralConfig", dtype=torch.float32,
                   **{**zoo.MOE, "output_router_logits": True, "router_aux_loss_coef": 1.0})()
    want = model(**zoo.tokens(7), use_cache=False)
    want.loss.backward()
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    eager = torch.cat([dict(model.named_parameters())[n].grad.flatten() for n in names])
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["two_phase"]
        assert relative_error(got["loss"], want.loss) <= 1e-5
        mine = torch.cat([got["grads"][n].flatten() for n in names])
        assert relative_error(mine, eager) <= 1e-5, rank
