"""Calls a user's hook makes into an installed package, refused before they run.

A layer's hook runs sandboxed inside a step (``hook_sandbox``): what it writes to the
Python state it reaches is recorded and put back. A write made inside an installed
package's code (``wandb.log``, a ``SummaryWriter``'s ``add_scalar``, ``yaml.dump`` into a
stream) is out of that reach: the walk of the hook's code does not enter a library's
code, and what a library writes (a file, a socket, its own buffers) cannot be put back.
So, where the walk found the hook naming a library's module, function or object
(``names_library``), the call is watched (``sys.setprofile``: slow, so only there), and a
call from the user's code into an installed package's Python code (site-packages, not
torch's or mbcompile's) is refused before its first line runs::

    refused: list[str] = []
    with library_calls_refused(refused):
        hook(layer, args, out)   # calls yaml.safe_dump(..., STREAM): raises CaptureError
    refused  # ["a call of safe_dump in the installed package 'yaml' at t.py:9: ..."]
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from .errors import CaptureError
from .sources import SITE_DIRS, installed_package, user_frame
from .whose_code import holds_state, user_code

__all__ = ["IN_PACKAGE", "c_file", "installed", "library_calls_refused", "names_library",
           "package_of", "users_call"]

IN_PACKAGE = "in the installed package"  # how a refused call is named: ``live_hooks`` tells by it

_STDLIB = ("<", os.path.dirname(os.path.abspath(os.__file__)) + os.sep)
#: torch's own code whose job is to write where nothing can be put back (an event file)
_WRITERS = {os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "utils",
                         "tensorboard") + os.sep: "torch.utils.tensorboard"}


def installed(path: str | None) -> bool:
    """Whether ``path`` is a file of an installed package other than torch and mbcompile
    (or of torch's ``SummaryWriter``)."""
    if not path:
        return False
    found = _INSTALLED.get(path)
    if found is None:
        full = os.path.abspath(path)
        found = _INSTALLED[path] = full.startswith(tuple(_WRITERS)) or installed_package(path)
    return found


def package_of(path: str) -> str:
    """The installed package ``path`` is a file of, by name."""
    full = os.path.abspath(path)
    writer = next((name for d, name in _WRITERS.items() if full.startswith(d)), None)
    if writer is not None:
        return writer
    inside = next((full[len(d):] for d in SITE_DIRS if full.startswith(d)), full)
    return inside.split(os.sep)[0].removesuffix(".py")


_INSTALLED: dict[str, bool] = {}


def _file_of(value: Any) -> str | None:
    """The file ``value``'s Python code lives in: a module's, a function's, a class's (an
    object's: its class's). No attribute lookup on other objects: an ``nn.Module``'s
    ``__getattr__`` fails slowly."""
    if isinstance(value, types.MethodType):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return value.__code__.co_filename
    if isinstance(value, types.ModuleType):
        return getattr(value, "__file__", None)
    kind = value if isinstance(value, type) else type(value)
    found = _CLASS_FILES.get(kind, _UNSEEN)
    if found is _UNSEEN:  # a module without a file (builtins) fails its lookup slowly
        found = _CLASS_FILES[kind] = getattr(sys.modules.get(kind.__module__), "__file__", None)
    return found


_CLASS_FILES: dict[type, str | None] = {}
_UNSEEN = object()


def c_file(fn: Any) -> str | None:
    """The file of the module a built-in function (or a C object's method) belongs to."""
    module = getattr(fn, "__module__", None)
    if module is None:
        module = type(getattr(fn, "__self__", None)).__module__
    found = _MODULE_FILES.get(module, _UNSEEN)
    if found is _UNSEEN:
        found = _MODULE_FILES[module] = getattr(sys.modules.get(module), "__file__", None)
    return found


_MODULE_FILES: dict[str, str | None] = {}


def names_library(values: Iterable[Any], besides: frozenset[str] = frozenset()) -> bool:
    """Whether one of ``values`` (what the walk of a hook's code found: its globals, closure
    variables, bound objects, the layer), or a member of one that holds state (a dict of
    writers, ``self.writer``, the layer's ``m.writer``), is an installed package's module,
    function or object (of a package not in ``besides``)."""
    def other(value: Any) -> bool:
        path = _file_of(value)
        return installed(path) and package_of(str(path)) not in besides

    for value in values:
        if other(value):
            return True
        if isinstance(value, nn.Module):  # ``m.writer``: its own attributes, not torch's
            members: Iterable[Any] = [v for k, v in vars(value).items() if k[0] != "_"]
        elif holds_state(value):
            members = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple, set, frozenset)) else \
                vars(value).values()
        else:
            continue
        if any(other(m) for m in list(members)):
            return True
    return False


def users_call(frame: types.FrameType, event: str, arg: Any
               ) -> tuple[str, types.FrameType] | None:
    """For a profile event: the callee's file and the user's frame that made the call, where
    it is a call (``"call"``: of Python code, ``"c_call"``: of a built-in function) from the
    user's code (through Python's own, as ``functools`` calls) into an installed package."""
    if event == "call":
        path, caller = frame.f_code.co_filename, frame.f_back
    elif event == "c_call":
        path, caller = c_file(arg), frame
    else:
        return None
    if not installed(path):
        return None
    while caller is not None and caller.f_code.co_filename.startswith(_STDLIB):
        caller = caller.f_back
    if caller is None or not user_code(caller.f_code.co_filename) or \
            installed(caller.f_code.co_filename):
        return None
    return str(path), caller


@contextlib.contextmanager
def library_calls_refused(refused: list[str]) -> Iterator[Callable[[], None]]:
    """While the block runs, a call from the user's code (through Python's own, as
    ``functools`` calls) into an installed package's Python code, or a built-in function
    of one (a C extension's, as ``numpy.empty``), raises ``CaptureError`` before the
    callee runs, and is named in ``refused``. Python unsets a profile
    function that raises: the block gets a function that sets it again (after catching
    the refusal, to go on watching)."""
    outer = sys.getprofile()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if outer is not None:
            outer(frame, event, arg)
        found = users_call(frame, event, arg)
        if found is None:
            return
        path, caller = found
        name = frame.f_code.co_qualname if event == "call" else \
            getattr(arg, "__qualname__", arg.__name__)
        where = user_frame(traceback.extract_stack(caller))
        what = f"a call of {name} {IN_PACKAGE} {package_of(str(path))!r} at {where}"
        refused.append(what)
        raise CaptureError(f"a hook makes {what}")

    sys.setprofile(profile)
    try:
        yield lambda: sys.setprofile(profile)
    finally:
        sys.setprofile(outer)
