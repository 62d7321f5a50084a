"""The ``print`` and ``logging`` calls forward makes, recorded while it is traced.

Nothing is printed or logged while tracing: each call is recorded where it is made
(``PrintCall``) and replayed once per step by ``side_effects.replay``, with the full batch's
values. Two things make a logging call what it is in eager, and both are kept:

- whether the logger is enabled for the level: read when forward runs, so each answer the
  trace got (``logger.isEnabledFor(INFO)``, asked by ``logger.info`` or by forward itself)
  is a ``LevelRead``, guarded (``level_guard``): ``logger.setLevel`` after compile compiles
  again, instead of replaying a call eager would drop or dropping one it would make;
- where the record says it was made: the replay builds the record with forward's file,
  line and function (``_emit``), not the replay's.

Example::

    def forward(self, x, y):
        loss = F.mse_loss(self.lin(x), y)
        log.info("loss %s", loss.detach())   # recorded: PrintCall(_emit(log, INFO, site), ...)
        return loss                          # and LevelRead(log, INFO, True), guarded
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .guards import Guard
from .sources import is_library, user_frame

__all__ = ["RECORDING", "LevelRead", "PrintCall", "PrintRecorder", "level_guard",
           "prints_recorded", "switched_enabled", "switched_log", "switched_print"]


@dataclass(frozen=True)
class PrintCall:
    """A ``print`` (``target``: the real one) or a logger's call (``target``: ``_emit`` bound
    to the logger, level and site), with its arguments and the user's line."""

    target: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    where: str


@dataclass(frozen=True)
class LevelRead:
    """``logger.isEnabledFor(level)`` answered ``enabled`` while forward was traced."""

    logger: logging.Logger
    level: int
    enabled: bool


class _Levels:
    """A logger's ``isEnabledFor`` as a mapping (level -> answer), so that a ``Guard`` with
    ``item`` reads it as it reads a dict's key."""

    __slots__ = ("logger",)

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def get(self, level: int, default: Any = None) -> bool:
        return self.logger.isEnabledFor(level)


def level_guard(read: LevelRead) -> Guard:
    """The guard of one answer: the logger enabled (or not) for that level, as traced."""
    name = logging.getLevelName(read.level)
    return Guard(_Levels(read.logger), read.level, read.enabled, item=True,
                 where=f"logger {read.logger.name!r} enabled for {name}")


def _print_to(stream: str, *args: Any, **kwargs: Any) -> None:
    """``print`` to ``sys.<stream>`` as it is now."""
    _PRINT(*args, file=getattr(sys, stream), **kwargs)


class PrintRecorder:
    """What a block's ``print`` and ``logging`` calls record (``prints_recorded``, and the
    sandboxed hook calls of ``sandbox_patches``): each call, and each level the user's code
    asks a logger about, with its answer."""

    __slots__ = ("asked", "calls")

    def __init__(self) -> None:
        self.calls: list[PrintCall | LevelRead] = []
        self.asked: set[tuple[int, int]] = set()

    def printed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        stream = next((n for n in ("stdout", "stderr")
                       if kwargs.get("file") is getattr(sys, n)), None)
        if stream is None:
            self.calls.append(PrintCall(_PRINT, args, kwargs, _where()))
            return
        # print(..., file=sys.stderr) reads sys.stderr at each call (a redirect after
        # compile is followed), not the stream of compile time
        rest = {k: v for k, v in kwargs.items() if k != "file"}
        self.calls.append(PrintCall(functools.partial(_print_to, stream), args, rest,
                                    _where()))

    def logged(self, logger: logging.Logger, level: int, msg: Any, args: Any,
               kwargs: dict[str, Any]) -> bool:
        """Record a logger's call (True), or False for torch's own, which are logged."""
        frame = _caller()
        if frame is None or is_library(frame.f_code.co_filename):  # torch's own logs
            return False
        site = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
        self.calls.append(PrintCall(functools.partial(_emit, logger, level, site),
                                    (msg, args), kwargs, _where()))
        return True

    def enabled(self, logger: logging.Logger, level: int, answer: bool) -> None:
        frame = _caller()
        if frame is not None and not is_library(frame.f_code.co_filename) and \
                (id(logger), level) not in self.asked:
            self.asked.add((id(logger), level))
            self.calls.append(LevelRead(logger, level, answer))

    def prints(self) -> list[PrintCall]:
        """The calls that print or log (a level asked alone writes nothing)."""
        return [c for c in self.calls if isinstance(c, PrintCall)]


def _where() -> str:  # the caller's line (not logging's own frames, nor mbcompile's)
    return user_frame([f for f in traceback.extract_stack()[:-2]
                       if f.filename != logging.__file__])


@contextlib.contextmanager
def prints_recorded() -> Iterator[list[PrintCall | LevelRead]]:
    """While the block traces: ``print`` and the ``logging`` calls a logger would emit
    record their call instead of printing or logging, and each level the user's code asks
    a logger about is recorded with its answer."""
    recorder = PrintRecorder()

    def printed(*args: Any, **kwargs: Any) -> None:
        recorder.printed(args, kwargs)

    def logged(self: logging.Logger, level: int, msg: Any, args: Any, **kwargs: Any) -> None:
        if not recorder.logged(self, level, msg, args, kwargs):
            _LOG(self, level, msg, args, **_one_up(kwargs))

    def enabled(self: logging.Logger, level: int) -> bool:
        answer = _ENABLED(self, level)
        recorder.enabled(self, level, answer)
        return answer

    outer = builtins.print, logging.Logger._log, logging.Logger.isEnabledFor
    builtins.print = printed
    logging.Logger._log = logged  # type: ignore[method-assign]
    logging.Logger.isEnabledFor = enabled  # type: ignore[method-assign]
    try:
        yield recorder.calls
    finally:  # what was there (a sandbox's switched functions, in a step), not ours
        builtins.print, logging.Logger._log, logging.Logger.isEnabledFor = outer  # type: ignore[method-assign]


def _one_up(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A logger call's keywords handed on from a function of this module called in
    ``Logger._log``'s place: the record names the frame above it (``findCaller`` skips
    only ``logging``'s own), the caller's, as without it."""
    return {**kwargs, "stacklevel": kwargs.get("stacklevel", 1) + 1}


#: the recorders of the sandboxed hook calls running, innermost last (``sandbox_patches``):
#: while one runs, the switched functions below record into it, and otherwise call what
#: they replaced, as if they were not there
RECORDING: list[PrintRecorder] = []


def switched_print(through: Callable[..., Any]) -> Callable[..., None]:
    """``print`` for ``sandbox_patches``, in place of ``through``."""
    def print_switched(*args: Any, **kwargs: Any) -> None:
        if RECORDING:
            RECORDING[-1].printed(args, kwargs)
        else:
            through(*args, **kwargs)
    return print_switched


def switched_log(through: Callable[..., Any]) -> Callable[..., None]:
    """``Logger._log`` for ``sandbox_patches``, in place of ``through``."""
    def log_switched(self: logging.Logger, level: int, msg: Any, args: Any, **kwargs: Any
                     ) -> None:
        if not (RECORDING and RECORDING[-1].logged(self, level, msg, args, kwargs)):
            through(self, level, msg, args, **_one_up(kwargs))
    return log_switched


def switched_enabled(through: Callable[..., Any]) -> Callable[..., bool]:
    """``Logger.isEnabledFor`` for ``sandbox_patches``, in place of ``through``."""
    def enabled_switched(self: logging.Logger, level: int) -> bool:
        answer: bool = through(self, level)
        if RECORDING:
            RECORDING[-1].enabled(self, level, answer)
        return answer
    return enabled_switched


def _caller() -> types.FrameType | None:
    """The first frame outside this module and ``logging``'s own: who logged."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in (logging.__file__, __file__):
        frame = frame.f_back
    return frame


def _emit(logger: logging.Logger, level: int, site: tuple[str, int, str], msg: Any,
          args: Any, exc_info: Any = None, extra: Any = None, stack_info: bool = False,
          stacklevel: int = 1) -> None:
    """``logger``'s record of a call forward made at ``site`` (file, line, function),
    handed to its handlers as ``Logger._log`` does."""
    if isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    elif not isinstance(exc_info, tuple):
        exc_info = None  # ``exc_info=True``: no exception is being handled at the replay
    path, line, function = site
    logger.handle(logger.makeRecord(logger.name, level, path, line, msg, args, exc_info,
                                    function, extra))


_PRINT = builtins.print
_LOG = logging.Logger._log
_ENABLED = logging.Logger.isEnabledFor
