"""A plan that does not fit names the fixes that would, each one checked by applying it.

Static memory (before any tracing): the smallest FSDP2 world, a lighter optimizer when
it fits, never more replicated systems. The step: ``outputs="loss"`` and more systems
when the per-system batch is what does not fit, and that recompute was tried.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

import mbcompile
from mbcompile.errors import DoesNotFitError, PlanError
from mbcompile.models import make_tiny_gpt
from mbcompile.planning.estimates import format_bytes
from mbcompile.planning.fixes import (
    StaticMemory,
    smallest_fsdp_world,
    static_does_not_fit,
    static_fixes,
    static_memory_of,
    with_recompute_fix,
    with_recompute_tried,
)
from mbcompile.planning.optimizer_state import with_optimizer
from mbcompile.planning.systems import SystemSpec, get_system

GBS = 16


def _spec(usable: float, reserved: float = 0.0) -> SystemSpec:
    return SystemSpec("small", memory_bytes=usable + reserved, reserved_bytes=reserved,
                      peak_flops=1e12, peak_flops_fp32=1e12, memory_bandwidth=1e11)


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # fp32, 8,320 parameters


# --------------------------------------------------------------------------- #
# Static memory
# --------------------------------------------------------------------------- #


def test_the_fsdp_world_named_is_the_smallest_that_holds_static_memory() -> None:
    model = _wide()
    static = static_memory_of(model, _spec(1e9))  # Adam-like 8 B/param: 4 x 33 kB
    capacity = static.total / 5.5
    error = static_does_not_fit(model, _spec(capacity, reserved=1e4))
    assert error is not None and error.mbs == 0
    world = smallest_fsdp_world(static, capacity)
    assert static.sharded(world) <= capacity < static.sharded(world - 1)
    assert f"FSDP2 over at least {world} ranks" in error.fixes[0]
    assert f"num_csx={world}" in error.fixes[0]
    # a replica: more systems never help, so no fix but the FSDP one names num_csx
    assert not any("num_csx" in f for f in error.fixes[1:])
    assert "do not shrink it" in str(error) and "10.00 kB reserved" in str(error)
    assert error.fixes[-1].startswith(
        f"a system with at least {format_bytes(static.total + 1e4)} of memory")


def test_accumulating_gradients_sharded_is_said() -> None:
    """FSDP2 holding unsharded gradients while accumulating would need more ranks, or no
    world at all; the fix names the gradient sync that keeps them sharded instead."""
    static = StaticMemory(params=40e9, buffers=0.0, grads=40e9, optimizer=80e9)
    assert smallest_fsdp_world(static, 79e9) == 3  # 160 / 3 = 53 GB
    assert smallest_fsdp_world(static, 79e9, accumulating=True) == 4  # 120 / 4 + 40 = 70
    assert smallest_fsdp_world(static, 39e9, accumulating=True) is None  # the grads alone
    for capacity, needing in ((79e9, "needing 4 ranks"), (39e9, "which no world fits")):
        (fix, *_) = static_fixes(static, _spec(capacity))
        assert "FSDP2 over at least" in fix and needing in fix
        assert "gradient_sync='microbatch', which 'auto' picks when it must" in fix


def test_a_lighter_optimizer_is_named_only_when_static_memory_then_fits() -> None:
    model = _wide()
    static = static_memory_of(model, _spec(1e9))
    weights = static.params + static.grads
    # room for weights, gradients and one momentum buffer, not Adam's two moments
    fits_momentum = _spec(weights + static.grads * 1.5)
    error = static_does_not_fit(model, fits_momentum)
    assert error is not None
    lighter = [f for f in error.fixes if f.startswith("an optimizer")]
    assert lighter and "optimizer='sgd-momentum'" in lighter[0]
    assert static_does_not_fit(model, with_optimizer(fits_momentum, "sgd-momentum",
                                                     model)) is None  # the fix works
    # not even plain SGD (no state) fits: no optimizer is named
    error = static_does_not_fit(model, _spec(weights * 0.9))
    assert error is not None and not any("optimizer=" in f for f in error.fixes)


def test_a_meta_model_that_cannot_fit_fails_before_tracing_with_the_fixes() -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8))).to(torch.bfloat16)
    x = torch.empty(4, 1024, device="meta", dtype=torch.bfloat16)
    spec = _spec(40e6)
    with pytest.raises(DoesNotFitError) as info:
        mbcompile.compile(model, 4, 2, example_inputs=(x,), system=spec, compile_only=True,
                          optimizer="adamw-mixed")
    message = str(info.value)
    assert "whatever the MBS" in message and "adamw-mixed" in message
    assert "FSDP2 over at least" in message


# --------------------------------------------------------------------------- #
# The step
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def gpt() -> tuple[nn.Module, tuple, dict[str, float]]:
    model, batch = make_tiny_gpt(GBS, vocab=512)
    peak = {o: mbcompile.compile(model, GBS, 1, 1, example_inputs=batch, outputs=o,
                                 compile_only=True, recompute=False).estimate.memory.peak
            for o in ("all", "loss")}
    return model, batch, peak


def test_outputs_loss_and_more_systems_are_named_and_work(gpt) -> None:
    model, batch, peak = gpt
    tight = replace(get_system("host"), name="tight",
                    memory_bytes=(peak["loss"] + peak["all"]) / 2)
    with pytest.raises(DoesNotFitError) as info:
        mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=tight,
                          compile_only=True, recompute=False)
    fixes = info.value.fixes
    assert any(f.startswith("outputs='loss'") for f in fixes), fixes
    mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=tight,
                      compile_only=True, recompute=False, outputs="loss")  # it fits
    systems = [f for f in fixes if f.startswith("num_csx=")]
    assert systems, fixes
    n = int(systems[0].split("=")[1].split()[0])
    cm = mbcompile.compile(model, GBS, n, "auto", example_inputs=batch, system=tight,
                           compile_only=True, recompute=False)
    assert cm.estimate.memory.fits
    with pytest.raises(DoesNotFitError):  # and it is the fewest
        mbcompile.compile(model, GBS, n - 1, 1, example_inputs=batch, system=tight,
                          compile_only=True, recompute=False)


def test_when_static_memory_is_the_problem_no_batch_fix_is_named(gpt) -> None:
    model, batch, peak = gpt
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    small = replace(get_system("host"), name="small", memory_bytes=2.5 * params)
    with pytest.raises(PlanError) as info:
        mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=small,
                          compile_only=True, recompute=False, outputs="loss")
    fixes = info.value.fixes
    assert not any(f.startswith(("num_csx=", "outputs=", "use mbs")) for f in fixes), fixes
    assert any("FSDP2" in f for f in fixes)


def test_the_error_says_that_recompute_was_tried() -> None:
    plain = DoesNotFitError("even mbs=1 does not fit", mbs=1, needed=3e6, available=1e6,
                            fixes=("a system with at least 3.00 MB",))
    checkpointed = DoesNotFitError("even mbs=1 does not fit (checkpointed)", mbs=1,
                                   needed=2e6, available=1e6,
                                   fixes=("a system with at least 2.00 MB",))
    error = with_recompute_tried(plain, checkpointed)
    assert str(error).startswith(str(checkpointed))  # the least memory tried, its fixes
    assert str(error).endswith("(recompute) was tried: the figures and fixes above are with "
                               "it; without it mbs 1 needs 3.00 MB")
    assert error.fixes == checkpointed.fixes and error.needed == 2e6


def test_a_mixed_precision_optimizer_is_offered_mixed_alternatives() -> None:
    model = _wide().to(torch.bfloat16)
    spec = with_optimizer(_spec(1e9), "adamw-mixed", model)
    static = static_memory_of(model, spec)
    error = static_does_not_fit(model, replace(spec, memory_bytes=static.total * 0.8))
    assert error is not None
    lighter = next(f for f in error.fixes if f.startswith("an optimizer"))
    assert "optimizer='sgd-momentum-mixed'" in lighter  # the fp32 masters stay


def test_recompute_is_named_first_when_it_was_not_tried_and_fits() -> None:
    plain = DoesNotFitError("mbs=4 does not fit\n  fix: use mbs=2", mbs=4, needed=3e6,
                            available=1e6, fixes=("use mbs=2",))
    error = with_recompute_fix(plain, 4, 0.9e6)
    assert str(error).endswith("fix: recompute=True (activation checkpointing per block): "
                               "mbs=4 then fits, modelled peak 900.00 kB; or use mbs=2")
    assert error.fixes[0].startswith("recompute=True") and error.fixes[1:] == plain.fixes


def test_a_sharded_model_is_told_how_many_ranks_and_never_fewer() -> None:
    model = _wide()
    static = static_memory_of(model, _spec(1e9))
    spec = _spec(static.sharded(4) * 1.01)  # 4 ranks hold it, 2 do not
    assert static_does_not_fit(model, spec, world=4) is None
    error = static_does_not_fit(model, spec, world=2)
    assert error is not None
    assert "more ranks than the present 2: over at least 4 ranks" in error.fixes[0]


def test_compile_names_recompute_or_says_it_was_tried(gpt) -> None:
    """Between the checkpointed and the plain peak at mbs 1: ``recompute=False`` fails and
    names ``recompute=True`` first, which then fits; below the checkpointed peak, ``auto``
    tries it and the error says so."""
    model, batch, _ = gpt
    peak = {r: mbcompile.compile(model, GBS, 1, 1, example_inputs=batch, outputs="loss",
                                 compile_only=True, recompute=r).estimate.memory.peak
            for r in (False, True)}
    assert peak[True] < peak[False]
    between = replace(get_system("host"), name="between", reserved_bytes=0.0,
                      memory_bytes=(peak[True] + peak[False]) / 2)
    with pytest.raises(DoesNotFitError) as info:
        mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=between,
                          compile_only=True, recompute=False, outputs="loss")
    assert info.value.fixes[0].startswith("recompute=True"), info.value.fixes
    cm = mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=between,
                           compile_only=True, recompute=True, outputs="loss")
    assert cm.plan.recompute and cm.estimate.memory.fits
    below = replace(between, name="below", memory_bytes=peak[True] * 0.9)
    with pytest.raises(DoesNotFitError, match=r"activation checkpointing per block "
                                              r"\(recompute\) was tried"):
        mbcompile.compile(model, GBS, 1, "auto", example_inputs=batch, system=below,
                          compile_only=True, outputs="loss")
