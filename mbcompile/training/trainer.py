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
   ``model.eval()`` and ``torch.no_grad()``, at the validation MBS: on the train
   phase's module when the MBS is the same pinned value (``Trainer.compile``), else
   compiled once for the phase;
4. closes each phase in a ``finally``: flags, the model's train/eval modes and the
   progress display are back as they were, also when a step raises;
5. with a checkpoint folder (``checkpoint_dir=``, or ``log_dir`` with
   ``checkpoint_every=``), writes a checkpoint every ``checkpoint_every`` steps and
   at the end; SIGINT and SIGTERM let the current step finish, write one and raise
   ``TrainingInterrupted``; ``fit(..., resume=True)`` continues from the newest good
   one exactly (see ``mbcompile.training.checkpoint``), also on another ``num_csx``
   or number of ranks at the same ``gbs`` (``mbcompile.training.elastic``).

The pieces it runs on have a file each: the batch forms and the loss in an output
(``batches``), the position in the data (``data_cursor``), the logged rows
(``metrics``), the rows kept and shown (``progress``), FSDP2 sharding (``sharding``),
checkpoints (``trainer_checkpoints``, on ``checkpoint``, ``rng``, ``signals``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from rich.console import Console
from rich.progress import Progress

import mbcompile.compiler as compiler
from mbcompile.compiler import CompiledModule
from mbcompile.errors import ArgumentTypeError
from mbcompile.execution.noise import NoiseScale
from mbcompile.execution.world import resolve_backend
from mbcompile.integrations.transformers import called_plainly
from mbcompile.training.batches import (
    TrainerError,
    batch_args,
    batch_layout,
    same_layout,
)
from mbcompile.training.checkpoint import CheckpointError, CheckpointStore, TrainingInterrupted
from mbcompile.training.data_cursor import DataCursor, batches, length
from mbcompile.training.flags import Callback, Flags
from mbcompile.training.lr_scaling import LRScaling
from mbcompile.training.metrics import COLUMNS, Metric, MetricsLog, make_row
from mbcompile.training.phase_modes import compiled_for_phase, step_autocast
from mbcompile.training.progress import ProgressMixin
from mbcompile.training.rng import broadcast_rng_state, preserved_rng
from mbcompile.training.sharding import is_fsdp, shard_for_training, shard_model
from mbcompile.training.signals import StopSignals, describe_signal
from mbcompile.training.trainer_checkpoints import CheckpointingMixin

__all__ = ["COMPILE_OPTIONS", "CheckpointError", "Trainer", "TrainerError",
           "TrainingInterrupted", "batch_args", "shard_model"]

#: The options of ``mbcompile.compile`` that ``Trainer(compile_options=...)`` may set: all
#: but those the Trainer passes itself (the MBS from its flags, gbs and num_csx, and the
#: example call and ``in_dims`` from each phase's first batch). ``system`` and ``backend``
#: are the Trainer's own arguments as well; given there, they win.
COMPILE_OPTIONS = ("system", "backend", "measure_noise_scale", "capture", "batch_norm",
                   "coupling", "outputs", "torch_compile", "recompute", "reshard_after_forward",
                   "gradient_sync", "nonfinite", "compile_only", "validate_only", "measure",
                   "cost_model", "batch_sizes", "dynamic", "optimizer", "precision")


def _mbs_key(mbs: Any) -> str:
    return json.dumps(mbs, sort_keys=True, default=repr)


def _check_steps(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise TrainerError(f"{name} must be at least 1, got {value}")


class Trainer(CheckpointingMixin, ProgressMixin):
    """Train and validate ``model`` microbatched over ``num_csx`` systems: simulated in
    this process, or one per rank under a launcher's process group (``backend="auto"``,
    see ``mbcompile.execution.world``).

    ``callbacks`` take ``GlobalFlags``, ``ScopedTrainFlags``, ``ScopedValidateFlags``
    (the MBS per phase) and any ``mbcompile.training.flags.Callback``. ``system`` and
    ``backend`` go to ``mbcompile.compile``, as do ``compile_options``. ``metrics``
    maps a name to ``fn(output, batch) -> number``, logged beside the loss.
    ``reference_batch_size`` (with ``lr_scaling`` "linear", "sqrt" or "none", default
    by optimizer, and ``warmup_steps``) scales the learning rate to ``gbs``; see
    ``mbcompile.training.lr_scaling``.
    ``log_dir`` receives ``metrics.csv`` and ``metrics.jsonl`` (one row per step);
    the terminal shows a progress bar and a line every ``log_every`` steps.

    Checkpoints (``mbcompile.training.checkpoint``) go to ``checkpoint_dir`` (default
    ``log_dir/checkpoints`` when ``checkpoint_every`` is given): one every
    ``checkpoint_every`` steps, one at the end of ``fit``, and one when SIGINT or
    SIGTERM stops it; the newest ``keep_checkpoints`` are kept. ``config`` (plain
    JSON-able values, the YAML's for the CLI) is stored in each.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, gbs: int,
                 num_csx: int, callbacks: Sequence[Callback] = (), system: Any = None,
                 backend: str = "auto", in_dims: Any = 0,
                 metrics: Mapping[str, Metric] | None = None,
                 log_dir: str | Path | None = None, log_every: int = 1,
                 progress: bool = True, console: Console | None = None,
                 compile_options: Mapping[str, Any] | None = None,
                 reference_batch_size: int | None = None, lr_scaling: str | None = None,
                 warmup_steps: int = 0, checkpoint_dir: str | Path | None = None,
                 checkpoint_every: int | None = None, keep_checkpoints: int = 2,
                 config: Mapping[str, Any] | None = None, shard: str | None = None) -> None:
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
        _check_steps("checkpoint_every", checkpoint_every)
        _check_steps("keep_checkpoints", keep_checkpoints, allow_none=False)
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise ArgumentTypeError(
                    f"callbacks must be mbcompile callbacks (GlobalFlags, ScopedTrainFlags, "
                    f"ScopedValidateFlags or a Callback subclass), got {type(cb).__name__}")
        if backend == "auto":  # a backend in compile_options counts as the Trainer's own
            backend = dict(compile_options or {}).get("backend", backend)
        # resolved once: the compiles, the batch shards and the checkpoints follow it
        backend = resolve_backend(backend, num_csx)
        shard_for_training(model, optimizer, shard, backend, num_csx)
        self.model = model
        self.optimizer = optimizer
        #: The model is sharded with FSDP2: checkpoints hold shards (DCP state dicts).
        self.sharded = is_fsdp(model)
        self.gbs, self.num_csx = gbs, num_csx
        self.system, self.backend, self.in_dims = system, backend, in_dims
        self.callbacks = list(callbacks)
        self.metrics = dict(metrics or {})
        self.compile_options = dict(compile_options or {})
        self._autocast = step_autocast(model, self.compile_options)  # (precision:)
        self.log_every = log_every
        self.progress = progress
        self.console = console if console is not None else Console(soft_wrap=True)
        self.flags = Flags()
        #: The compiled module of each (phase, requested MBS as JSON text: ``("train", "2")``,
        #: ``("validate", '"auto"')``); a phase compiles once and reuses it.
        self.compiled: dict[tuple[str, str], CompiledModule] = {}
        self._layouts: dict[tuple[str, str], Any] = {}  # the layout each one was compiled for
        self.history: list[dict[str, Any]] = []
        self.global_step = 0
        self.log = MetricsLog(Path(log_dir), COLUMNS + tuple(self.metrics)) \
            if log_dir is not None else None
        self._live: Progress | None = None
        if checkpoint_dir is None and checkpoint_every is not None:
            if log_dir is None:
                raise TrainerError("checkpoint_every needs a folder for the checkpoints: give "
                                   "checkpoint_dir= (or log_dir=, whose checkpoints/ it uses)")
            checkpoint_dir = Path(log_dir) / "checkpoints"
        #: Where checkpoints go (None: no checkpoints).
        self.checkpoints = CheckpointStore(checkpoint_dir, keep_checkpoints) \
            if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.config = dict(config) if config is not None else None
        #: The newest checkpoint this trainer wrote or resumed from.
        self.last_checkpoint: Path | None = None
        self._group: Any = None  # ranks: the CPU group for stop requests and checkpoints
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
        if self.compile_options.get("measure_noise_scale") is True:
            # an object of ours, so that checkpoints hold its averages
            self.compile_options["measure_noise_scale"] = NoiseScale()
        for cb in self.callbacks:
            cb.setup(self)

    # ------------------------------------------------------------- compiling
    def _check_options(self) -> None:
        unknown = [k for k in self.compile_options if k not in COMPILE_OPTIONS]
        if unknown:
            raise TrainerError(
                f"compile_options has no {', '.join(map(repr, unknown))} option; the options "
                f"are {', '.join(COMPILE_OPTIONS)} (the Trainer passes the MBS, the example "
                "batch and in_dims itself)")

    def _options(self) -> dict[str, Any]:
        """The keyword options of every compile: the same for both phases, since
        ``outputs`` acts only in training mode (in eval mode every output is returned)."""
        options = dict(self.compile_options)
        # a training step returns only the loss unless a metric reads the outputs: the
        # logits are then never kept per microbatch (and auto sees the larger MBS)
        options.setdefault("outputs", "all" if self.metrics else "loss")
        # the plan holds the state of the optimizer that trains (a name given in
        # compile_options, e.g. "adamw-mixed", says what the instance cannot: master weights)
        options.setdefault("optimizer", self.optimizer)
        # this loop never applies a non-finite step: the step says which microbatch it was
        options.setdefault("nonfinite", "raise")
        if self.system is not None:
            options["system"] = self.system
        options["backend"] = self.backend
        return options

    def compile(self, phase: str, batch: Any) -> CompiledModule:
        """The module for ``phase`` ("train" or "validate") at the current flags' MBS.

        Compiled from ``batch`` on the first call for that (phase, MBS), reused after.
        Validation runs on the module the train phase compiled at the same MBS flag when
        the batch is laid out like its example: the module compiles its eval-mode graph
        itself, once, on the first call in eval mode, on the training plan (an MBS checked
        for a training step fits a forward); else it compiles its own, also planned as a
        training step (``phase_modes.compiled_for_phase``)."""
        mbs = self.flags.micro_batch_size
        key = (phase, _mbs_key(mbs))
        if key in self.compiled:
            return self.compiled[key]
        layout = batch_layout(batch)
        trained = self.compiled.get(("train", key[1]))
        if (phase == "validate" and trained is not None
                and same_layout(self._layouts.get(("train", key[1])), layout)):
            self.compiled[key] = trained
            if self.progress:
                self._print(f"{phase}: runs the train phase's module (mbs {trained.plan.mbs}) in "
                            "eval mode")
            return trained
        args, kwargs = batch_args(batch)
        started = time.perf_counter()
        # the example's own call: this loop never passes transformers' Trainer keywords;
        # the RNG kept: a resumed run compiles at another step
        with preserved_rng(), called_plainly():
            cm = compiled_for_phase(self.model, phase == "validate", lambda: compiler.compile(
                self.model, self.gbs, self.num_csx, mbs, example_inputs=args or None,
                example_kwargs=kwargs or None, in_dims=self.in_dims, **self._options()))
        self.compiled[key], self._layouts[key] = cm, layout
        if self.progress:
            p = cm.plan
            self._print(f"{phase}: compiled in {time.perf_counter() - started:.2f} s: "
                        f"gbs {p.gbs} over {p.num_csx} system{'s' if p.num_csx != 1 else ''}, "
                        f"mbs {p.mbs} (requested {p.requested_mbs}), {p.num_microbatches} "
                        f"microbatch{'es' if p.num_microbatches != 1 else ''} per system")
        return cm

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

    # ------------------------------------------------------------------ steps
    def _row(self, phase: str, step: int, cm: CompiledModule, loss: torch.Tensor, output: Any,
             batch: Any, seconds: float) -> dict[str, Any]:
        lr = self.optimizer.param_groups[0].get("lr") if phase == "train" else None
        return make_row(phase, step, self.global_step, cm.plan, loss, seconds, lr, self.metrics,
                        output, batch)

    def _local(self, batch: Any, cm: CompiledModule
               ) -> tuple[CompiledModule, tuple[Any, ...], dict[str, Any]]:
        """The module that runs ``batch`` and the call's arguments: the whole batch, or on
        ranks this rank's share of it, cut by the plan for its size (a short last batch
        runs a variant planned for its size over the ranks: ``for_global_batch``)."""
        if self.backend != "torch.distributed":
            return (cm, *batch_args(batch))
        import torch.distributed as dist

        from mbcompile.execution.rank_shares import shard
        from mbcompile.variants import for_global_batch

        if not isinstance(self.in_dims, int):
            raise TrainerError("the torch.distributed backend in the Trainer shards "
                               "batches along one dim: give in_dims as an int")
        runs = for_global_batch(cm, *batch_args(batch))
        return (runs, *batch_args(shard(batch, runs.plan, dist.get_rank(), self.in_dims)))

    def _train_step(self, step: int, batch: Any, task: Any, total: int | None) -> dict[str, Any]:
        cm = self.compile("train", batch)
        runs, args, kwargs = self._local(batch, cm)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self._autocast():
            output = runs(*args, **kwargs)
        loss = runs.loss_of(output)  # the analysis's rule: the leaf the step trains
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
            val_every: int | None = None, resume: bool = False) -> list[dict[str, Any]]:
        """Train for ``max_steps`` steps (default: one pass over ``train_data``).

        With ``val_data``, validates every ``val_every`` steps (if given) and at the
        end, ``val_steps`` batches each time (default: all). Returns this fit's rows.
        ``resume=True`` continues from the newest good checkpoint (from step 0 if there
        is none): the same data must be passed, and every later step equals the
        uninterrupted run's.
        """
        for name, value in (("max_steps", max_steps), ("val_steps", val_steps),
                            ("val_every", val_every)):
            _check_steps(name, value)
        if resume and self.checkpoints is None:
            raise TrainerError("resume=True needs the checkpoints' folder: give the Trainer "
                               "checkpoint_dir= (or log_dir= and checkpoint_every=)")
        group = self._control_group()
        start = len(self.history)
        # ranks: each pass starts from rank 0's RNG states, so every rank shuffles alike
        sync = (lambda: broadcast_rng_state(group)) if group is not None else None
        cursor = DataCursor(train_data, max_steps, "training", sync=sync)
        step, saved, saved_step = 0, None, None
        if not resume and self.checkpoints is not None and self.last_checkpoint is None:
            self.checkpoints.start_over()  # an earlier run's checkpoints would outrank ours
        if resume:
            ck = self._restore(cursor)
            if ck is not None:
                step = saved_step = int(ck.trainer["step"])
                saved = ck.path
                first = int(ck.trainer.get("fit_first_row", 0))
                start = first if len(self.history) == ck.trainer["metrics_rows"] else \
                    len(self.history)
        total = length(train_data, max_steps)
        self._call("on_fit_start")
        try:
            with StopSignals(group) as signals:
                with self._task("train", total, step) as task, self._phase("train"):
                    self.model.train()
                    for batch in cursor:
                        step += 1
                        self._train_step(step, batch, task, total)
                        if val_data is not None and val_every and step % val_every == 0 \
                                and step != total:
                            self.validate(val_data, max_steps=val_steps)
                            self.model.train()
                        stop = signals.agreed()
                        due = self.checkpoint_every and step % self.checkpoint_every == 0
                        if self.checkpoints is not None and (stop or due):
                            why = describe_signal(stop) if stop else \
                                f"every {self.checkpoint_every} steps"
                            saved, saved_step = self._save(step, cursor, start, why), step
                        if stop:
                            raise self._interrupted(stop, step, saved)
                    if max_steps is not None and step < max_steps and self.progress:
                        self._print(f"train: the data ran out after {step} of {max_steps} "
                                    "steps (an iterator is read once; pass a list or a "
                                    "DataLoader to cycle over it)")
                    stop = signals.agreed(final=True)
                    if self.checkpoints is not None and saved_step != step:
                        why = describe_signal(stop) if stop else "end of training"
                        saved, saved_step = self._save(step, cursor, start, why), step
                    if stop:
                        raise self._interrupted(stop, step, saved)
                if val_data is not None:
                    self.validate(val_data, max_steps=val_steps)
                stop = signals.agreed(final=True)
                if stop:  # the run is complete: its last checkpoint is the one to point at
                    raise self._interrupted(stop, step, saved)
        finally:
            self._call("on_fit_end")
        return self.history[start:]

    def validate(self, val_data: Iterable[Any], *, max_steps: int | None = None
                 ) -> dict[str, Any]:
        """Run the model in eval mode over ``val_data``, RNGs untouched: mean loss, metrics."""
        _check_steps("max_steps", max_steps)
        start = len(self.history)
        total = length(val_data, max_steps)
        with self._task("validate", total) as task, self._phase("validate"), torch.no_grad(), \
                preserved_rng():
            self.model.eval()
            for step, batch in enumerate(batches(val_data, max_steps, "validation"), 1):
                cm = self.compile("validate", batch)
                runs, args, kwargs = self._local(batch, cm)
                started = time.perf_counter()
                with self._autocast():
                    output = runs(*args, **kwargs)
                loss = runs.loss_of(output)
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

