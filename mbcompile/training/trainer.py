"""``Trainer``: a training loop around ``mbcompile.compile``, configured by flag callbacks.

>>> trainer = Trainer(model, torch.optim.AdamW(model.parameters()), gbs=16, num_csx=4,
...                   callbacks=[GlobalFlags(micro_batch_size="auto"),
...                              ScopedTrainFlags(micro_batch_size=2),
...                              ScopedValidateFlags(micro_batch_size=4)],
...                   log_dir="runs/gpt")
>>> trainer.fit(train_batches, val_batches, max_steps=100)
>>> trainer.validate(val_batches)

What one ``fit`` does:

1. opens the train phase: a flag scope (see ``mbcompile.training.flags``) in which the
   ``ScopedTrainFlags`` apply; the first batch is the example that the phase's
   module is compiled from (``mbcompile.compile`` with the scope's MBS), and later
   batches reuse it;
2. runs each step: ``zero_grad``, the compiled call (forward and backward per
   microbatch inside it), ``loss.backward()`` (hands the step's gradient over),
   ``optimizer.step()``; logs a row (terminal, ``metrics.csv``, ``metrics.jsonl``);
3. validates (every ``val_every`` steps, and at the end) in its own phase, under
   ``model.eval()`` and ``torch.no_grad()``, compiled once with the validation MBS;
4. closes each phase in a ``finally``: flags, the model's train/eval modes and the
   progress display are back as they were, also when a step raises.

A batch is a tuple or list (positional inputs of ``model``), a dict (keyword inputs)
or a tensor. The model computes its own loss (so that backward can run per
microbatch) and returns it as a scalar tensor, first in a tuple, under ``"loss"``
in a dict, or as ``.loss``.
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from mbcompile import compiler
from mbcompile.compiler import CompiledModule
from mbcompile.errors import ArgumentTypeError, MbcompileError
from mbcompile.training.flags import Callback, Flags
from mbcompile.training.lr_scaling import LRScaling

__all__ = ["Trainer", "TrainerError", "batch_args", "loss_of"]

#: Columns of every logged row, in file order; user metrics follow.
COLUMNS = ("phase", "step", "global_step", "loss", "mbs", "num_microbatches", "samples",
           "time_s", "samples_per_s", "lr")

Metric = Callable[[Any, Any], Any]  # (model output, batch) -> number


class TrainerError(MbcompileError):
    """The training loop cannot go on: no data, no loss in the output, bad arguments."""


def batch_args(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A batch as ``(args, kwargs)`` for ``model(*args, **kwargs)``."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise TrainerError(
        f"a batch must be a tuple or list (positional inputs of the model), a dict (keyword "
        f"inputs) or a tensor, got {type(batch).__name__}")


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a model's output: the output, its first item, ``["loss"]`` or ``.loss``."""
    candidates: list[Any] = [output]
    if isinstance(output, (tuple, list)) and output:
        candidates.append(output[0])
    if isinstance(output, Mapping) and "loss" in output:
        candidates.append(output["loss"])
    if getattr(output, "loss", None) is not None:
        candidates.append(output.loss)
    for c in candidates:
        if isinstance(c, torch.Tensor) and c.dim() == 0 and c.is_floating_point():
            return c
    raise TrainerError(
        f"the model's output ({type(output).__name__}) holds no scalar loss; compute the loss "
        "inside forward (so backward can run per microbatch) and return it as a scalar tensor, "
        "first in a tuple, under 'loss' in a dict, or as .loss")


def _mbs_key(mbs: Any) -> str:
    return json.dumps(mbs, sort_keys=True, default=repr)


def _batches(data: Iterable[Any], limit: int | None, what: str) -> Iterator[Any]:
    """Batches of ``data``; a re-iterable (a list, a DataLoader) is cycled up to ``limit``."""
    count = 0
    while True:
        it = iter(data)
        one_pass = it is data  # an iterator cannot be restarted
        got = False
        for batch in it:
            got = True
            yield batch
            count += 1
            if limit is not None and count >= limit:
                return
        if not got and count == 0:
            raise TrainerError(f"the {what} data yielded no batches")
        if limit is None or one_pass or not got:
            return


def _length(data: Any, limit: int | None) -> int | None:
    if limit is not None:
        return limit
    try:
        return len(data)
    except TypeError:
        return None


def _check_steps(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise TrainerError(f"{name} must be at least 1, got {value}")


class _MetricsLog:
    """Rows to ``metrics.csv`` and ``metrics.jsonl`` under ``folder``, flushed per row."""

    def __init__(self, folder: Path, columns: Sequence[str]) -> None:
        self.folder = folder
        self.columns = list(columns)
        self.csv_path = folder / "metrics.csv"
        self.json_path = folder / "metrics.jsonl"
        self._started = False

    def write(self, row: Mapping[str, Any]) -> None:
        mode = "a" if self._started else "w"
        if not self._started:
            self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.csv_path, mode, newline="") as f:
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            if not self._started:
                writer.writeheader()
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in self.columns})
        with open(self.json_path, mode) as f:
            f.write(json.dumps(dict(row), default=str) + "\n")
        self._started = True


class Trainer:
    """Train and validate ``model`` microbatched over ``num_csx`` simulated systems.

    ``callbacks`` take ``GlobalFlags``, ``ScopedTrainFlags``, ``ScopedValidateFlags``
    (the MBS per phase) and any ``mbcompile.training.flags.Callback``. ``system`` and
    ``backend`` go to ``mbcompile.compile``, as do ``compile_options``. ``metrics``
    maps a name to ``fn(output, batch) -> number``, logged beside the loss.
    ``reference_batch_size`` (with ``lr_scaling`` "linear", "sqrt" or "none", default
    by optimizer, and ``warmup_steps``) scales the learning rate to ``gbs``; see
    ``mbcompile.training.lr_scaling``.
    ``log_dir`` receives ``metrics.csv`` and ``metrics.jsonl`` (one row per step);
    the terminal shows a progress bar and a line every ``log_every`` steps.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, gbs: int,
                 num_csx: int, callbacks: Sequence[Callback] = (), system: Any = None,
                 backend: str | None = None, in_dims: Any = 0,
                 metrics: Mapping[str, Metric] | None = None,
                 log_dir: str | Path | None = None, log_every: int = 1,
                 progress: bool = True, console: Console | None = None,
                 compile_options: Mapping[str, Any] | None = None,
                 reference_batch_size: int | None = None, lr_scaling: str | None = None,
                 warmup_steps: int = 0) -> None:
        if not isinstance(model, nn.Module) or isinstance(model, CompiledModule):
            raise ArgumentTypeError(
                f"model must be the user's torch.nn.Module (the trainer compiles it), got "
                f"{type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "e.g. torch.optim.AdamW(model.parameters(), lr=1e-3)")
        _check_steps("gbs", gbs, allow_none=False)
        _check_steps("num_csx", num_csx, allow_none=False)
        _check_steps("log_every", log_every, allow_none=False)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ArgumentTypeError(
                    f"callbacks must be mbcompile callbacks (GlobalFlags, ScopedTrainFlags, "
                    f"ScopedValidateFlags or a Callback subclass), got {type(cb).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.gbs, self.num_csx = gbs, num_csx
        self.system, self.backend, self.in_dims = system, backend, in_dims
        self.callbacks = list(callbacks)
        self.metrics = dict(metrics or {})
        self.compile_options = dict(compile_options or {})
        self.log_every = log_every
        self.progress = progress
        self.console = console if console is not None else Console(soft_wrap=True)
        self.flags = Flags()
        #: The compiled module of each (phase, MBS); a phase compiles once and reuses it.
        self.compiled: dict[tuple[str, str], CompiledModule] = {}
        self.history: list[dict[str, Any]] = []
        self.global_step = 0
        self.log = _MetricsLog(Path(log_dir), COLUMNS + tuple(self.metrics)) \
            if log_dir is not None else None
        self._live: Progress | None = None
        #: Learning-rate scaling from ``reference_batch_size`` to ``gbs`` (None: rates as given).
        self.lr_scaling: LRScaling | None = None
        if reference_batch_size is not None:
            self.lr_scaling = LRScaling.apply(optimizer, gbs, reference_batch_size, lr_scaling,
                                              warmup_steps)
            self._print(self.lr_scaling.describe(optimizer))
        elif lr_scaling not in (None, "none") or warmup_steps:
            raise TrainerError("lr_scaling and warmup_steps need reference_batch_size: the batch "
                               "size the learning rate was tuned at")
        self._check_options()
        for cb in self.callbacks:
            cb.setup(self)

    # ------------------------------------------------------------- compiling
    def _check_options(self) -> None:
        params = inspect.signature(compiler.compile).parameters
        wanted = dict(self.compile_options)
        if self.backend not in (None, "simulated"):
            wanted["backend"] = self.backend
        missing = [k for k in wanted if k not in params]
        if missing:
            raise TrainerError(
                f"mbcompile.compile in this version has no {', '.join(map(repr, missing))} "
                f"option; remove it (backend 'simulated' is the default and always there)")

    def compile(self, phase: str, batch: Any) -> CompiledModule:
        """The module for ``phase`` ("train" or "validate") at the current flags' MBS.

        Compiled from ``batch`` on the first call for that (phase, MBS), reused after.
        """
        mbs = self.flags.micro_batch_size
        key = (phase, _mbs_key(mbs))
        if key not in self.compiled:
            args, kwargs = batch_args(batch)
            options = dict(self.compile_options)
            if self.system is not None:
                options["system"] = self.system
            if self.backend not in (None, "simulated"):
                options["backend"] = self.backend
            started = time.perf_counter()
            cm = compiler.compile(self.model, self.gbs, self.num_csx, mbs,
                                  example_inputs=args or None, example_kwargs=kwargs or None,
                                  in_dims=self.in_dims, **options)
            self.compiled[key] = cm
            if self.progress:
                p = cm.plan
                self._print(f"{phase}: compiled in {time.perf_counter() - started:.2f} s: "
                            f"gbs {p.gbs} over {p.num_csx} system{'s' if p.num_csx != 1 else ''}, "
                            f"mbs {p.mbs} "
                            f"(requested {p.requested_mbs}), {p.num_microbatches} "
                            f"microbatch{'es' if p.num_microbatches != 1 else ''} per system")
        return self.compiled[key]

    # ----------------------------------------------------------------- phases
    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    @contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        modes = [(m, m.training) for m in self.model.modules()]
        with self.flags.scope():
            try:
                self._call(f"on_{name}_start")
                yield
            finally:
                try:
                    self._call(f"on_{name}_end")
                finally:
                    for m, training in modes:
                        m.training = training

    @contextmanager
    def _task(self, description: str, total: int | None) -> Iterator[Any]:
        if not self.progress:
            yield None
            return
        outer = self._live is None
        if outer:  # one live display for nested phases (validation inside fit)
            self._live = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                                  TimeElapsedColumn(), console=self.console)
            self._live.start()
        live = self._live
        task = live.add_task(description, total=total, loss="-")
        try:
            yield task
        finally:
            if outer:
                live.stop()
                self._live = None
            else:
                live.remove_task(task)

    def _print(self, message: str) -> None:
        console = self._live.console if self._live is not None else self.console
        console.print(message, markup=False, highlight=False)

    # ------------------------------------------------------------------ steps
    def _row(self, phase: str, step: int, cm: CompiledModule, loss: torch.Tensor, output: Any,
             batch: Any, seconds: float) -> dict[str, Any]:
        lr = self.optimizer.param_groups[0].get("lr") if phase == "train" else None
        row: dict[str, Any] = {
            "phase": phase, "step": step, "global_step": self.global_step,
            "loss": float(loss.detach()), "mbs": cm.plan.mbs,
            "num_microbatches": cm.plan.num_microbatches, "samples": cm.plan.gbs,
            "time_s": round(seconds, 6),
            "samples_per_s": round(cm.plan.gbs / seconds, 3) if seconds > 0 else None,
            "lr": float(lr) if isinstance(lr, (int, float)) else None,
        }
        for name, fn in self.metrics.items():
            value = fn(output, batch)
            row[name] = float(value.detach()) if isinstance(value, torch.Tensor) else value
        return row

    def _record(self, row: dict[str, Any], task: Any, total: int | None) -> None:
        self.history.append(row)
        if self.log is not None:
            self.log.write(row)
        if task is not None:
            self._live.update(task, advance=1, loss=f"{row['loss']:.4f}")
            if row["step"] % self.log_every == 0 or row["step"] == total:
                extra = "".join(f" {k} {row[k]:.4g}" if isinstance(row[k], float) else
                                f" {k} {row[k]}" for k in self.metrics)
                of = f"/{total}" if total else ""
                self._print(f"{row['phase']} step {row['step']}{of}: loss {row['loss']:.4f}"
                            f"{extra}  mbs {row['mbs']}  {row['samples_per_s'] or 0:.0f} "
                            "samples/s")

    def _local(self, batch: Any, cm: CompiledModule) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments: the whole batch, or this rank's share of it."""
        if self.backend == "torch.distributed":
            import torch.distributed as dist

            from mbcompile.execution.distributed import shard

            if not isinstance(self.in_dims, int):
                raise TrainerError("the torch.distributed backend in the Trainer shards "
                                   "batches along one dim: give in_dims as an int")
            batch = shard(batch, cm.plan, dist.get_rank(), self.in_dims)
        return batch_args(batch)

    def _train_step(self, step: int, batch: Any, task: Any, total: int | None) -> dict[str, Any]:
        cm = self.compile("train", batch)
        args, kwargs = self._local(batch, cm)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        output = cm(*args, **kwargs)
        loss = loss_of(output)
        if not math.isfinite(float(loss.detach())):
            raise TrainerError(f"train step {step}: the loss is {float(loss)}; the step was not "
                               "applied (parameters and optimizer state are unchanged)")
        loss.backward()
        if self.lr_scaling is not None:  # the warmup ramp, then the scaled rate
            self.lr_scaling.set_step(self.optimizer, self.global_step)
        self.optimizer.step()
        seconds = time.perf_counter() - started
        self.global_step += 1
        row = self._row("train", step, cm, loss, output, batch, seconds)
        self._record(row, task, total)
        self._call("on_train_step_end", row)
        return row

    # ------------------------------------------------------------- public API
    def fit(self, train_data: Iterable[Any], val_data: Iterable[Any] | None = None, *,
            max_steps: int | None = None, val_steps: int | None = None,
            val_every: int | None = None) -> list[dict[str, Any]]:
        """Train for ``max_steps`` steps (default: one pass over ``train_data``).

        With ``val_data``, validates every ``val_every`` steps (if given) and at the
        end, ``val_steps`` batches each time (default: all). Returns this fit's rows.
        """
        for name, value in (("max_steps", max_steps), ("val_steps", val_steps),
                            ("val_every", val_every)):
            _check_steps(name, value)
        start = len(self.history)
        total = _length(train_data, max_steps)
        self._call("on_fit_start")
        try:
            with self._task("train", total) as task, self._phase("train"):
                self.model.train()
                step = 0
                for step, batch in enumerate(_batches(train_data, max_steps, "training"), 1):
                    self._train_step(step, batch, task, total)
                    if val_data is not None and val_every and step % val_every == 0 \
                            and step != total:
                        self.validate(val_data, max_steps=val_steps)
                        self.model.train()
                if max_steps is not None and step < max_steps and self.progress:
                    self._print(f"train: the data ran out after {step} of {max_steps} steps "
                                "(an iterator is read once; pass a list or a DataLoader to "
                                "cycle over it)")
            if val_data is not None:
                self.validate(val_data, max_steps=val_steps)
        finally:
            self._call("on_fit_end")
        return self.history[start:]

    def validate(self, val_data: Iterable[Any], *, max_steps: int | None = None
                 ) -> dict[str, Any]:
        """Run the model in eval mode over ``val_data``; returns the mean loss and metrics."""
        _check_steps("max_steps", max_steps)
        start = len(self.history)
        total = _length(val_data, max_steps)
        with self._task("validate", total) as task, self._phase("validate"), torch.no_grad():
            self.model.eval()
            for step, batch in enumerate(_batches(val_data, max_steps, "validation"), 1):
                cm = self.compile("validate", batch)
                args, kwargs = self._local(batch, cm)
                started = time.perf_counter()
                output = cm(*args, **kwargs)
                loss = loss_of(output)
                row = self._row("validate", step, cm, loss, output, batch,
                                time.perf_counter() - started)
                self._record(row, task, total)
                self._call("on_validate_step_end", row)
        rows = self.history[start:]
        summary: dict[str, Any] = {"steps": len(rows), "mbs": rows[-1]["mbs"]}
        for key in ("loss", *self.metrics):
            values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
            summary[key] = sum(values) / len(values) if values else None
        if self.progress:
            self._print(f"validate: mean loss {summary['loss']:.4f} over {len(rows)} steps "
                        f"(mbs {summary['mbs']})")
        return summary

    def __repr__(self) -> str:
        return (f"Trainer({type(self.model).__name__}, gbs={self.gbs}, num_csx={self.num_csx}, "
                f"flags={self.flags.snapshot()}, global_step={self.global_step})")

