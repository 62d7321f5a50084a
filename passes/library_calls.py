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
import site
import sys
import sysconfig
import traceback
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .code_reach import holds_state, user_code
from .errors import CaptureError
from .sources import is_library, user_frame

__all__ = ["installed", "library_calls_refused", "names_library"]

#: where installed packages live (the venv's site-packages, the user's, the system's)
SITE_DIRS: tuple[str, ...] = tuple({
    os.path.abspath(p) + os.sep
    for p in (*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")),
              *getattr(site, "getsitepackages", list)())})
_STDLIB = ("<frozen ", os.path.dirname(os.path.abspath(os.__file__)) + os.sep)


def installed(path: str | None) -> bool:
    """Whether ``path`` is a file of an installed package other than torch and mbcompile."""
    if not path:
        return False
    found = _INSTALLED.get(path)
    if found is None:
        found = _INSTALLED[path] = os.path.abspath(path).startswith(SITE_DIRS) and \
            not is_library(path)
    return found


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


_CLASS_FILES: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()
_UNSEEN = object()


def names_library(values: Iterable[Any]) -> bool:
    """Whether one of ``values`` (what the walk of a hook's code found: its globals, closure
    variables, bound objects), or a member of one that holds state (a dict of writers,
    ``self.writer``), is an installed package's module, function or object."""
    for value in values:
        if installed(_file_of(value)):
            return True
        if holds_state(value):
            members = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple, set, frozenset)) else \
                vars(value).values()
            if any(installed(_file_of(m)) for m in list(members)):
                return True
    return False


@contextlib.contextmanager
def library_calls_refused(refused: list[str]) -> Iterator[Callable[[], None]]:
    """While the block runs, a call from the user's code (through Python's own, as
    ``functools`` calls) into an installed package's Python code raises ``CaptureError``
    before the callee's first line, and is named in ``refused``. Python unsets a profile
    function that raises: the block gets a function that sets it again (after catching
    the refusal, to go on watching)."""
    outer = sys.getprofile()

    def profile(frame: types.FrameType, event: str, arg: Any) -> None:
        if outer is not None:
            outer(frame, event, arg)
        if event != "call" or not installed(frame.f_code.co_filename):
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename.startswith(_STDLIB):
            caller = caller.f_back
        if caller is None or not user_code(caller.f_code.co_filename) or \
                installed(caller.f_code.co_filename):
            return
        where = user_frame(traceback.extract_stack(caller))
        package = os.path.abspath(frame.f_code.co_filename)
        package = next(package[len(d):] for d in SITE_DIRS if package.startswith(d))
        what = (f"a call of {frame.f_code.co_qualname} in the installed package "
                f"{package.split(os.sep)[0].removesuffix('.py')!r} at {where}")
        refused.append(what)
        raise CaptureError(f"a hook makes {what}")

    sys.setprofile(profile)
    try:
        yield lambda: sys.setprofile(profile)
    finally:
        sys.setprofile(outer)
