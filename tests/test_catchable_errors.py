"""Failures inside the loop stay catchable by the handlers users already have.

``MicrobatchError`` is a ``RuntimeError``; an out-of-memory error in any microbatch,
forward or backward, surfaces after the rollback as ``MicrobatchOutOfMemoryError``,
which is both a ``MicrobatchError`` (naming system and microbatch) and a
``torch.OutOfMemoryError`` with the allocator's text, so Accelerate's
``find_executable_batch_size`` retries with a smaller batch as it would eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from accelerate.utils import find_executable_batch_size
from faults import on_output_gradient

import mbcompile
from mbcompile.check import relative_error
from mbcompile.models import make_mlp

#: What the CUDA caching allocator says (and what Accelerate looks for: " out of memory.").
OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free.")


def _oom_above(rows: int) -> Any:
    """A forward pre-hook that runs out of memory on inputs of more than ``rows`` samples."""
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if args[0].shape[0] > rows:
            raise torch.OutOfMemoryError(OOM_TEXT)
    return hook


def test_microbatch_error_is_a_runtime_error():
    assert issubclass(mbcompile.MicrobatchError, RuntimeError)
    model, batch = make_mlp(6)
    cm = mbcompile.compile(model, 6, 2, 1, example_inputs=batch)
    model.net[0].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(RuntimeError, match="system 0, microbatch 0 failed in its forward"):
        cm(*batch)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("k", range(5))
def test_oom_in_any_microbatch_is_an_oom_and_a_microbatch_error(where, k):
    # gbs 9 over 2 systems, mbs 2: system 0 runs (2, 2, 1), system 1 (2, 2); k counts both
    model, batch = make_mlp(9, dtype=torch.float64)
    cm = mbcompile.compile(model, 9, 2, 2, example_inputs=batch)
    seen = {"n": 0}

    def fail_kth(*_: Any) -> None:
        seen["n"] += 1
        if seen["n"] == k + 1:
            raise torch.OutOfMemoryError(OOM_TEXT)

    if where == "forward":
        model.net[0].register_forward_pre_hook(mbcompile.per_microbatch(fail_kth))
    else:
        on_output_gradient(model.net[0], lambda g: fail_kth())
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    with pytest.raises(torch.OutOfMemoryError) as info:
        loss, _ = cm(*batch)
        loss.backward()
    exc = info.value
    assert isinstance(exc, mbcompile.MicrobatchError)
    assert isinstance(exc, mbcompile.MicrobatchOutOfMemoryError)
    system, local = (0, k) if k < 3 else (1, k - 3)
    assert f"system {system}, microbatch {local} failed in its {where}" in str(exc)
    assert OOM_TEXT in str(exc) and len(exc.args) == 1
    assert isinstance(exc.__cause__, torch.OutOfMemoryError)
    for n, p in model.named_parameters():  # rolled back: parameters and gradients as before
        assert torch.equal(p, before[n][0]) and torch.equal(p.grad, before[n][1]), n


def test_find_executable_batch_size_halves_the_batch_around_compile():
    """Accelerate's OOM retry loop, around compile and one step, as users write it."""
    tried = []
    budget = 4  # the "device" holds at most 4 samples per microbatch

    def halve() -> int:
        return tried[-1] // 2

    @find_executable_batch_size(starting_batch_size=32, reduce_batch_size_fn=halve)
    def train(batch_size: int) -> tuple[int, torch.Tensor]:
        tried.append(batch_size)
        model, batch = make_mlp(64, dtype=torch.float64)
        cm = mbcompile.compile(model, 64, 2, batch_size, example_inputs=batch)
        model.net[0].register_forward_pre_hook(_oom_above(budget))  # the device, at run time
        loss, _ = cm(*batch)
        loss.backward()
        return cm.plan.mbs, loss.detach()

    mbs, loss = train()
    assert tried == [32, 16, 8, 4]
    assert mbs == budget
    model, batch = make_mlp(64, dtype=torch.float64)
    want, _ = model(*batch)
    assert relative_error(loss, want) <= 1e-12


def test_other_errors_are_not_ooms():
    model, batch = make_mlp(6)
    cm = mbcompile.compile(model, 6, 2, 1, example_inputs=batch)
    model.net[0].register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(mbcompile.MicrobatchError) as info:
        cm(*batch)
    assert not isinstance(info.value, torch.OutOfMemoryError)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
