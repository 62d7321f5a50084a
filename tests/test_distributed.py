"""Real ranks on torch.distributed (gloo, 127.0.0.1): exact, one reduction per step, no hangs."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import torch
import torch.multiprocessing as mp

from mbcompile.check import relative_error
from mbcompile.execution import distributed as mbdist
from mbcompile.models import make_tiny_gpt

TIMEOUT_S = 90

# 12-32 s per test on 2 cores (measured three times on a shared machine): every test
# that spawns ranks (each rank imports torch) is marked slow.


def _run(fn, world: int, *args, timeout_s: float = TIMEOUT_S,
         collective_timeout_s: float = 30.0) -> None:
    """Spawn ``world`` gloo ranks running ``fn`` and wait, bounded in time."""
    ctx = mp.start_processes(mbdist._worker, args=(world, mbdist.free_port(),
                                                   collective_timeout_s, fn, args),
                             nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"distributed test did not finish within {timeout_s} s")


class Jobs:
    """The outputs of several rank workers run on one spawn of the ranks
    (``dist_workers.run_jobs``): ``jobs.dir(name)`` is the folder the job ``name`` wrote,
    once every rank finished it."""

    def __init__(self, out: Path, world: int, names: list[str], error: str | None) -> None:
        self.out, self.world, self.names, self.error = out, world, names, error

    def dir(self, name: str) -> Path:
        folder = self.out / name
        done = [folder / f"done{r}" for r in range(self.world)]
        if all(p.exists() for p in done):
            return folder
        errors = "\n".join(p.read_text() for p in sorted(folder.glob("error*.txt")))
        pytest.fail(f"job {name!r} did not finish on every rank of the shared spawn "
                    f"(jobs, in order: {self.names}):\n{errors or self.error}", pytrace=False)

    def seconds(self, name: str) -> list[float]:
        """How long each rank took over the job (its start to its end, after start-up)."""
        return [float((self.dir(name) / f"done{r}").read_text()) for r in range(self.world)]


def run_jobs(world: int, out: Path,
             jobs: dict[str, tuple[Callable[..., None], tuple[Any, ...]]],
             timeout_s: float = TIMEOUT_S, collective_timeout_s: float = 30.0) -> Jobs:
    """Run the workers ``jobs`` (name: (fn, args)) one after another on one spawn of
    ``world`` ranks, bounded by ``timeout_s`` per job. A failure does not raise here: each
    test asks ``Jobs.dir`` for its own job, and fails with the rank's error if that job
    did not finish."""
    error = None
    try:
        _run(dist_workers.run_jobs, world, str(out),
             [(name, fn, args) for name, (fn, args) in jobs.items()],
             timeout_s=timeout_s * len(jobs), collective_timeout_s=collective_timeout_s)
    except (Exception, pytest.fail.Exception) as exc:  # each test reports its own job
        error = f"{type(exc).__name__}: {exc}"
    return Jobs(out, world, list(jobs), error)


# The 2-rank steps and failures run on one spawn of two ranks, shared by their tests
# (module fixture two_ranks, one xdist work unit); the 3-rank step spawns its own.
TWO_RANKS = pytest.mark.xdist_group("test_distributed.two_ranks")
SHARED_STEPS = [(2, 7, 2, 1 << 30), (2, 7, 2, 16 * 1024)]
FAILURES = ["forward", "last_backward", "nan"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Jobs:
    jobs = {f"step-{w}-{g}-{m}-{b}": (dist_workers.train_step, (g, m, b))
            for w, g, m, b in SHARED_STEPS}
    jobs.update({f"fail-{where}": (dist_workers.failing_step, (6, where)) for where in FAILURES})
    return run_jobs(2, tmp_path_factory.mktemp("two_ranks"), jobs)


@pytest.mark.slow
@pytest.mark.parametrize("world,gbs,mbs,bucket_bytes", [
    pytest.param(2, 7, 2, 1 << 30, marks=TWO_RANKS),     # 4 + 3 samples, one bucket
    pytest.param(2, 7, 2, 16 * 1024, marks=TWO_RANKS),   # several small buckets
    (3, 10, 2, 16 * 1024),   # 4 + 3 + 3 samples, several small buckets
])
def test_ranks_equal_full_batch_step(request, tmp_path, world, gbs, mbs, bucket_bytes):
    if (world, gbs, mbs, bucket_bytes) in SHARED_STEPS:
        out = request.getfixturevalue("two_ranks").dir(f"step-{world}-{gbs}-{mbs}-{bucket_bytes}")
    else:
        _run(dist_workers.train_step, world, str(tmp_path), gbs, mbs, bucket_bytes)
        out = tmp_path
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    loss, logits = model(*batch)
    loss.backward()
    start = 0
    for rank in range(world):
        got = torch.load(out / f"rank{rank}.pt")
        size = got["plan"]["per_system_batch_sizes"][rank]
        assert relative_error(got["loss"], loss) <= 1e-10
        assert relative_error(got["logits"], logits[start:start + size]) <= 1e-10
        for name, p in model.named_parameters():
            assert relative_error(got["grads"][name], p.grad) <= 1e-10, (rank, name)
            # The overlap changes when the sums start, not what they are: on two ranks
            # every element is a + b, bit for bit; beyond two, gloo's ring order depends
            # on the element's place in its bucket (the layout), so to rounding.
            same = got["grads"][name], got["reference"][name]
            assert torch.equal(*same) if world == 2 else relative_error(*same) <= 1e-14
        gradient = [e for e in got["events"] if e[0] == "reduce" and e[3]]
        assert len(gradient) == got["buckets"] >= 1  # gradients reduced once per step
        if bucket_bytes < 1 << 20:
            assert got["buckets"] > 1
            buckets_start_during_the_last_backward(got["events"])
        start += size


def buckets_start_during_the_last_backward(events: list[tuple]) -> None:
    """The step's bucket all-reduces are launched, asynchronously, while the last
    microbatch's backward still runs; the status and the partial sums follow, and
    ``loss.backward()`` only waits: it issues no collective."""
    last_forward = max(i for i, e in enumerate(events) if e == ("forward",))
    last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
    launches = [i for i, e in enumerate(events) if e[0] == "reduce" and e[3]]
    assert len(launches) > 1
    assert last_forward < launches[0] < last_grad  # during the last backward
    sync = [i for i, e in enumerate(events) if e[0] == "reduce" and not e[3]]
    assert launches[-1] < sync[0]  # every bucket before the status all-reduce
    in_backward = events[events.index(("backward",)):]
    assert [e for e in in_backward if e[0] == "reduce"] == []


@pytest.mark.slow
@TWO_RANKS
@pytest.mark.parametrize("where", FAILURES)
def test_failing_rank_stops_every_rank(two_ranks, where):
    """Wherever rank 1's step fails, both ranks raise, neither hangs, both issued the same
    collectives in the same order, and the user's gradients are untouched."""
    out = two_ranks.dir(f"fail-{where}")
    assert max(two_ranks.seconds(f"fail-{where}")) < TIMEOUT_S
    seen = {r: torch.load(out / f"rank{r}.pt") for r in range(2)}
    if where == "nan":
        assert "microbatch 2 is nan" in seen[1]["outcome"]
    else:
        assert "injected failure on rank 1" in seen[1]["outcome"]
    assert "MicrobatchError" in seen[0]["outcome"]
    assert "rank(s) [1] failed" in seen[0]["outcome"]
    for got in seen.values():
        assert got["untouched"]  # the gradients the user had, bit for bit
    reduces = [[e[1:] for e in got["events"] if e[0] == "reduce"] for got in seen.values()]
    assert reduces[0] == reduces[1]  # the same collectives in the same order: no hang
    events = seen[1]["events"]
    launched_before_failure = [e for e in events[:events.index(("fail",))]
                               if e[0] == "reduce"] if where != "nan" else []
    assert bool(launched_before_failure) == (where == "last_backward")


def test_bucket_layout_follows_the_backward_and_keeps_buckets_small():
    """Reverse parameter order (the embedding, final last, in the last bucket), a first
    bucket of at most 1 MiB, at least MIN_BUCKETS for a small model, DDP's 25 MiB cap for
    a large one, one dtype per bucket."""
    model, _ = make_tiny_gpt(1, vocab=1000, width=256, depth=4, heads=4, seq=128)
    params = list(model.parameters())
    buckets = mbdist.OverlappedReduce(params).buckets
    nbytes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in buckets]
    assert [i for b in buckets for i in b] == list(reversed(range(len(params))))
    assert nbytes[0] <= mbdist.FIRST_BUCKET_BYTES
    assert len(buckets) >= mbdist.MIN_BUCKETS - 1  # the ceiling can leave one short
    assert max(nbytes) <= -(-sum(nbytes) // mbdist.MIN_BUCKETS)
    assert buckets[-1][-1] == 0  # the token embedding

    big = [torch.empty(1 << 21, device="meta") for _ in range(100)]  # 100 x 8 MiB
    layout = mbdist.OverlappedReduce(big).buckets
    assert all(len(b) == 3 for b in layout[1:-1])  # 24 MiB of 8 MiB tensors per bucket
    assert len(layout[0]) == 1  # alone: larger than the first bucket's 1 MiB

    mixed = [torch.empty(4, dtype=t, device="meta") for t in (torch.float32, torch.float64)]
    assert mbdist.OverlappedReduce(mixed).buckets == [[1], [0]]
