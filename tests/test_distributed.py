"""Real ranks on torch.distributed (gloo, 127.0.0.1): exact, one reduction per step, no hangs."""

from __future__ import annotations

import contextlib
import io
import multiprocessing.forkserver
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dist_workers
import pytest
import torch
import torch.multiprocessing as mp

from mbcompile.check import relative_error
from mbcompile.execution import distributed as mbdist
from mbcompile.execution import launcher
from mbcompile.models import make_tiny_gpt
from mbcompile.planning import buckets as sizes

TIMEOUT_S = 90

# 12-32 s per test on 2 cores (measured three times on a shared machine) while every rank
# was a fresh interpreter importing torch: every test that starts ranks is marked slow.
# Forked from the forkserver below, they take a few seconds.

# What the ranks' forkserver imports once (a module missing here is skipped): torch,
# mbcompile, and what their first step imports lazily (dynamo, FSDP, sympy, networkx).
FORKSERVER_PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo", "torch._inductor",
    "sympy", "networkx", "mbcompile.compiler", "mbcompile.execution.ranks",
    "dist_workers", "fsdp_workers", "fsdp_memory_workers", "fsdp_training_workers",
    "two_phase_workers",
]


def _run(fn, world: int, *args, timeout_s: float = TIMEOUT_S,
         collective_timeout_s: float = 30.0) -> None:
    """Start ``world`` gloo ranks running ``fn`` and wait, bounded in time.

    The ranks are forked from a forkserver that imported FORKSERVER_PRELOAD once for
    this test process (a spawned rank imported them itself: 3-5 s of CPU per rank,
    most of a short test). So the ranks share the forkserver's environment, working
    folder and hash seed, as they were at the first call: pass settings as arguments.
    Each rank's stdout and stderr go to a file, copied to this process's stderr (which
    pytest shows with the test) when the ranks have ended."""
    multiprocessing.forkserver.set_forkserver_preload(FORKSERVER_PRELOAD)  # once started: no-op
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    try:
        ctx = mp.start_processes(
            dist_workers.logged,
            args=(str(logs), launcher._worker, (world, launcher.free_port(), collective_timeout_s,
                                                fn, args)),
            nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"distributed test did not finish within {timeout_s} s")
    finally:
        for log in sorted(logs.glob("rank*.log")):
            text = log.read_text(errors="replace")
            if text:
                sys.stderr.write(f"---------- {log.stem} ----------\n{text}")
        shutil.rmtree(logs, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("world,gbs,mbs,bucket_bytes", [
    (2, 7, 2, 1 << 30),      # 4 + 3 samples, one bucket
    (2, 7, 2, 16 * 1024),    # several small buckets
    (3, 10, 2, 16 * 1024),   # 4 + 3 + 3 samples, several small buckets
])
def test_ranks_equal_full_batch_step(tmp_path, world, gbs, mbs, bucket_bytes):
    _run(dist_workers.train_step, world, str(tmp_path), gbs, mbs, bucket_bytes)
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64)
    loss, logits = model(*batch)
    loss.backward()
    start = 0
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
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


@pytest.mark.slow
@pytest.mark.parametrize("coupled", [False, True], ids=["loop", "two_phase"])
def test_a_shape_printed_or_returned_on_a_rank_is_the_whole_batchs(tmp_path, coupled):
    """Eager in each rank runs the whole batch: ``x.shape`` there is (7, 4). A rank printed
    and returned its share's, (4, 4) or (3, 4), beside a counter of ``x.shape[0]`` that
    counted the whole batch's 7 per step."""
    _run(dist_workers.sized_steps, 2, str(tmp_path), 7, coupled)
    torch.manual_seed(0)
    model = dist_workers.Sized(coupled).to(torch.float64)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(7, 4, generator=g, dtype=torch.float64),
             torch.randn(7, 3, generator=g, dtype=torch.float64))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        for _ in range(2):
            loss, shape = model(*batch)
            loss.backward()
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["printed"] == printed.getvalue()
        assert got["shapes"] == [shape, shape] and type(got["shapes"][0]) is torch.Size
        assert got["seen"] == model.seen == 14
        assert relative_error(got["loss"], loss) <= 1e-12
        assert relative_error(got["grad"], model.lin.weight.grad) <= 1e-12


def test_a_loss_times_a_draw_is_seeded_alike_at_every_step_on_ranks(tmp_path):
    """The seed replays the loss's tail at the value drawn (test_seeded_backward): on 2
    ranks every call from one state gives the same gradients, bit for bit, each rank the
    same, and they are eager's full-batch gradients to rounding."""
    from test_seeded_backward import _DrawnScale

    _run(dist_workers.drawn_scale_steps, 2, str(tmp_path), 7)
    torch.manual_seed(0)
    model = _DrawnScale()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(7, 4, generator=g), torch.randint(0, 3, (7,), generator=g)
    model(x, y).backward()
    ranks = [torch.load(tmp_path / f"rank{rank}.pt")["grads"] for rank in range(2)]
    for grads in ranks:
        for step in grads:
            assert all(torch.equal(a, b) for a, b in zip(step, ranks[0][0]))
            assert all(relative_error(a, p.grad) <= 1e-6 for a, p in zip(step, model.parameters()))


def test_a_hand_written_token_mean_with_every_label_masked_on_ranks_is_eagers(tmp_path):
    """``tok.sum() / mask.sum()``, every label of the second batch masked: its count is
    all-reduced before the backwards, so each rank's gradients are eager's zeros, not NaN."""
    from test_seeded_backward import IGNORE_INDEX, _HandMean

    _run(dist_workers.hand_mean_steps, 2, str(tmp_path), 7)
    torch.manual_seed(0)
    model = _HandMean("count").double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 11, (7, 5), generator=g),
                torch.randint(0, 11, (7, 5), generator=g)) for _ in range(3)]
    batches[1][1][:] = IGNORE_INDEX
    want = []
    for batch in batches:
        model(*batch).backward()
        want.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")["grads"]
        for step, (a, b) in enumerate(zip(got, want)):
            for p, q in zip(a, b):
                assert torch.equal(p, q) if step == 1 else relative_error(p, q) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("norm", [False, True], ids=["loop", "two_phase"])
def test_a_draw_of_rows_per_sample_on_ranks_is_eagers(tmp_path, norm):
    """``torch.rand(B * T)``: every rank draws the global batch's tokens once and reads its
    own samples' rows (tests/test_draws_merged.py on one process)."""
    from test_draws_merged import TokenDraw, _mask

    _run(dist_workers.token_draw_step, 2, str(tmp_path), 7, norm)
    torch.manual_seed(0)
    model = TokenDraw(_mask, norm).to(torch.float64)
    x = torch.randn(7, 5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.manual_seed(10)
    loss, r = model(x)
    after = torch.rand(())
    loss.backward()
    start = 0
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        size = got["sizes"][rank]
        assert relative_error(got["loss"], loss) <= 1e-12
        assert torch.equal(got["r"], r[start:start + size]) and torch.equal(got["after"], after)
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-10, atol=1e-14)
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
    # (the loss's token count is all-reduced before the first forward: seeding.py)
    sync = [i for i, e in enumerate(events) if e[0] == "reduce" and not e[3] and i > last_forward]
    assert launches[-1] < sync[0]  # every bucket before the status all-reduce
    in_backward = events[events.index(("backward",)):]
    assert [e for e in in_backward if e[0] == "reduce"] == []


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "last_backward", "nan"])
def test_failing_rank_stops_every_rank(tmp_path, where):
    """Wherever rank 1's step fails, both ranks raise, neither hangs, both issued the same
    collectives in the same order, and the user's gradients are untouched."""
    t0 = time.monotonic()
    _run(dist_workers.failing_step, 2, str(tmp_path), 6, where)
    assert time.monotonic() - t0 < TIMEOUT_S
    seen = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(2)}
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
                               if e[0] == "reduce" and e[3]] if where != "nan" else []
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
    assert nbytes[0] <= sizes.FIRST_BUCKET_BYTES
    assert len(buckets) >= sizes.MIN_BUCKETS - 1  # the ceiling can leave one short
    assert max(nbytes) <= -(-sum(nbytes) // sizes.MIN_BUCKETS)
    assert buckets[-1][-1] == 0  # the token embedding

    big = [torch.empty(1 << 21, device="meta") for _ in range(100)]  # 100 x 8 MiB
    layout = mbdist.OverlappedReduce(big).buckets
    assert all(len(b) == 3 for b in layout[1:-1])  # 24 MiB of 8 MiB tensors per bucket
    assert len(layout[0]) == 1  # alone: larger than the first bucket's 1 MiB

    mixed = [torch.empty(4, dtype=t, device="meta") for t in (torch.float32, torch.float64)]
    assert mbdist.OverlappedReduce(mixed).buckets == [[1], [0]]
