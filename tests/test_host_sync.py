"""At most one host-device synchronisation per training step, whatever the microbatch count.

The loop never reads the device per microbatch: finite-loss checks, the noise
scale's squared norms and the loss counts accumulate in device tensors and the
step reads them once, at its end (``runtime._StepChecks``). A hand-written loop
that calls ``loss.item()`` per microbatch is counted too, to show the counter sees
what it must.
"""

from __future__ import annotations

import dist_workers
import pytest
import torch
from host_reads import HostReads
from test_distributed import _run

import mbcompile
from mbcompile.models import make_mlp, make_tiny_gpt

MAKERS = {"tiny_gpt": make_tiny_gpt, "mlp": make_mlp}


def _reads_per_step(name: str, microbatches: int, noise: bool, nonfinite: str = "raise"
                    ) -> HostReads:
    model, batch = MAKERS[name](16, dtype=torch.float64)
    cm = mbcompile.compile(model, 16, 1, 16 // microbatches, example_inputs=batch,
                           measure_noise_scale=noise, nonfinite=nonfinite)
    assert cm.plan.num_microbatches == microbatches
    loss, _ = cm(*batch)  # warm: the first call may compile
    loss.backward()
    with HostReads() as reads:
        loss, _ = cm(*batch)
        loss.backward()
    return reads


@pytest.mark.parametrize("noise", [False, True], ids=["plain", "noise_scale"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_one_host_read_per_training_step(name, noise):
    for microbatches in (4, 16):
        reads = _reads_per_step(name, microbatches, noise)
        assert reads.total == 1, (microbatches, dict(reads.ops))
        assert reads.ops["mbcompile.execution.runtime.read_host"] == 1


@pytest.mark.parametrize("noise", [False, True], ids=["plain", "noise_scale"])
def test_a_step_that_returns_a_non_finite_loss_reads_only_the_noise_scale(noise):
    """By default (``nonfinite="return"``) nothing in the step needs the host: no read at
    all, unless the noise scale's norms are measured (one read, as before)."""
    reads = _reads_per_step("mlp", 4, noise, "return")
    assert reads.total == int(noise), dict(reads.ops)


def test_noise_scale_is_read_when_asked_for_not_in_the_step():
    model, batch = make_mlp(16, dtype=torch.float64)
    cm = mbcompile.compile(model, 16, 1, 4, example_inputs=batch, measure_noise_scale=True)
    for _ in range(2):
        loss, _ = cm(*batch)
        loss.backward()
    assert cm.noise_scale.steps == 2
    with HostReads() as reads:
        value = cm.noise_scale.b_simple  # settles both steps' device-side units
    assert reads.ops["aten._local_scalar_dense"] == 2
    assert value == value  # a number, not NaN: two steps of four microbatches


def test_inference_reads_nothing():
    model, batch = make_tiny_gpt(16, dtype=torch.float64)
    cm = mbcompile.compile(model, 16, 1, 4, example_inputs=batch)
    with torch.no_grad(), HostReads() as reads:
        cm(*batch)
    assert reads.total == 0, dict(reads.ops)


def test_the_counter_sees_a_hand_loop_that_reads_every_microbatch():
    model, (x, y) = make_mlp(16, dtype=torch.float64)
    with HostReads() as reads:
        for xs, ys in zip(x.split(4), y.split(4)):
            loss, _ = model(xs, ys)
            if not torch.isfinite(loss).item():
                raise AssertionError
            loss.backward()
    assert reads.ops["aten._local_scalar_dense"] == 4


def test_a_non_finite_loss_is_still_found_and_named_after_the_one_read():
    model, (x, y) = make_mlp(16, dtype=torch.float64)
    cm = mbcompile.compile(model, 16, 2, 2, example_inputs=(x, y), nonfinite="raise")
    y = y.clone()
    y[13] = float("nan")  # system 1 holds rows 8..15 in microbatches of 2: row 13 is its third
    with pytest.raises(mbcompile.MicrobatchError, match="system 1, microbatch 2 is nan"):
        loss, _ = cm(x, y)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # spawns two ranks
def test_one_host_read_per_step_on_ranks(tmp_path):
    counts = {}
    for mbs in (1, 4):
        _run(dist_workers.counted_step, 2, str(tmp_path), 8, mbs)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")
            counts[mbs, rank] = got["reads"]
            assert got["reads"] == 1, (mbs, rank, got["detail"])
    assert len(counts) == 4
