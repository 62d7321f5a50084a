"""Whose code a file or object is: the user's, or a library's (torch's, mbcompile's, Python's
own, an installed package's).

The walks of forward's code (``code_reach``), its guards and its watches of library calls
(``library_calls``, ``library_writes``) enter only the user's code and look into only the
user's state: a library's module-level values are taken as constants (docs/limits.md).

>>> user_code(os.__file__), holds_state({"n": 1}), holds_state(print)
(False, True, False)
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch.nn as nn

from .sources import SITE_DIRS, is_library

__all__ = ["holds_state", "user_code", "user_instance"]

#: Python's own modules, and installed packages (site-packages: transformers), whose code is
#: a library's: their module-level values are taken as constants (docs/limits.md)
_NOT_USERS = (os.path.dirname(os.path.abspath(os.__file__)) + os.sep, *SITE_DIRS)


def user_code(path: str | None) -> bool:
    """A file of the user's, not torch's, mbcompile's, Python's own or an installed
    package's."""
    if not path:
        return False
    found = _USER.get(path)
    if found is None:
        found = _USER[path] = not is_library(path) and \
            not os.path.abspath(path).startswith(_NOT_USERS)
    return found


_USER: dict[str, bool] = {}


def holds_state(value: Any) -> bool:
    """Whether what ``value`` holds is the user's state, looked into (a container, a
    namespace, an object of the user's class), not a library's object (a logger)."""
    if isinstance(value, (dict, list, tuple, set, frozenset, types.SimpleNamespace)):
        return True
    return not isinstance(value, (types.FunctionType, types.ModuleType)) and \
        user_instance(value)


def user_instance(value: Any) -> bool:
    """An object of a class the user's code defines (not a module, not a class)."""
    kind = type(value)
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type))
            and user_code(getattr(sys.modules.get(kind.__module__), "__file__", None)))
