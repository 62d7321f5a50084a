"""How a ``Trainer`` saves its run into a checkpoint and restores it: the part of the
Trainer that knows the checkpoint layout (``mbcompile.training.checkpoint``), the RNG
states (``rng``), what may change on resume (``elastic``) and the stop signals.

The Trainer inherits it: its methods read the Trainer's model, optimizer, step count,
metrics log and LR scaling, named in the annotations below.

>>> trainer = Trainer(model, opt, gbs=16, num_csx=4, checkpoint_dir="runs/ck",
...                   checkpoint_every=5)
>>> trainer.fit(data, max_steps=10)             # step-00000005, step-00000010
>>> trainer.fit(data, max_steps=20, resume=True)  # from step-00000010, exactly
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mbcompile.execution.noise import NoiseScale
from mbcompile.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    TrainingInterrupted,
    control_group,
)
from mbcompile.training.data_cursor import DataCursor
from mbcompile.training.elastic import check_run, warn_config
from mbcompile.training.lr_scaling import LRScaling
from mbcompile.training.metrics import MetricsLog
from mbcompile.training.rng import (
    generator_states,
    preserved_rng,
    rng_state,
    set_generator_states,
    set_rng_state,
)
from mbcompile.training.signals import describe_signal
from mbcompile.version import __version__

__all__ = ["CheckpointingMixin"]


class CheckpointingMixin:
    """The Trainer's checkpoints: save after a step, restore the newest good one."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    sharded: bool
    gbs: int
    num_csx: int
    backend: str  # resolved: "simulated" or "torch.distributed"
    compile_options: dict[str, Any]
    history: list[dict[str, Any]]
    global_step: int
    log: MetricsLog | None
    checkpoints: CheckpointStore | None
    config: dict[str, Any] | None
    last_checkpoint: Path | None
    lr_scaling: LRScaling | None
    progress: bool
    _group: Any
    _print: Callable[[str], None]  # the Trainer's progress display (``progress.py``)

    def _ranks(self) -> tuple[int, int]:
        if self.backend == "torch.distributed":
            import torch.distributed as dist

            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _noise(self) -> NoiseScale | None:
        noise = self.compile_options.get("measure_noise_scale")
        return noise if isinstance(noise, NoiseScale) else None

    def _save(self, step: int, cursor: DataCursor, fit_start: int, reason: str) -> Path:
        """A checkpoint after training step ``step`` of this fit (every rank calls it)."""
        assert self.checkpoints is not None
        noise = self._noise()
        trainer = {
            "step": step, "global_step": self.global_step, "reason": reason,
            "data": cursor.position(),
            "metrics_rows": self.log.rows if self.log is not None else len(self.history),
            "fit_first_row": fit_start,
            "run": self._run_shape(),
            "lr_scaling": dataclasses.asdict(self.lr_scaling) if self.lr_scaling else None,
            "noise_scale": noise.state_dict() if noise is not None else None,
            "config": self.config,
            "versions": {"torch": torch.__version__, "mbcompile": __version__},
        }
        with preserved_rng():
            path = self.checkpoints.save(self.global_step, self._state(), trainer,
                                         {"rng": rng_state(), "pass_rng": cursor.pass_rng,
                                          "generators": generator_states(self.model)})
        self.last_checkpoint = path
        if self.progress:
            self._print(f"checkpoint after step {step} ({reason}): {path}")
        return path

    def _state(self) -> dict[str, Any]:
        """The model's and optimizer's state dicts; sharded, each rank's shards (DTensors)
        with the optimizer's state keyed by parameter name, as DCP wants them."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, optimizer = get_state_dict(self.model, self.optimizer)
            return {"model": model, "optimizer": optimizer}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _restore(self, cursor: DataCursor) -> Checkpoint | None:
        """Load the newest good checkpoint into the model, optimizer and trainer, and put
        ``cursor`` where it was; RNG states last, so nothing here draws from them."""
        assert self.checkpoints is not None
        changed: list[str | None] = [None]

        def check(path: Path, trainer: Mapping[str, Any]) -> None:
            # before any state is read: another gbs or model is refused, systems may change
            changed[0] = check_run(path, trainer["run"], self._run_shape())

        # sharded: DCP reads each rank's shards into the current state's DTensors (only
        # once a checkpoint is chosen: get_state_dict gives a fresh optimizer its state)
        ck = self.checkpoints.load_newest(
            check=check, targets=(lambda *_: self._state()) if self.sharded else None)
        if ck is None:
            self._print(f"resume: no checkpoint in {self.checkpoints.folder}; starting from "
                        "step 0")
            return None
        t = ck.trainer
        if changed[0] is not None:
            self._print(f"resume: checkpoint {ck.path} was {changed[0]}")
        if self._ranks()[0] == 0:  # one warning, not one per rank
            warn_config(ck.path, t.get("config"), self.config)
        self._load_state(ck)
        self.global_step = int(t["global_step"])
        if t.get("lr_scaling") is not None and self.lr_scaling is not None:
            state = dict(t["lr_scaling"])
            self.lr_scaling = LRScaling(**{**state, "base_lrs": tuple(state["base_lrs"])})
        noise = self._noise()
        if noise is not None and t.get("noise_scale") is not None:
            noise.load_state_dict(t["noise_scale"])
        if self.log is not None:  # a rank the checkpoint's world lacked has no rows to keep
            ours = self._ranks()[0] < ck.world_size
            self.history = self.log.resume(int(t["metrics_rows"]) if ours else 0)
        cursor.seek(t["data"], ck.rank.get("pass_rng"))
        set_rng_state(ck.rank["rng"])
        set_generator_states(self.model, ck.rank.get("generators"))
        self.last_checkpoint = ck.path
        self._print(f"resumed from {ck.path}: step {t['step']}, global step "
                    f"{self.global_step}")
        return ck

    def load_weights(self) -> Checkpoint | None:
        """The newest good checkpoint's weights into the model, for validating what a fit
        trained (``mbcompile validate``), and its global step for the rows; its data
        position, RNG states and metrics are left alone. None where there is none (the
        model as it was built)."""
        if self.checkpoints is None:
            return None
        ck = self.checkpoints.load_newest(
            check=lambda path, t: check_run(path, t["run"], self._run_shape()),
            targets=(lambda *_: self._state()) if self.sharded else None)
        if ck is not None:
            self._load_state(ck)
            self.global_step = int(ck.trainer["global_step"])
        return ck

    def _load_state(self, ck: Checkpoint) -> None:
        """``ck``'s model and optimizer state into the Trainer's (sharded: each rank's)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            set_state_dict(self.model, self.optimizer, model_state_dict=ck.state["model"],
                           optim_state_dict=ck.state["optimizer"])
        else:
            _refuse_another_shape(ck, self.model, self.optimizer)  # before anything loads
            self.model.load_state_dict(ck.state["model"])
            self.optimizer.load_state_dict(ck.state["optimizer"])

    def _run_shape(self) -> dict[str, Any]:
        """The run's shape, checked on resume (``elastic.check_run``): the systems and
        ranks may change, the rest may not."""
        return {"gbs": self.gbs, "num_csx": self.num_csx, "world_size": self._ranks()[1],
                "shard": "fsdp" if self.sharded else None,
                "model": type(self.model).__name__, "optimizer": type(self.optimizer).__name__}

    def _interrupted(self, signum: int, step: int, saved: Path | None) -> TrainingInterrupted:
        if self.progress:
            self._print(f"stopped by {describe_signal(signum)} after step {step}"
                        + (f": checkpoint {saved}" if saved is not None else ""))
        return TrainingInterrupted(signum, step, saved)

    def _control_group(self) -> Any:
        if self.backend == "torch.distributed" and self._group is None:
            self._group = control_group()
        if self.checkpoints is not None:
            self.checkpoints.group = self._group
        return self._group


def _refuse_another_shape(ck: Checkpoint, model: nn.Module,
                          optimizer: torch.optim.Optimizer) -> None:
    """A model or optimizer of the run's classes but of another shape (a wider layer,
    another parameter group) is refused with what differs, before any state is loaded:
    ``load_state_dict`` raised torch's own error halfway, with some tensors copied in."""
    ours, theirs = model.state_dict(), ck.state["model"]
    differ = [f"{k} is missing" for k in ours if k not in theirs][:3] + [
        f"{k} is not the model's" for k in theirs if k not in ours][:3] + [
        f"{k} has shape {tuple(theirs[k].shape)} (the model's: {tuple(v.shape)})"
        for k, v in ours.items() if k in theirs and hasattr(theirs[k], "shape")
        and tuple(theirs[k].shape) != tuple(v.shape)][:3]
    groups = len(ck.state["optimizer"].get("param_groups", ()))
    if groups != len(optimizer.param_groups):
        differ.append(f"the optimizer has {groups} parameter groups (yours: "
                      f"{len(optimizer.param_groups)})")
    if differ:
        raise CheckpointError(
            f"checkpoint {ck.path} was written with another shape of "
            f"{type(model).__name__}: {'; '.join(differ)}. Resume it with the model and "
            "optimizer it was written with, or start a new run in another folder; nothing "
            "was loaded")
