"""The scripts of ``examples/`` as modules, and what the ranks of
tests/test_integrations.py run (forked ranks import these functions by name)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch
from dist_workers import Collectives

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    """``examples/<name>.py``, imported under another name (``accelerate.py`` would not do)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def accelerate_ranks(rank: int, world: int, out_dir: str) -> None:
    """examples/accelerate_ranks.py's training on this rank, its process group already up,
    as ``Accelerator()`` finds it; saves the parameters, what ``prepare`` returned, and the
    gradient all-reduces (the asynchronous ones: the buckets) in order, and what a call
    inside DistributedDataParallel did."""
    from accelerate import Accelerator
    from torch.nn.parallel import DistributedDataParallel

    from mbcompile.errors import InputError

    script = example("accelerate_ranks")
    model = script.initial_model()
    with Collectives() as log:
        prepared = script.train_with_accelerate(Accelerator(cpu=True), model)
    try:  # what accelerator.prepare would have made of it: refused at the first call
        DistributedDataParallel(prepared)(*script.dataset()[:script.GBS // world])
        inside_ddp = "ran"
    except InputError as exc:
        inside_ddp = str(exc)
    torch.save({"params": {n: p.detach() for n, p in model.named_parameters()},
                "prepared": type(prepared).__name__, "wraps_model": prepared.module is model,
                "gradient_reduces": [e for e in log.reduces() if e[3]],
                "inside_ddp": inside_ddp},
               os.path.join(out_dir, f"rank{rank}.pt"))
