"""``mbcompile fit`` and ``mbcompile validate``: a config's run through the Trainer.

``fit`` trains in this process, on ``--nproc N`` CPU ranks it launches, or on the
ranks a launcher started (torchrun, ``accelerate launch``: ``RANK`` and ``WORLD_SIZE``
in the environment), which it joins and never launches again. Rank 0 alone writes the
metrics; the checkpoints, one set, go to ``<output_dir>/checkpoints/`` (on ranks each
writes its part of it). When stopped, it says what it kept and the command that
resumes it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from mbcompile.errors import InputError
from mbcompile.execution.world import (
    join_launcher_group,
    launcher_world_size,
    leave_launcher_group,
    resolve_backend,
    under_launcher,
)
from mbcompile.planning.plan import parse_mbs
from mbcompile.training.checkpoint import (
    CheckpointError,
    TrainingInterrupted,
    latest_checkpoint,
)
from mbcompile.training.cli.compile import compile_config
from mbcompile.training.cli.messages import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    CommandError,
    add_note,
    echo,
    paragraph,
)
from mbcompile.training.config import Config, build_data, build_trainer, load_config

__all__ = ["run_fit", "run_validate"]


def run_fit(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    out = Path(args.out or cfg.output_dir)
    if cfg.compile_only or cfg.validate_only:
        echo(f"{cfg.file} sets {'compile_only' if cfg.compile_only else 'validate_only'}: "
             "compiling only, no training")
        return compile_config(cfg, out, mbs=args.mbs, compile_only=cfg.compile_only,
                              validate_only=cfg.validate_only)
    _refuse_explore(cfg, args.mbs, ("train", "validate"))
    if getattr(args, "nproc", None):
        if under_launcher():
            raise CommandError(
                f"--nproc {args.nproc} launches ranks, but this process is already rank "
                f"{os.environ.get('RANK', '?')} of {launcher_world_size()} that a launcher "
                "started (RANK and WORLD_SIZE are set, by torchrun or accelerate launch): "
                "drop --nproc, and the launcher's ranks run the systems, one each")
        if cfg.backend == "simulated":
            raise cfg.error(("backend",), f"--nproc {args.nproc} launches ranks, one per "
                            "system, but backend: simulated runs every system in each rank, "
                            "so each would train its own model: set backend: auto (or remove "
                            "the key), or drop --nproc")
        if args.nproc != cfg.num_csx:
            raise CommandError(f"--nproc {args.nproc} launches one rank per system, but "
                               f"{cfg.file} has num_csx {cfg.num_csx}: make them equal")
        return _launch_ranks(args, out)
    if cfg.backend == "torch.distributed" or launcher_world_size() > 1:
        _init_from_environment(cfg)
    code = _fit(cfg, args, out, _rank())
    leave_launcher_group()  # only after a run every rank finished: a barrier
    return code


def _refuse_explore(cfg: Config, mbs: Any, phases: tuple[str, ...]) -> None:
    """``mbs=explore`` compares MBS values and pins none: it plans, it cannot run a step.
    Say so before building anything, with the command that explores."""
    for phase in phases:
        value = cfg.flags(phase)["micro_batch_size"] if mbs is None else mbs
        if parse_mbs(value).mode == "explore":
            where = "--mbs" if mbs is not None else f"{cfg.file}'s {phase} micro_batch_size"
            if isinstance(value, dict):  # {explore: {min, max}}: as --mbs spells it
                bounds = value["explore"] or {}
                value = f"explore:{bounds.get('min', '')}:{bounds.get('max', '')}"
            flag = " --phase validate" if phase == "validate" else ""
            raise CommandError(
                f"{where} is {value}: exploring compares MBS values and pins none, so it "
                f"plans only and cannot run a step. Explore with `mbcompile compile "
                f"{cfg.file} --mbs {value} --compile-only{flag}` (plan.txt and explore.png "
                "say which MBS is best), then run with --mbs <that value>")


def _launch_ranks(args: argparse.Namespace, out: Path) -> int:
    """``fit --nproc N``: N ranks in child processes; this process forwards SIGINT and
    SIGTERM to them (they stop after an agreed step with a checkpoint) and waits."""
    import multiprocessing

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from mbcompile.execution.launcher import launch

    def forward(signum: int, frame: Any) -> None:
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError, TypeError):  # gone already
                os.kill(child.pid, signum)

    echo(f"launching {args.nproc} CPU ranks (gloo on 127.0.0.1), one per system")
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch(_fit_rank, args.nproc, args)
    except (ProcessExitedException, ProcessRaisedException) as exc:
        code = getattr(exc, "exit_code", None)
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            return int(code)  # the ranks stopped cleanly; rank 0 said where and how to resume
        if code == EXIT_FAILURE and isinstance(exc, ProcessExitedException):
            return EXIT_FAILURE  # every rank refused the checkpoint; rank 0 said why
        add_note(exc, _checkpoint_note(out, args))
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return EXIT_OK  # every rank finished, whatever signal came after the last step


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _init_from_environment(cfg: Config) -> None:
    """Join the process group the launcher describes in the environment, if not joined
    yet, and check that the config runs on it: one system per rank."""
    if not under_launcher():
        what = f"shard: {cfg.shard}" if cfg.shard != "none" else "backend torch.distributed"
        raise CommandError(f"{what} needs ranks: run with --nproc {cfg.num_csx}, or launch "
                           f"with torchrun --nproc-per-node {cfg.num_csx} -m mbcompile "
                           "fit ...")
    try:  # before joining and building anything: the error names the config's line
        resolve_backend(cfg.backend, cfg.num_csx, launcher_world_size())
    except InputError as exc:
        raise cfg.error(("backend",) if cfg.backend == "simulated" else ("num_csx",),
                        str(exc)) from None
    join_launcher_group()


def _fit_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank of ``fit --nproc``: the config's run on the torch.distributed backend.

    A stop by SIGINT/SIGTERM ends the rank with exit code 130/143 once rank 0 has
    said where the checkpoint is (the launcher passes the code on).
    """
    import torch.distributed as dist

    cfg = load_config(args.config)  # backend auto or torch.distributed: this rank's group
    try:
        _fit(cfg, args, Path(args.out or cfg.output_dir), rank)
    except CheckpointError as exc:  # every rank refuses the same checkpoint: rank 0 says why
        if rank == 0:
            sys.stdout.flush()
            print(paragraph(exc), file=sys.stderr, flush=True)
        dist.barrier()  # before the launcher reaps the ranks
        raise SystemExit(EXIT_FAILURE) from None
    except KeyboardInterrupt as exc:  # a non-zero exit: the launcher stops the other ranks
        if rank == 0:
            sys.stdout.flush()
            print(paragraph(exc), file=sys.stderr, flush=True)
        if isinstance(exc, TrainingInterrupted) and exc.checkpoint is not None:
            dist.barrier()  # every rank waits for rank 0's message before the launcher reaps
        code = exc.exit_code if isinstance(exc, TrainingInterrupted) else EXIT_INTERRUPTED
        raise SystemExit(code) from None


def _fit(cfg: Config, args: argparse.Namespace, out: Path, rank: int = 0) -> int:
    """Train as ``cfg`` says: rank 0 writes the metrics to ``out`` (every rank logs the
    same global loss, so the others write none); the checkpoints, one set that every
    rank writes its part of, go to ``out/checkpoints``."""
    quiet = bool(rank)
    say = (lambda *_: None) if quiet else echo
    log_dir = out
    trainer = build_trainer(cfg, mbs=args.mbs, log_dir=str(log_dir), write_metrics=not rank,
                            progress=not quiet,
                            console=Console(soft_wrap=True, quiet=quiet),
                            checkpoint_dir=out / "checkpoints")
    train = build_data(cfg, "train")
    val = build_data(cfg, "validate") if cfg.val_steps else None
    steps = args.max_steps or cfg.max_steps
    sharded = f"sharded with FSDP2 (shard: {cfg.shard}), " if cfg.shard != "none" else ""
    say(f"fit: {cfg.model}, gbs {cfg.batch_size} over {cfg.num_csx} "
        f"system{'s' if cfg.num_csx != 1 else ''}, {steps} steps, {sharded}"
        f"flags: train {cfg.flags('train')}, validate {cfg.flags('validate')}")
    try:
        rows = trainer.fit(train, val, max_steps=steps, val_steps=cfg.val_steps or None,
                           val_every=cfg.val_every, resume=bool(getattr(args, "resume", False)))
    except CheckpointError as exc:  # refused before any step: running it again cannot help
        add_note(exc, f"nothing was trained; {out / 'checkpoints'} is unchanged")
        raise
    except (Exception, KeyboardInterrupt) as exc:
        note = _kept(trainer.global_step, log_dir)
        if isinstance(exc, TrainingInterrupted) and exc.checkpoint is not None:
            note += (f"; checkpoint of step {exc.step}: {exc.checkpoint}; resume with: "
                     f"{_resume_command(args)}")
        elif trainer.last_checkpoint is not None:
            note += f"; {_checkpoint_note(out, args)}"
        add_note(exc, note)
        raise
    train_rows = [r for r in rows if r["phase"] == "train"]
    val_rows = [r for r in rows if r["phase"] == "validate"]
    if val_rows:  # the last validation: the rows from its step 1 on
        last = val_rows[max(i for i, r in enumerate(val_rows) if r["step"] == 1):]
        mean = sum(r["loss"] for r in last) / len(last)
        validated = (f"; last validation: mean loss {mean:.4f} over {len(last)} "
                     f"step{'s' if len(last) != 1 else ''}")
    if train_rows:
        say(f"trained {len(train_rows)} steps: loss {train_rows[0]['loss']:.4f} -> "
            f"{train_rows[-1]['loss']:.4f}" + (validated if val_rows else ""))
    say(f"metrics: {log_dir / 'metrics.csv'} and {log_dir / 'metrics.jsonl'}")
    if trainer.last_checkpoint is not None:
        say(f"checkpoint: {trainer.last_checkpoint}")
    return EXIT_OK


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that resumes this one."""
    argv = [a for a in getattr(args, "argv", None) or sys.argv[1:] if a != "--resume"]
    return shlex.join(["mbcompile", *argv, "--resume"])


def _checkpoint_note(out: Path, args: argparse.Namespace) -> str:
    last = latest_checkpoint(out / "checkpoints")
    if last is None:
        return "no checkpoint was written"
    return f"the last checkpoint is {last}; resume with: {_resume_command(args)}"


def _kept(done: int, out: Path) -> str:
    """What a fit stopped after ``done`` training steps leaves behind."""
    if not done:
        return "no training step finished"
    return (f"the metrics of the {done} finished training step{'s' if done != 1 else ''} "
            f"are in {out / 'metrics.csv'}")


def run_validate(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    out = Path(args.out or cfg.output_dir)
    _refuse_explore(cfg, args.mbs, ("validate",))
    if launcher_world_size() > 1:  # a launcher's ranks: validate on them
        _init_from_environment(cfg)
    rank = _rank()  # on ranks, rank 0 alone prints and writes the metrics
    # its own metrics files: a fit's in ``out`` (and its resume) are left as they are
    trainer = build_trainer(cfg, mbs=args.mbs, log_dir=str(out / "validate"),
                            checkpoint_dir=out / "checkpoints", write_metrics=not rank,
                            progress=not rank,
                            console=Console(soft_wrap=True, quiet=bool(rank)))
    ck = trainer.load_weights()  # what a fit into ``out`` trained, if it saved any
    if not rank:
        echo(f"validating the weights of {ck.path}" if ck is not None else
             f"no checkpoint in {out / 'checkpoints'}: validating the model as the config "
             "builds it")
    steps = args.steps or cfg.val_steps or None
    summary = trainer.validate(build_data(cfg, "validate"), max_steps=steps)
    if summary["loss"] is None or not math.isfinite(summary["loss"]):
        raise CommandError(f"validation loss is {summary['loss']}")
    if not rank:
        echo(f"validated {summary['steps']} steps: mean loss {summary['loss']:.4f} "
             f"(mbs {summary['mbs']}); metrics: {out / 'validate' / 'metrics.csv'}")
    leave_launcher_group()
    return EXIT_OK
