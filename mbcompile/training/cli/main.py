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

This module parses the command line and runs a command; each command has its own
module in this package (``demo``, ``compile``, ``fit``), and ``messages`` holds the
exit codes and the one-paragraph error. Parsing imports no torch: a command's module
(and torch and the compiler with it) is imported when the command runs, so
``mbcompile --help`` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from mbcompile.passes.errors import MbcompileError  # torch-free, unlike mbcompile.errors
from mbcompile.planning.plan import parse_mbs  # plan arithmetic: pure Python
from mbcompile.training.cli.messages import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    paragraph,
)

__all__ = ["OUTPUTS", "main", "mbs_argument"]

#: Where the commands write (the end of ``mbcompile --help``).
OUTPUTS = """\
outputs:
  fit, validate  metrics.csv and metrics.jsonl (one row per step) in the output folder:
                 --out DIR, else the config's output_dir, else mbcompile-artifacts/<config
                 name>; on ranks, rank 0 writes them
  fit            checkpoints in <output folder>/checkpoints/step-NNNNNNNN/ (every
                 fit.checkpoint_every steps, at the end, and on SIGINT/SIGTERM)
  compile        plan.txt, plan.json, graph.py, original_graph.py, graph.dot, graph.svg
                 (and explore.png when exploring) in the output folder
  demo           prints only; writes no files"""


@dataclasses.dataclass(frozen=True)
class _Command:
    """``mbcompile.training.cli.<module>.<name>``, imported when the command runs: the
    commands import torch and the compiler, which parsing (and ``--help``) never needs.
    A plain dataclass, so that ``fit --nproc`` can pickle the parsed arguments to its
    ranks."""

    module: str
    name: str

    def __call__(self, args: argparse.Namespace) -> int:
        command = importlib.import_module(f"mbcompile.training.cli.{self.module}")
        return getattr(command, self.name)(args)


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
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `mbcompile demo`; `mbcompile COMMAND --help` describes each "
               "command.\n\n" + OUTPUTS)
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
                      help="micro batch size: an int, auto (default) or none (explore plans "
                           "only: see mbcompile compile)")
    demo.set_defaults(run=_Command("demo", "run_demo"))

    def config_command(name: str, help_text: str, description: str,
                       explore: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text, description=description)
        p.add_argument("config", metavar="CONFIG.yaml", help="the run's YAML configuration")
        p.add_argument("--out", metavar="DIR", default=None,
                       help="artifacts and metrics folder (default: the config's output_dir, "
                            "mbcompile-artifacts/<config name>)")
        p.add_argument("--mbs", type=mbs_argument, default=None, metavar="VALUE",
                       help="override every micro_batch_size flag: an int, auto, none, "
                            f"explore or explore:MIN:MAX ({explore})")
        return p

    fit = config_command("fit", "train (and validate) as the config says",
                         "Train the configured model, validating as `fit:` says; logs every "
                         "step to the terminal and to metrics.csv and metrics.jsonl. With "
                         "compile_only or validate_only in the config it only compiles.",
                         "explore plans only: explore with `mbcompile compile CONFIG.yaml "
                         "--mbs explore --compile-only`, then fit with the MBS it picks")
    fit.add_argument("--nproc", type=_positive, default=None, metavar="N",
                     help="launch N CPU ranks (gloo on 127.0.0.1), one per system: the "
                          "config's num_csx must be N")
    fit.add_argument("--max-steps", type=_positive, default=None,
                     help="override fit.max_steps")
    fit.add_argument("--resume", action="store_true",
                     help="continue from the newest good checkpoint in the output folder's "
                          "checkpoints/ (from step 0 if there is none); the later steps "
                          "equal an uninterrupted run's")
    fit.set_defaults(run=_Command("fit", "run_fit"))

    val = config_command("validate", "run the validation phase only",
                         "Run the configured model in eval mode on the validation data "
                         "(ScopedValidateFlags apply) and report the mean loss.",
                         "explore plans only: explore with `mbcompile compile CONFIG.yaml "
                         "--mbs explore --compile-only --phase validate`")
    val.add_argument("--steps", type=_positive, default=None,
                     help="validation steps (default: fit.val_steps, or data.num_batches)")
    val.set_defaults(run=_Command("fit", "run_validate"))

    comp = config_command("compile", "compile and write the plan, code and graph drawings",
                          "Compile the configured model (the train phase's flags unless "
                          "--phase validate) and write the artifacts folder: plan.txt, "
                          "plan.json, graph.py, original_graph.py, graph.dot, graph.svg "
                          "and explore.png (when exploring).",
                          "explore plans only: it implies --compile-only")
    mode = comp.add_mutually_exclusive_group()
    mode.add_argument("--compile-only", action="store_true",
                      help="trace, analyse, plan and estimate; the result never runs")
    mode.add_argument("--validate-only", action="store_true",
                      help="stop after capture and batch analysis")
    comp.add_argument("--phase", choices=("train", "validate"), default="train",
                      help="whose flags and train/eval mode to compile with (default train)")
    comp.set_defaults(run=_Command("compile", "run_compile"))
    return parser



def _run(args: argparse.Namespace, debug: bool) -> int:
    """The command's exit code; a failure is one paragraph on stderr."""
    try:
        return int(args.run(args))
    except KeyboardInterrupt as exc:  # also TrainingInterrupted: SIGINT or SIGTERM in a fit
        sys.stdout.flush()
        print(paragraph(exc), file=sys.stderr, flush=True)
        # TrainingInterrupted (SIGINT or SIGTERM in a fit) carries its own code, 130 or 143
        return int(getattr(exc, "exit_code", EXIT_INTERRUPTED))
    except BrokenPipeError:  # `mbcompile ... | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:
        sys.stdout.flush()
        if debug:
            traceback.print_exc()
        print(paragraph(exc), file=sys.stderr, flush=True)
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
