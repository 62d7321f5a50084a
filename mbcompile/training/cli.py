"""The ``mbcompile`` command (also ``python -m mbcompile``).

    mbcompile demo                                   # a tiny GPT, no files needed
    mbcompile fit CONFIG.yaml [--max-steps N]        # train (and validate) as configured
    mbcompile fit CONFIG.yaml --resume               # continue from the newest good checkpoint
    mbcompile validate CONFIG.yaml [--steps N]       # run the validation phase only
    mbcompile compile CONFIG.yaml [--compile-only | --validate-only] [--mbs VALUE]

``compile`` writes an artifacts folder (``output_dir``, or ``--out``): ``plan.txt``
and ``plan.json``, the rewritten graph's code (``graph.py``) and the original's
(``original_graph.py``), the graph as ``graph.dot`` and ``graph.svg`` (no Graphviz
needed; see ``mbcompile.reports.draw``), and ``explore.png`` when exploring MBS values. A
model the analysis rejects gets ``rejected.dot`` and ``rejected.svg`` with the mixing
op highlighted.

``fit`` writes checkpoints to ``<output_dir>/checkpoints/`` (every
``fit.checkpoint_every`` steps, at the end, and on SIGINT/SIGTERM); see
``mbcompile.training.checkpoint``.

Exit codes: 0 success, 1 failure (one paragraph on stderr; ``--debug`` adds the
traceback), 2 usage error, 130 interrupted (Ctrl-C, SIGINT), 143 terminated
(SIGTERM); a ``fit`` stopped by either finishes its step and writes a checkpoint
first. On stderr the error comes first, then the warnings the command raised
(each message once), so the first line says what went wrong; ``--debug`` shows
warnings as they happen instead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import math
import os
import shlex
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from mbcompile import compiler
from mbcompile.check import relative_error
from mbcompile.errors import MbcompileError, MixingError
from mbcompile.planning.plan import parse_mbs
from mbcompile.training.checkpoint import TrainingInterrupted, latest_checkpoint
from mbcompile.training.config import Config, build_data, build_model, build_trainer, load_config
from mbcompile.training.flags import GlobalFlags

__all__ = ["main"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

#: The demo's max relative difference above which it fails (float32 rounding is ~1e-7).
DEMO_TOLERANCE = 1e-4


class CommandError(MbcompileError):
    """A command that cannot do what was asked (reported as one paragraph, exit code 1)."""


def _out(message: str = "") -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------- #
# Arguments
# --------------------------------------------------------------------------- #


def mbs_argument(text: str) -> Any:
    """``--mbs``: an int, ``auto``, ``none``, ``explore`` or ``explore:MIN:MAX``."""
    value: Any = text
    if text.lstrip("-").isdigit():
        value = int(text)
    elif text.startswith("explore:"):
        parts = text.split(":")[1:]
        if len(parts) != 2 or not all(p == "" or p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(
                f"{text!r}: write an explore range as explore:MIN:MAX (either may be empty)")
        bounds = {k: int(p) for k, p in zip(("min", "max"), parts) if p}
        value = {"explore": bounds}
    try:
        parse_mbs(value)
    except MbcompileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int >= 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback when something fails")
    parser = argparse.ArgumentParser(
        prog="mbcompile", parents=[common],
        description="Automatic microbatching for PyTorch: compile a model into a microbatch "
                    "loop over simulated systems, train and validate it from a YAML config.",
        epilog="Start with `mbcompile demo`; `mbcompile COMMAND --help` describes each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo", parents=[common], help="compile and train a tiny GPT; no files needed",
        description="Compile a small GPT (mbcompile.models.TinyGPT) on synthetic padded "
                    "tokens over simulated systems, print the plan and the rewritten graph, "
                    "check one step against an eager full-batch step, and train a few steps.")
    demo.add_argument("--steps", type=_positive, default=5, help="training steps (default 5)")
    demo.add_argument("--gbs", type=_positive, default=16, help="global batch size (default 16)")
    demo.add_argument("--num-csx", type=_positive, default=4,
                      help="simulated systems (default 4)")
    demo.add_argument("--mbs", type=mbs_argument, default="auto",
                      help="micro batch size: an int, auto (default) or none")
    demo.set_defaults(run=run_demo)

    def config_command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=description)
        p.add_argument("config", metavar="CONFIG.yaml", help="the run's YAML configuration")
        p.add_argument("--out", metavar="DIR", default=None,
                       help="artifacts and metrics folder (default: the config's output_dir, "
                            "mbcompile-artifacts/<config name>)")
        p.add_argument("--mbs", type=mbs_argument, default=None, metavar="VALUE",
                       help="override every micro_batch_size flag: an int, auto, none, "
                            "explore or explore:MIN:MAX")
        return p

    fit = config_command("fit", "train (and validate) as the config says",
                         "Train the configured model, validating as `fit:` says; logs every "
                         "step to the terminal and to metrics.csv and metrics.jsonl. With "
                         "compile_only or validate_only in the config it only compiles.")
    fit.add_argument("--nproc", type=_positive, default=None, metavar="N",
                     help="launch N CPU ranks (gloo on 127.0.0.1), one per system: the "
                          "config's num_csx must be N")
    fit.add_argument("--max-steps", type=_positive, default=None,
                     help="override fit.max_steps")
    fit.add_argument("--resume", action="store_true",
                     help="continue from the newest good checkpoint in the output folder's "
                          "checkpoints/ (from step 0 if there is none); the later steps "
                          "equal an uninterrupted run's")
    fit.set_defaults(run=run_fit)

    val = config_command("validate", "run the validation phase only",
                         "Run the configured model in eval mode on the validation data "
                         "(ScopedValidateFlags apply) and report the mean loss.")
    val.add_argument("--steps", type=_positive, default=None,
                     help="validation steps (default: fit.val_steps, or data.num_batches)")
    val.set_defaults(run=run_validate)

    comp = config_command("compile", "compile and write the plan, code and graph drawings",
                          "Compile the configured model (the train phase's flags unless "
                          "--phase validate) and write the artifacts folder: plan.txt, "
                          "plan.json, graph.py, original_graph.py, graph.dot, graph.svg "
                          "and explore.png (when exploring).")
    mode = comp.add_mutually_exclusive_group()
    mode.add_argument("--compile-only", action="store_true",
                      help="trace, analyse, plan and estimate; the result never runs")
    mode.add_argument("--validate-only", action="store_true",
                      help="stop after capture and batch analysis")
    comp.add_argument("--phase", choices=("train", "validate"), default="train",
                      help="whose flags and train/eval mode to compile with (default train)")
    comp.set_defaults(run=run_compile)
    return parser


# --------------------------------------------------------------------------- #
# demo
# --------------------------------------------------------------------------- #


def _demo_system(model: Any, batch: Any, gbs: int, num_csx: int) -> Any:
    """The host with memory halfway between the needs of MBS 1 and of no split.

    On the real host a tiny GPT fits whole, and auto rightly keeps it whole; the
    demo is about microbatching, so it runs on systems that need it.
    """
    import dataclasses

    from mbcompile.planning.systems import get_system

    peak = [compiler.compile(model, gbs, num_csx, mbs, example_inputs=batch, compile_only=True
                             ).estimate.memory.peak for mbs in (1, "none")]
    return dataclasses.replace(get_system("host"), name="demo", memory_bytes=sum(peak) / 2)


def run_demo(args: argparse.Namespace) -> int:
    from mbcompile.models import make_tiny_gpt, token_batch
    from mbcompile.training.trainer import Trainer

    gbs, num_csx = args.gbs, args.num_csx
    if gbs < num_csx:
        raise CommandError(f"--gbs {gbs} is smaller than --num-csx {num_csx}: each system "
                           "needs at least one sample")
    model, batch = make_tiny_gpt(gbs, seed=0)
    reference = copy.deepcopy(model)  # the eager full-batch step runs on this copy
    params = sum(p.numel() for p in model.parameters())
    _out(f"mbcompile demo: TinyGPT ({params:,} parameters), {gbs} padded token sequences "
         f"(gbs {gbs}) over {num_csx} simulated systems, mbs={args.mbs}")
    _out()

    system = _demo_system(model, batch, gbs, num_csx) if args.mbs == "auto" else None
    if system is not None:
        _out(f"the simulated systems have {system.memory_bytes / 1e3:.0f} kB of memory each: "
             "too little for a whole per-system batch, so mbs=auto has to split it")
    started = time.perf_counter()
    cm = compiler.compile(model, gbs, num_csx, args.mbs, example_inputs=batch, system=system)
    _out(f"1. compiled in {time.perf_counter() - started:.2f} s")
    _out(str(cm.plan))
    _out()
    _out("2. the rewritten graph (the body submodule runs once per microbatch):")
    _out(cm.graph_module.code.strip())
    _out()

    _out("3. one training step, compiled against an eager full-batch step on a copy:")
    loss, _ = cm(*batch)
    loss.backward()
    ref_loss, _ = reference(*batch)
    ref_loss.backward()
    grads = [(n, p.grad, dict(reference.named_parameters())[n].grad)
             for n, p in model.named_parameters()]
    missing = [n for n, g, r in grads if g is None or r is None]
    if missing:
        raise CommandError(f"the compiled step left no gradient in {missing[0]!r}")
    loss_diff = relative_error(loss, ref_loss)
    grad_diff = max(relative_error(g, r) for _, g, r in grads)
    _out(f"   loss       compiled {loss.item():.6f}   full batch {ref_loss.item():.6f}   "
         f"max rel diff {loss_diff:.1e}")
    _out(f"   gradients  {len(grads)} tensors, max rel diff {grad_diff:.1e} "
         "(max |compiled - eager| / max |eager|, per tensor)")
    if not (loss_diff <= DEMO_TOLERANCE and grad_diff <= DEMO_TOLERANCE):
        raise CommandError(f"the compiled step differs from the full-batch step by more than "
                           f"{DEMO_TOLERANCE:g} (loss {loss_diff:.1e}, gradients "
                           f"{grad_diff:.1e}); please report this")
    _out(f"   equal to a full-batch step, to float32 rounding (tolerance {DEMO_TOLERANCE:g})")
    _out()

    _out(f"4. training {args.steps} steps (AdamW, a fresh compile inside the Trainer):")
    model.zero_grad(set_to_none=True)
    batches = [token_batch(gbs, seed=1 + i) for i in range(4)]
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gbs=gbs,
                      num_csx=num_csx, callbacks=[GlobalFlags(micro_batch_size=args.mbs)],
                      console=Console(soft_wrap=True), system=system)
    rows = trainer.fit(batches, max_steps=args.steps)
    _out()
    _out(f"done: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} over {len(rows)} steps. "
         "Next: mbcompile fit examples/tiny_gpt.yaml")
    return EXIT_OK


# --------------------------------------------------------------------------- #
# compile
# --------------------------------------------------------------------------- #


def _compile_options(cfg: Config, compile_only: bool, validate_only: bool) -> dict[str, Any]:
    params = inspect.signature(compiler.compile).parameters
    options: dict[str, Any] = {"in_dims": cfg.in_dims}
    if cfg.system is not None:
        options["system"] = cfg.system
    if cfg.backend != "simulated":
        options["backend"] = cfg.backend
    if compile_only:
        options["compile_only"] = True
    if validate_only:
        options["validate_only"] = True
    for key in options:
        if key not in params:
            flag = "--" + key.replace("_", "-") if key.endswith("_only") else key
            raise CommandError(f"{flag} needs mbcompile.compile({key}=...), which this version "
                               "of mbcompile does not have yet; run without it")
    return options


def _report(cm: Any) -> tuple[str | None, Any]:
    """``cm.report()`` as (text, JSON-able), where the module has one.

    The contract: ``str(report)`` is the text; ``report.to_dict()`` (or a JSON string
    from ``report.to_json()``) is the data.
    """
    report_fn = getattr(cm, "report", None)
    if not callable(report_fn):
        return None, None
    report = report_fn()
    data: Any = None
    if callable(getattr(report, "to_dict", None)):
        data = report.to_dict()
    elif callable(getattr(report, "to_json", None)):
        data = json.loads(report.to_json())
    return str(report), data


def _explore_plot(cm: Any, out: Path) -> Path | None:
    """``explore.png``: ``plot(path)`` (or ``save_plot``) of the module's exploration.

    The exploration is ``cm.exploration`` or ``cm.report().exploration``
    (``mbcompile.planning.explore.Exploration``).
    """
    report_fn = getattr(cm, "report", None)
    report = report_fn() if callable(report_fn) else None
    for holder in (getattr(cm, "exploration", None), getattr(report, "exploration", None)):
        for name in ("plot", "save_plot"):
            if callable(getattr(holder, name, None)):
                path = out / "explore.png"
                getattr(holder, name)(path)
                return path if path.exists() else None
    return None


def _write(path: Path, text: str, written: list[Path]) -> None:
    path.write_text(text)
    written.append(path)


def write_artifacts(cm: Any, out: Path, cfg: Config | None = None, mbs: Any = None
                    ) -> list[Path]:
    """The artifacts folder of a compiled module; returns the files written."""
    from mbcompile.reports.draw import draw

    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    plan = getattr(cm, "plan", None)
    report_text, report_json = _report(cm)
    if plan is not None or report_text:
        text = "\n\n".join(t for t in (str(plan) if plan is not None else None, report_text)
                           if t)
        _write(out / "plan.txt", text + "\n", written)
        data = {"plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
                "report": report_json,
                "config": cfg.to_dict() if cfg is not None else None}
        _write(out / "plan.json", json.dumps(data, indent=2, default=str) + "\n", written)
    for attr, name in (("graph_module", "graph.py"), ("original_graph_module",
                                                      "original_graph.py")):
        try:
            gm = getattr(cm, attr, None)
        except MbcompileError:  # a validate-only result may have no rewritten graph
            gm = None
        if gm is not None:
            _write(out / name, gm.print_readable(print_output=False) + "\n", written)
    try:
        written += draw(cm, out / "graph.svg")  # graph.dot and graph.svg
    except (MbcompileError, AttributeError):  # a validate-only result has no rewritten graph
        pass
    if mbs is not None and parse_mbs(mbs).mode == "explore":
        plot = _explore_plot(cm, out)
        if plot is not None:
            written.append(plot)
    return written


def _first_batch(cfg: Config, phase: str) -> Any:
    for batch in build_data(cfg, phase):
        return batch
    raise CommandError(f"the {phase} data of {cfg.file} yielded no batches")


def compile_config(cfg: Config, out: Path, *, mbs: Any = None, phase: str = "train",
                   compile_only: bool = False, validate_only: bool = False) -> int:
    from mbcompile.reports.draw import draw
    from mbcompile.training.trainer import batch_args

    if cfg.shard != "none":
        raise CommandError(f"{cfg.file} shards the model (shard: {cfg.shard}), which happens on "
                           f"its ranks only: train it with mbcompile fit {cfg.file} --nproc "
                           f"{cfg.num_csx}, or compile it here with shard: none (the plan and "
                           "graph are the unsharded model's, without FSDP's unit markers)")
    options = _compile_options(cfg, compile_only, validate_only)
    model = build_model(cfg)
    model.train(phase == "train")
    mbs = cfg.flags(phase)["micro_batch_size"] if mbs is None else mbs
    args, kwargs = batch_args(_first_batch(cfg, phase))
    what = "validate-only" if validate_only else "compile-only" if compile_only else "compile"
    _out(f"{what}: {cfg.model} ({phase} phase), gbs {cfg.batch_size} over {cfg.num_csx} "
         f"system{'s' if cfg.num_csx != 1 else ''}, mbs={mbs}")
    started = time.perf_counter()
    try:
        cm = compiler.compile(model, cfg.batch_size, cfg.num_csx, mbs,
                              example_inputs=args or None, example_kwargs=kwargs or None,
                              **options)
    except MixingError as exc:
        try:
            files = draw(model, out / "rejected.svg", error=exc)
        except MbcompileError:
            files = []
        where = f"\n  the graph with the mixing op highlighted: {files[-1]}" if files else ""
        raise MixingError(f"{exc}{where}") from exc
    _out(f"done in {time.perf_counter() - started:.2f} s")
    plan = getattr(cm, "plan", None)
    if plan is not None:
        _out(str(plan))
    written = write_artifacts(cm, out, cfg, mbs)
    _out(f"artifacts in {out}/: " + ", ".join(p.name for p in written))
    return EXIT_OK


def run_compile(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    compile_only = args.compile_only or (cfg.compile_only and not args.validate_only)
    validate_only = args.validate_only or (cfg.validate_only and not args.compile_only)
    return compile_config(cfg, Path(args.out or cfg.output_dir), mbs=args.mbs, phase=args.phase,
                          compile_only=compile_only, validate_only=validate_only)


# --------------------------------------------------------------------------- #
# fit and validate
# --------------------------------------------------------------------------- #


def run_fit(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    out = Path(args.out or cfg.output_dir)
    if cfg.compile_only or cfg.validate_only:
        _out(f"{cfg.file} sets {'compile_only' if cfg.compile_only else 'validate_only'}: "
             "compiling only, no training")
        return compile_config(cfg, out, mbs=args.mbs, compile_only=cfg.compile_only,
                              validate_only=cfg.validate_only)
    if getattr(args, "nproc", None):
        if args.nproc != cfg.num_csx:
            raise CommandError(f"--nproc {args.nproc} launches one rank per system, but "
                               f"{cfg.file} has num_csx {cfg.num_csx}: make them equal")
        return _launch_ranks(args, out)
    if cfg.backend == "torch.distributed":
        _init_from_environment(cfg)
    return _fit(cfg, args, out, _rank())


def _launch_ranks(args: argparse.Namespace, out: Path) -> int:
    """``fit --nproc N``: N ranks in child processes; this process forwards SIGINT and
    SIGTERM to them (they stop after an agreed step with a checkpoint) and waits."""
    import multiprocessing

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    from mbcompile.execution.distributed import launch

    def forward(signum: int, frame: Any) -> None:
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError, TypeError):  # gone already
                os.kill(child.pid, signum)

    _out(f"launching {args.nproc} CPU ranks (gloo on 127.0.0.1), one per system")
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        launch(_fit_rank, args.nproc, args)
    except (ProcessExitedException, ProcessRaisedException) as exc:
        code = getattr(exc, "exit_code", None)
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            return int(code)  # the ranks stopped cleanly; rank 0 said where and how to resume
        _add_note(exc, _checkpoint_note(out, args))
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return EXIT_OK  # every rank finished, whatever signal came after the last step


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _init_from_environment(cfg: Config) -> None:
    """Join the process group torchrun describes in the environment, if not joined yet."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            what = f"shard: {cfg.shard}" if cfg.shard != "none" else "backend torch.distributed"
            raise CommandError(f"{what} needs ranks: run with --nproc {cfg.num_csx}, or launch "
                               f"with torchrun --nproc-per-node {cfg.num_csx} -m mbcompile "
                               "fit ...")
        dist.init_process_group("gloo")


def _fit_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    """One rank of ``fit --nproc``: the config's run on the torch.distributed backend.

    A stop by SIGINT/SIGTERM ends the rank with exit code 130/143 once rank 0 has
    said where the checkpoint is (the launcher passes the code on).
    """
    import dataclasses

    import torch.distributed as dist

    cfg = dataclasses.replace(load_config(args.config), backend="torch.distributed")
    try:
        _fit(cfg, args, Path(args.out or cfg.output_dir), rank)
    except KeyboardInterrupt as exc:  # a non-zero exit: the launcher stops the other ranks
        if rank == 0:
            sys.stdout.flush()
            print(_paragraph(exc), file=sys.stderr, flush=True)
        if isinstance(exc, TrainingInterrupted) and exc.checkpoint is not None:
            dist.barrier()  # every rank waits for rank 0's message before the launcher reaps
        code = exc.exit_code if isinstance(exc, TrainingInterrupted) else EXIT_INTERRUPTED
        raise SystemExit(code) from None


def _fit(cfg: Config, args: argparse.Namespace, out: Path, rank: int = 0) -> int:
    """Train as ``cfg`` says: rank 0 logs to ``out``, rank r to ``out/rank<r>``; the
    checkpoints of every rank go to ``out/checkpoints``."""
    quiet = bool(rank)
    say = (lambda *_: None) if quiet else _out
    log_dir = out if not rank else out / f"rank{rank}"
    trainer = build_trainer(cfg, mbs=args.mbs, log_dir=str(log_dir), progress=not quiet,
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
    except (Exception, KeyboardInterrupt) as exc:
        note = _kept(trainer.global_step, log_dir)
        if isinstance(exc, TrainingInterrupted) and exc.checkpoint is not None:
            note += (f"; checkpoint of step {exc.step}: {exc.checkpoint}; resume with: "
                     f"{_resume_command(args)}")
        elif trainer.last_checkpoint is not None:
            note += f"; {_checkpoint_note(out, args)}"
        _add_note(exc, note)
        raise
    train_rows = [r for r in rows if r["phase"] == "train"]
    val_rows = [r for r in rows if r["phase"] == "validate"]
    if train_rows:
        say(f"trained {len(train_rows)} steps: loss {train_rows[0]['loss']:.4f} -> "
            f"{train_rows[-1]['loss']:.4f}" + (f"; last validation loss "
                                                f"{val_rows[-1]['loss']:.4f}" if val_rows
                                                else ""))
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
    trainer = build_trainer(cfg, mbs=args.mbs, log_dir=str(out), console=Console(soft_wrap=True))
    steps = args.steps or cfg.val_steps or None
    summary = trainer.validate(build_data(cfg, "validate"), max_steps=steps)
    if summary["loss"] is None or not math.isfinite(summary["loss"]):
        raise CommandError(f"validation loss is {summary['loss']}")
    _out(f"validated {summary['steps']} steps: mean loss {summary['loss']:.4f} "
         f"(mbs {summary['mbs']}); metrics: {out / 'metrics.csv'}")
    return EXIT_OK


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, which Python 3.10 lacks; ``_paragraph`` prints the notes."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def _paragraph(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, TrainingInterrupted) and exc.signum != signal.SIGINT:
        text = f"interrupted by {signal.Signals(exc.signum).name}"
    elif isinstance(exc, KeyboardInterrupt):
        text = "interrupted"
    elif isinstance(exc, MbcompileError):
        text = f"error: {text}"
    elif isinstance(exc, (OSError, ValueError, TypeError, RuntimeError, ImportError, KeyError)):
        text = f"error: {type(exc).__name__}: {text} (run with --debug for the traceback)"
    else:
        text = (f"error: unexpected {type(exc).__name__}: {text}. Run with --debug for the "
                "traceback, and please report it if it looks like a bug in mbcompile.")
    return text + "".join(f"\n  {note}" for note in getattr(exc, "__notes__", ()))


def _run(args: argparse.Namespace, debug: bool) -> int:
    """The command's exit code; a failure is one paragraph on stderr."""
    try:
        return int(args.run(args))
    except KeyboardInterrupt as exc:  # also TrainingInterrupted: SIGINT or SIGTERM in a fit
        sys.stdout.flush()
        print(_paragraph(exc), file=sys.stderr, flush=True)
        return exc.exit_code if isinstance(exc, TrainingInterrupted) else EXIT_INTERRUPTED
    except BrokenPipeError:  # `mbcompile ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:
        sys.stdout.flush()
        if debug:
            traceback.print_exc()
        print(_paragraph(exc), file=sys.stderr, flush=True)
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for "resume with: ..."
    if getattr(args, "debug", False):  # warnings as Python shows them, when they happen
        return _run(args, debug=True)
    # Held back until the command ends, so that a failure's error is the first line
    # on stderr; the same message (one per compile, say) is shown once.
    with warnings.catch_warnings(record=True) as caught:
        code = _run(args, debug=False)
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"warning: {message}", file=sys.stderr, flush=True)
    return code
