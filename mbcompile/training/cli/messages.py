"""How a ``mbcompile`` command reports: exit codes, stdout lines, one-paragraph errors.

A failure is one paragraph on stderr: what went wrong first, then the notes a command
added on the way out (what a stopped fit kept, where its checkpoint is, how to resume).
"""

from __future__ import annotations

import signal

from mbcompile.passes.errors import MbcompileError  # torch-free: `mbcompile --help` loads this

__all__ = ["EXIT_FAILURE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "CommandError",
           "add_note", "echo", "paragraph"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CommandError(MbcompileError):
    """A command that cannot do what was asked (reported as one paragraph, exit code 1)."""


def echo(message: str = "") -> None:
    print(message, flush=True)



def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, which Python 3.10 lacks; ``paragraph`` prints the notes."""
    exc.__notes__ = [*getattr(exc, "__notes__", ()), note]  # type: ignore[attr-defined]


def paragraph(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    signum = getattr(exc, "signum", signal.SIGINT)  # a TrainingInterrupted's signal
    if isinstance(exc, KeyboardInterrupt) and signum != signal.SIGINT:
        text = f"interrupted by {signal.Signals(signum).name}"
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
