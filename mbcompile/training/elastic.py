"""What carries over when a run resumes: the same run on another number of systems.

A training step's numbers depend on the global batch, never on how it is split:
every system's share is a slice of the same GBS samples, the gradient is their exact
sum, and the LR schedule counts global steps. So a checkpoint written with N
systems (``num_csx``) or N torch.distributed ranks resumes with M at the same GBS::

    written   gbs 8, num_csx 2, 2 ranks    trainer.json, rng-rank0.json, rng-rank1.json
    resumed   gbs 8, num_csx 3, 3 ranks    the plan is recomputed (pbs 3, 3, 2); the
                                           data cursor, step, LR schedule and metrics
                                           rows are global and carry over as they are

What does not carry over is refused by ``check_run`` (``FIXED``): another global
batch (the sample order and every update change), another model or optimizer (the
state does not fit), another sharding (the state is laid out differently).

RNG states (``CheckpointStore`` reads them): on the world it was written with, each
rank restores its own file; on another world every rank restores rank 0's, the states
its data order was drawn from (each pass starts from rank 0's on every rank), so that
all ranks read the same batches. Draws inside the model (dropout) depend on the split
anyway: they are the documented exception to exactness.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mbcompile.training.checkpoint import CheckpointError

__all__ = ["ELASTIC", "FIXED", "VOLATILE_CONFIG", "check_run", "warn_config"]

#: What an exact resume needs unchanged, and why, as the refusal says it.
FIXED = {
    "gbs": "the global batch fixes the sample order, every step's update and the LR "
           "schedule",
    "model": "the checkpoint's parameters are another model's",
    "optimizer": "the checkpoint's optimizer state is another optimizer's",
    "shard": "sharded and unsharded checkpoints lay out the state differently",
}
#: What may change: the plan is recomputed from it, the step's numbers are not.
ELASTIC = ("num_csx", "world_size")

#: Config keys that may change between a run and its resume without a warning (the
#: systems and the backend: ``check_run`` says what changed).
VOLATILE_CONFIG = frozenset({"file", "output_dir", "max_steps", "val_steps", "val_every",
                             "log_every", "checkpoint_every", "keep_checkpoints", "num_csx",
                             "backend"})


def _same(key: str, then: Any, now: Any) -> bool:
    if key == "model":  # FSDP2 names a sharded model's class FSDP<its class>
        return str(then).removeprefix("FSDP") == str(now).removeprefix("FSDP")
    return then == now


def check_run(path: Path, written: Mapping[str, Any], now: Mapping[str, Any]) -> str | None:
    """Refuse to resume from checkpoint ``path`` if a ``FIXED`` part of the run's shape
    ``now`` differs from the one it was ``written`` with; else say what changed among
    ``ELASTIC`` (None: nothing). Keys a checkpoint lacks are not compared."""
    differ = [k for k in FIXED if k in written and k in now
              and not _same(k, written[k], now[k])]
    if differ:
        what = ", ".join(f"{k} {written[k]} (now {now[k]})" for k in differ)
        why = "; ".join(FIXED[k] for k in differ)
        raise CheckpointError(
            f"checkpoint {path} was written with {what}: {why}. Resume it with the "
            f"{' and '.join(differ)} it was written with (the number of systems and ranks "
            "may change), or start a new run in another folder")
    changed = [k for k in ELASTIC if k in written and k in now and written[k] != now[k]]
    if not changed:
        return None
    def count(n: Any, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 'es' if what.endswith('s') else 's'}"

    return (f"written with {count(written.get('num_csx'), 'system')} on "
            f"{count(written.get('world_size'), 'process')}, resumed with "
            f"{now.get('num_csx')} on {now.get('world_size')}: the same gbs {now.get('gbs')}, "
            "sample order and LR schedule; the plan is recomputed")


#: Config keys whose checkpointed state wins on resume: the optimizer's hyperparameters
#: are in its state dict (``Optimizer.load_state_dict`` restores them), and the LR
#: scaling's ramp in the trainer's state, so the run continues as it was going.
KEPT_ON_RESUME = ("optimizer_kwargs", "lr_scaling")


def warn_config(path: Path, then: Any, now: Mapping[str, Any] | None) -> None:
    """Say on stderr which config keys (other than ``VOLATILE_CONFIG``) differ from the
    ones checkpoint ``path`` was written with, and which values the run goes on with: the
    checkpoint's for ``KEPT_ON_RESUME`` (it said "the new values" for them too, while the
    learning rate stayed the checkpoint's), the new ones for the rest."""
    if not isinstance(then, dict) or now is None:
        return
    keys = sorted(k for k in set(then) | set(now)
                  if k not in VOLATILE_CONFIG and then.get(k) != now.get(k))
    kept = [k for k in keys if k in KEPT_ON_RESUME]
    new = [k for k in keys if k not in KEPT_ON_RESUME]
    said = []
    if new:
        said.append(f"{', '.join(new)} (the run continues with the new values)")
    if kept:
        said.append(f"{', '.join(kept)} (the run continues with the checkpoint's: the "
                    "optimizer's hyperparameters and the learning-rate scaling are part of "
                    "the state it resumes; to train with the new ones, start a new run in "
                    "another folder)")
    if said:
        print(f"resume: the config differs from the one checkpoint {path} was written "
              f"with in: {'; and in '.join(said)}", file=sys.stderr, flush=True)
