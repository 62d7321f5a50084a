"""The training frameworks people use, with a compiled model: each example in ``examples/``
trains three optimizer steps and must equal three plain full-batch steps (float64), Accelerate
also on two gloo processes, where DistributedDataParallel must not reduce a second time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from integration_workers import accelerate_ranks, example
from models import TOL, plan_free
from test_distributed import _run
from torch.utils.data import DataLoader, TensorDataset

import mbcompile
from mbcompile.errors import InputError
from mbcompile.integrations.accelerate import _check_loader, _check_schedulers, prepare
from mbcompile.models import make_tiny_gpt
from mbcompile.planning.plan import make_plan


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's notes on workers, logging
@pytest.mark.parametrize("name", ["lightning", "accelerate_loop", "plain_loop"])
def test_the_example_trains_like_plain_full_batch_steps(name):
    # lightning: also its validation loss, on a batch of another size than gbs
    assert example(name).max_difference() <= 1e-12


def test_accelerate_on_two_processes_reduces_once_and_equals_the_full_batch(tmp_path):
    """examples/accelerate_ranks.py on two forked gloo ranks, ``Accelerator()`` created
    inside their process group: ``prepare`` returns the compiled module itself (no DDP),
    each step all-reduces every gradient element once, and the parameters after three
    steps are the single-process full batch's. Wrapped in DDP, as ``accelerator.prepare``
    would, its first call is refused."""
    _run(accelerate_ranks, 2, str(tmp_path))
    script = example("accelerate_ranks")
    plain = script.train_plain(script.initial_model())
    elements = sum(p.numel() for p in plain.parameters())
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["prepared"] == "CompiledModule" and got["wraps_model"], rank
        assert "would all-reduce them a second time" in got["inside_ddp"]
        assert sum(e[1] for e in got["gradient_reduces"]) == script.STEPS * elements
        for name, p in plain.named_parameters():
            assert (got["params"][name] - p.detach()).abs().max() <= TOL, (rank, name)


def _compiled(gbs: int = 6) -> mbcompile.CompiledModule:
    model, batch = make_tiny_gpt(gbs, dtype=torch.float64, depth=1)
    return mbcompile.compile(model, gbs, 2, 2, example_inputs=batch, **plan_free(2))


def test_prepare_in_one_process_is_accelerates_without_ddp():
    """One process: the same objects as ``accelerator.prepare``, the compiled module itself
    marked prepared, so that a second ``accelerator.prepare`` leaves it alone too."""
    cm = _compiled()
    opt = torch.optim.SGD(cm.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.zeros(12, 1)), batch_size=6)
    accelerator = Accelerator(cpu=True)
    got, got_opt, got_loader = prepare(accelerator, cm, opt, loader)
    assert got is cm and accelerator.prepare(cm) is cm
    assert got_opt.optimizer is opt and len(got_loader) == 2


def _processes(**overrides) -> SimpleNamespace:
    """What ``prepare`` reads of an Accelerator on two data-parallel CPU processes."""
    return SimpleNamespace(**{"distributed_type": DistributedType.MULTI_CPU,
                              "parallelism_config": None, "multi_device": False,
                              "num_processes": 2, "gradient_accumulation_steps": 1,
                              **overrides})


@pytest.mark.parametrize("accelerator,message", [
    (_processes(), "compiled for backend='simulated'"),  # each process would train alone
    (_processes(distributed_type=DistributedType.NO, num_processes=1,
                gradient_accumulation_steps=2), "compile with a larger gbs"),
    (_processes(distributed_type=DistributedType.DEEPSPEED), "FSDP2's fully_shard"),
])
def test_prepare_refuses_what_would_not_be_the_compiled_step(accelerator, message):
    with pytest.raises(InputError, match=message):
        prepare(accelerator, _compiled())


@pytest.mark.parametrize("gbs,samples,batch_size,drop_last,split,message", [
    (7, 14, 4, False, False, r"shares of gbs=7 are \[4, 3\].*PlanSampler"),
    (6, 12, 6, False, False, "build the DataLoader with batch_size=3"),
    (6, 12, 3, False, True, "batch_size=6 with split_batches=True"),
    (6, 13, 3, False, False, "would pad the last one"),   # 5 batches: the last round padded
    (6, 15, 3, True, False, "would pad the last one"),    # 5 whole batches of 3
    (6, 13, 3, True, False, None),                        # 4 whole batches of 3: 2 steps
    (6, 12, 3, False, False, None),
    (6, 12, 6, False, True, None),
])
def test_a_loader_must_give_each_process_its_share(gbs, samples, batch_size, drop_last, split,
                                                    message):
    loader = DataLoader(TensorDataset(torch.zeros(samples, 1)), batch_size=batch_size,
                        drop_last=drop_last)
    plan = make_plan(gbs, 2, 2)
    if message is None:
        _check_loader(loader, plan, 2, split)
    else:
        with pytest.raises(InputError, match=message):
            _check_loader(loader, plan, 2, split)


def test_a_plan_sampler_loader_is_left_out_of_prepare():
    """Its batches already are this rank's share (uneven shares: the recipe for them)."""
    plan = make_plan(7, 2, 2)
    loader = DataLoader(TensorDataset(torch.zeros(14, 1)),
                        batch_sampler=mbcompile.distributed.PlanSampler(14, plan, 0))
    with pytest.raises(InputError, match="leave it out of prepare"):
        _check_loader(loader, plan, 2, False)


@pytest.mark.parametrize("split,with_optimizer,refused", [
    (False, True, True), (True, True, False), (False, False, False)])
def test_a_scheduler_that_would_step_once_per_process_is_refused(split, with_optimizer,
                                                                  refused):
    """Without split_batches Accelerate steps a prepared scheduler num_processes times per
    optimizer step; the compiled module's step is one global batch (a hunt: the schedule
    ran twice as fast on 2 processes, parameters 0.27 relative off one process's run)."""
    opt = torch.optim.SGD(_compiled().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    accelerator = _processes(split_batches=split, step_scheduler_with_optimizer=with_optimizer)
    if refused:
        with pytest.raises(InputError, match="split_batches=True"):
            _check_schedulers(accelerator, (opt, sched))
    else:
        _check_schedulers(accelerator, (opt, sched))
    _check_schedulers(_processes(split_batches=False, step_scheduler_with_optimizer=True),
                      (opt,))  # no scheduler, nothing to refuse
