"""The patches a sandboxed hook call runs under, put in place once per microbatch of a step.

``hook_sandbox.call_sandboxed`` runs a user's hook with ``print`` and the ``logging`` calls
recorded (``print_calls``), ``open`` refused (``code_reach.open_checked``) and
``Tensor.register_hook`` kept, the hook it registers called sandboxed too. Putting the six
functions in place and back around each call cost as much as the rest of the check (15 of
69 µs a call under load: ``benchmarks/RESULTS.md``), on every call of every hooked layer
of a microbatch. Here each is replaced by a switched function that acts only while a
sandboxed call runs (``enter``: its ``Call`` is the innermost of ``_CALLS``), exactly as
the per-call patches did, and otherwise calls what it replaced, as if it were not there (a
log record still names its caller: ``print_calls._one_up``). They are put in place at a
call that finds them missing, and put back when it ends, unless a step ``hold``s them:
then when its microbatch ends (``release``), so the calls of one microbatch pay once.

Never looser than per-call patches: each ``enter`` checks all six are in place (one
replaced meanwhile, by the user or a capture's ``prints_recorded``, is switched again),
and between calls nothing records, refuses or wraps. Each switched function is made for
what it replaces: one the user kept while it was in place and puts back later still hands
its calls to what it replaced then.

Example::

    hold()                        # a microbatch of a step starts
    call = Call(reach, wrap)
    enter(call)                   # the functions put in place (first call), call recorded
    try:
        hook(layer, args, out)    # print(...) -> call.prints.calls
    finally:
        leave(call)               # the functions stay until release(): the next call's
    release()                     # microbatch ends: put back
"""

from __future__ import annotations

import builtins
import io
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from .code_reach import Reach, open_checked
from .print_calls import (
    RECORDING,
    PrintRecorder,
    switched_enabled,
    switched_log,
    switched_print,
)

__all__ = ["Call", "enter", "hold", "leave", "release"]


class Call:
    """What one sandboxed call records: its prints and logs, the tensor hooks it registers
    (each wrapped by ``wrap``, to be called sandboxed), and the files it opens
    (``reach.refused``)."""

    __slots__ = ("prints", "reach", "registered", "wrap")

    def __init__(self, reach: Reach, wrap: Callable[[Any], Any]) -> None:
        self.reach, self.wrap = reach, wrap
        self.prints = PrintRecorder()
        self.registered: list[Any] = []


_CALLS: list[Call] = []  # the sandboxed calls running, innermost last


class _Held:
    depth = 0  # microbatches of a step running (``hold``)


def _switched_open(through: Callable[..., Any]) -> Callable[..., Any]:
    def open_switched(*args: Any, **kwargs: Any) -> Any:
        if _CALLS:
            return open_checked(_CALLS[-1].reach, sys._getframe(1), args, kwargs)
        return through(*args, **kwargs)
    return open_switched


def _switched_register(through: Callable[..., Any]) -> Callable[..., Any]:
    def register_hook_switched(self: torch.Tensor, hook: Any) -> Any:
        if _CALLS:
            call = _CALLS[-1]
            call.registered.append(hook)
            hook = call.wrap(hook)
        return through(self, hook)
    return register_hook_switched


#: what is switched: (owner, attribute), and what makes the switched function to put there,
#: given what it replaces
_OWNERS = (builtins, logging.Logger, logging.Logger, builtins, io, torch.Tensor)
_NAMES = ("print", "_log", "isEnabledFor", "open", "open", "register_hook")
_SWITCHES = (switched_print, switched_log, switched_enabled, _switched_open, _switched_open,
             _switched_register)
_PLACED: list[Any] = [None] * len(_NAMES)  # what this module last put there
_REPLACED: list[Any] = [None] * len(_NAMES)  # what that replaced


def _in_place() -> bool:
    """Whether each of ``_NAMES`` holds what this module put there (spelled out: a loop of
    ``getattr`` took twice as long, on every call)."""
    placed = _PLACED
    return builtins.print is placed[0] and logging.Logger._log is placed[1] and \
        logging.Logger.isEnabledFor is placed[2] and builtins.open is placed[3] and \
        io.open is placed[4] and torch.Tensor.register_hook is placed[5]


def _put_in_place() -> None:
    for i, (owner, name) in enumerate(zip(_OWNERS, _NAMES)):
        held = getattr(owner, name)
        if held is not _PLACED[i]:
            _PLACED[i], _REPLACED[i] = _SWITCHES[i](held), held
            setattr(owner, name, _PLACED[i])


def _put_back() -> None:
    for i, (owner, name) in enumerate(zip(_OWNERS, _NAMES)):
        if getattr(owner, name) is _PLACED[i]:  # (one replaced since: its author's to undo)
            setattr(owner, name, _REPLACED[i])
        _PLACED[i] = _REPLACED[i] = None


def enter(call: Call) -> None:
    """``call`` records from now on (until ``leave``), the functions put in place if any is
    missing."""
    if not _in_place():
        _put_in_place()
    _CALLS.append(call)
    RECORDING.append(call.prints)


def leave(call: Call) -> None:
    """``call`` (the innermost) records no more; outside a held microbatch, and with no
    other call running, the functions are put back."""
    del _CALLS[-1], RECORDING[-1]
    if not _CALLS and not _Held.depth:
        _put_back()


def hold() -> None:
    """A microbatch of a step starts: what its sandboxed calls put in place stays until its
    ``release``."""
    _Held.depth += 1


def release() -> None:
    _Held.depth -= 1
    if not _Held.depth and not _CALLS:
        _put_back()
