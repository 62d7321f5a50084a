"""A two-phase step on gloo ranks: only the frontier is gathered, C runs on every rank, its
own gradients count once, and the result is the single-process full batch's (float64)."""

from __future__ import annotations

import pytest
import torch
import two_phase_workers as workers
from test_distributed import Jobs, run_jobs

from mbcompile.check import relative_error
from mbcompile.execution import distributed as mbdist

# Starting ranks and their first step is most of a test's time, so the tests share a spawn
# per world size: the 2-rank workers run one after another on one spawn of two ranks
# (module fixture two_ranks), the 3-rank ones on one of three (three_ranks); each group of
# tests is one xdist work unit, so that its spawn happens once. Mixtral spawns its own.
TWO_RANKS = pytest.mark.xdist_group("test_two_phase_distributed.two_ranks")
THREE_RANKS = pytest.mark.xdist_group("test_two_phase_distributed.three_ranks")
STEPS = [  # name, world, gbs, mbs
    ("clip", 2, 7, 2),      # 4 + 3 samples: uneven shares, a short last microbatch
    ("clip", 3, 7, 1),      # 3 + 2 + 2 samples, microbatches of one
    ("centered", 2, 7, 3),  # per-sample rows and a partial sum in the frontier
    ("centered", 3, 8, 2),
]
FAILURES = [("clip", 1), ("centered", 2), ("clip", 3), ("clip", 0)]
FAMILIES = [(2, 7, 2), (3, 8, 1)]  # world, gbs, mbs
COLLECTIVE_TIMEOUT_S = 120.0  # each job's collectives (mbdist.launch's timeout_s)


def _jobs(world: int) -> dict:
    jobs = {f"step-{name}-{w}-{gbs}-{mbs}": (workers.step, (name, gbs, mbs))
            for name, w, gbs, mbs in STEPS if w == world}
    if world == 2:
        jobs.update({f"failing-{name}-{phase}": (workers.failing_step, (name, 7, phase))
                     for name, phase in FAILURES})
        jobs["counted"] = (workers.counted_step, ("clip", 7, 2))
    jobs.update({f"families-{w}-{gbs}-{mbs}": (workers.families_step, (gbs, mbs))
                 for w, gbs, mbs in FAMILIES if w == world})
    return jobs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Jobs:
    return run_jobs(2, tmp_path_factory.mktemp("two_phase_two_ranks"), _jobs(2),
                    collective_timeout_s=COLLECTIVE_TIMEOUT_S)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> Jobs:
    return run_jobs(3, tmp_path_factory.mktemp("two_phase_three_ranks"), _jobs(3),
                    collective_timeout_s=COLLECTIVE_TIMEOUT_S)


def _ranks(request, world: int) -> Jobs:
    return request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[world])


def _grouped(cases: list[tuple], world_at: int) -> list:
    return [pytest.param(*case, marks=TWO_RANKS if case[world_at] == 2 else THREE_RANKS)
            for case in cases]


@pytest.mark.parametrize("name,world,gbs,mbs", _grouped(STEPS, 1))
def test_ranks_equal_the_full_batch(request, name, world, gbs, mbs):
    out = _ranks(request, world).dir(f"step-{name}-{world}-{gbs}-{mbs}")
    model, batch = workers.make(name, gbs)
    loss = model(*batch)
    loss.backward()
    for rank in range(world):
        got = torch.load(out / f"rank{rank}.pt")
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


@TWO_RANKS
@pytest.mark.parametrize("name,phase", FAILURES)
def test_a_failing_rank_stops_every_rank(two_ranks, name, phase):
    """Rank 1 fails in one phase (0: a call under no_grad); a rank that failed before the
    frontier's gather still joins it (with zeros), so nobody hangs, and the step's one
    status read stops all."""
    out = two_ranks.dir(f"failing-{name}-{phase}")
    for rank in range(2):
        got = torch.load(out / f"rank{rank}.pt")
        assert got["error"], rank
        assert got["kept"], rank
    assert "injected failure" in torch.load(out / "rank1.pt")["error"]


@TWO_RANKS
def test_one_status_read_per_step(two_ranks):
    out = two_ranks.dir("counted")
    for rank in range(2):
        assert torch.load(out / f"rank{rank}.pt")["reads"] == [1, 1]


@pytest.mark.parametrize("world,gbs,mbs", _grouped(FAMILIES, 0))
def test_every_family_on_ranks(request, world, gbs, mbs):
    """Every family of tests/coupled_models.py (CLIP, SigLIP, SimCLR, batch-hard triplet,
    centring, RMSE, RMSE + CE, BatchNorm, loss + logits): loss, gradients and buffers on
    each rank equal the single-process full batch's."""
    from coupled_models import COUPLED

    out = _ranks(request, world).dir(f"families-{world}-{gbs}-{mbs}")
    got = [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
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


@pytest.mark.slow
def test_mixtral_with_its_router_aux_loss_on_ranks(tmp_path):
    """The global-batch load-balancing loss: each rank's loss and gradients equal the
    single-process full batch's, in float32 (grouped_mm has no float64) to its rounding."""
    pytest.importorskip("transformers")
    import zoo

    mbdist.launch(workers.mixtral_step, 2, str(tmp_path), 7, 2, timeout_s=240.0)
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
