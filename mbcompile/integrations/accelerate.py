"""Hugging Face Accelerate around a compiled module, on one process or several.

``accelerator.prepare(cm, opt, dl)`` wraps a module with trainable parameters in
``DistributedDataParallel`` whenever Accelerate runs several processes (MULTI_CPU,
MULTI_GPU). A module compiled with ``backend="torch.distributed"`` already all-reduces its
gradients once per step, so DDP would reduce them a second time: twice the traffic, and
on three ranks or more ``(g + g + g) / 3`` need not be ``g`` to the last bit. ``prepare``
below is ``accelerator.prepare`` with each compiled module prepared by Accelerate's own
``prepare_model(cm, evaluation_mode=True)``: device placement and mixed precision as
usual, no DDP wrapper. Example, on 2 processes with gbs 6 (3 samples each)::

    accelerator = Accelerator()                      # joins or starts the process group
    cm = mbcompile.compile(model, gbs=6, num_csx=accelerator.num_processes, mbs=2,
                           example_inputs=batch, backend="torch.distributed")
    loader = DataLoader(ds, batch_size=6 // accelerator.num_processes)  # each rank's share
    cm, opt, loader = mbcompile.integrations.accelerate.prepare(accelerator, cm, opt, loader)

Accelerate hands process ``r`` the ``r``-th of each ``num_processes`` consecutive
batches, which is exactly plan share ``r`` of the global batch
(``mbcompile.distributed.shard``) when the shares are equal. The checks here refuse,
before the first step, what would otherwise be wrong or hang later: the simulated backend
on several processes, a loader whose per-process batch is not the plan's share, a dataset
whose last global batch Accelerate would pad with repeated samples, sharding or
tensor/context parallel modes, and Accelerate's own gradient accumulation.
"""

from __future__ import annotations

import math
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from mbcompile.compiled_module import CompiledModule
from mbcompile.execution.rank_shares import PlanSampler
from mbcompile.passes.errors import InputError
from mbcompile.planning.plan import MicrobatchPlan

__all__ = ["prepare"]

#: the kinds without a sharding engine (``multi_device`` covers MULTI_GPU, MULTI_XPU, ...)
_DATA_PARALLEL = (DistributedType.NO, DistributedType.MULTI_CPU)

#: where the uneven shares' recipe is spelled out
_UNEVEN = ("for uneven shares do not prepare the DataLoader: give each process "
           "DataLoader(ds, batch_sampler=mbcompile.distributed.PlanSampler(len(ds), cm.plan, "
           "accelerator.process_index)) and move its batches with .to(accelerator.device)")


def prepare(accelerator: Accelerator, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)``, the compiled modules among them left unwrapped.

    Returns the prepared objects in the order given (one object alone, not a tuple), as
    ``accelerator.prepare`` does. Raises ``InputError`` for a setup that would reduce
    twice, train each process on its own batch, or feed a rank other than its share.
    """
    compiled = [o for o in objects if isinstance(o, CompiledModule)]
    for cm in compiled:
        _check_setup(accelerator, cm)
    if compiled and accelerator.num_processes > 1:
        _check_schedulers(accelerator, objects)
    if len(compiled) == 1 and accelerator.num_processes > 1:
        plan = compiled[0].plan
        for loader in objects:
            if isinstance(loader, DataLoader):
                _check_loader(loader, plan, accelerator.num_processes,
                              accelerator.split_batches)
    others = [o for o in objects if not isinstance(o, CompiledModule)]
    done = accelerator.prepare(*others) if others else ()
    done = iter(done if len(others) != 1 else (done,))
    result = []
    for o in objects:
        if isinstance(o, CompiledModule):
            o = accelerator.prepare_model(o, evaluation_mode=True)  # mixed precision, no DDP
            o._is_accelerate_prepared = True  # a later accelerator.prepare(cm) returns it as is
        else:
            o = next(done)
        result.append(o)
    return result[0] if len(result) == 1 else tuple(result)


def _check_setup(accelerator: Accelerator, cm: CompiledModule) -> None:
    """Refuse the configurations in which the compiled module's step is not the step run."""
    kind = accelerator.distributed_type
    parallel = accelerator.parallelism_config
    split = parallel is not None and (parallel.tp_enabled or parallel.cp_enabled)
    if split or (kind not in _DATA_PARALLEL and not accelerator.multi_device):
        raise InputError(
            f"Accelerate runs {kind.value}{' with tensor or context parallelism' * split}; "
            "mbcompile.integrations.accelerate.prepare supports data-parallel processes "
            "(MULTI_CPU, MULTI_GPU, ...). To shard a large model, apply FSDP2's fully_shard "
            "before compiling with backend='torch.distributed' (docs/distributed.md)")
    if accelerator.num_processes > 1 and cm.backend != "torch.distributed":
        raise InputError(
            f"the module was compiled for backend={cm.backend!r}, which runs the whole global "
            f"batch in one process, but Accelerate runs {accelerator.num_processes} processes: "
            "create the Accelerator first, then compile with backend='torch.distributed' and "
            f"num_csx={accelerator.num_processes}, so each process runs its share and the "
            "gradients are all-reduced once")
    if accelerator.gradient_accumulation_steps != 1:
        raise InputError(
            f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}: the "
            "compiled module already runs the global batch as microbatches and hands back its "
            "gradient. Keep gradient_accumulation_steps=1; for a larger batch, compile with a "
            "larger gbs (exact, also for token-weighted losses)")


def _check_schedulers(accelerator: Accelerator, objects: tuple[Any, ...]) -> None:
    """A prepared LR scheduler steps once per process at each optimizer step, unless the
    batches are split (Accelerate takes each process's batch for a whole one): with a
    compiled module the global batch is the one step, so it would step too fast."""
    if accelerator.split_batches or not accelerator.step_scheduler_with_optimizer:
        return
    if any(isinstance(o, LRScheduler) for o in objects):
        raise InputError(
            f"a learning-rate scheduler prepared on {accelerator.num_processes} processes "
            "without split_batches steps once per process at every optimizer step "
            f"({accelerator.num_processes} steps of the schedule per global batch), but the "
            "compiled module's step is one global batch. Fix: build the loader with "
            "batch_size=gbs and Accelerator(dataloader_config=DataLoaderConfiguration("
            "split_batches=True)), or Accelerator(step_scheduler_with_optimizer=False); "
            "nothing was prepared")


def _check_loader(loader: DataLoader, plan: MicrobatchPlan, world: int,
                  split_batches: bool) -> None:
    """Each process must get exactly its plan share of every global batch, and every global
    batch must be real samples: Accelerate pads an incomplete last round with samples from
    the start of the dataset."""
    if isinstance(loader.batch_sampler, PlanSampler):
        raise InputError(
            "this DataLoader's PlanSampler already gives each process its share of every global "
            "batch, and Accelerate would split those shares again across the processes: leave "
            "it out of prepare and move its batches with .to(accelerator.device)")
    if loader.batch_size is None:  # another batch_sampler: its batches are checked as they come
        return
    sizes = plan.per_system_batch_sizes
    if len(set(sizes)) != 1:
        raise InputError(
            f"the plan's shares of gbs={plan.gbs} are {list(sizes)} samples, but Accelerate's "
            f"DataLoader gives every process as many; compile with a gbs divisible by {world}, "
            f"or {_UNEVEN}")
    per_process = loader.batch_size // world if split_batches else loader.batch_size
    if per_process != sizes[0] or (split_batches and loader.batch_size % world):
        how = (f"batch_size={plan.gbs} with split_batches=True" if split_batches
               else f"batch_size={sizes[0]}")
        raise InputError(
            f"the DataLoader's batch_size={loader.batch_size} gives each of the {world} "
            f"processes {per_process} samples a step, but each one's share of gbs={plan.gbs} "
            f"is {sizes[0]} (cm.plan.per_system_batch_sizes): build the DataLoader with {how}")
    try:
        length = len(loader.dataset)
    except TypeError:  # an iterable dataset: a short last batch is refused when it comes
        return
    drop_last = bool(getattr(loader, "drop_last", False))
    base = loader.batch_size
    batches = length // base if drop_last else math.ceil(length / base)
    rounds = 1 if split_batches else world
    if (length % base and not drop_last) or batches % rounds:
        raise InputError(
            f"the dataset's {length} samples do not make whole global batches of {plan.gbs} "
            f"for {world} processes: Accelerate would pad the last one with samples from the "
            "start of the dataset (or cut it unevenly); use a dataset whose length is a "
            f"multiple of {plan.gbs} (torch.utils.data.Subset(ds, range(len(ds) // {plan.gbs} "
            f"* {plan.gbs}))), or {_UNEVEN}")
