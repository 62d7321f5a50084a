"""Whose code a stack frame is in: torch's, mbcompile's, or the user's.

Errors point at the user's source line, so the frames of torch and of mbcompile
itself (the package and its passes, wherever they are installed) are skipped.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import site
import sys
import sysconfig
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import traceback

    import torch.fx as fx

__all__ = ["SITE_DIRS", "installed_package", "is_library", "source_line", "user_frame",
           "user_stacklevel"]

# found without importing torch: plan arithmetic warns through here and stays torch-free
_TORCH_DIR = os.path.dirname(os.path.abspath(importlib.util.find_spec("torch").origin)) + os.sep
_PASSES_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE = (__package__ or "").rpartition(".")[0]  # "mbcompile": imported before its passes


#: where installed packages live (the venv's site-packages, the user's, the system's)
SITE_DIRS: tuple[str, ...] = tuple({
    os.path.abspath(p) + os.sep
    for p in (*(sysconfig.get_paths()[k] for k in ("purelib", "platlib")),
              *getattr(site, "getsitepackages", list)())})


def installed_package(path: str | None) -> bool:
    """A file of an installed package (site-packages: transformers') other than torch and
    mbcompile."""
    return bool(path) and os.path.abspath(path).startswith(SITE_DIRS) and \
        not is_library(path)  # type: ignore[arg-type]


def _package_dir() -> str:
    module = sys.modules.get(_PACKAGE)  # never imported from here: the passes depend downward
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else _PASSES_DIR


def is_library(path: str) -> bool:
    """True for frames in torch, in mbcompile's package or its passes, or Python's own."""
    # a trace asks about the same few files at every node (the log and print watches, the
    # stacks): an absolute path's answer is kept, a relative one depends on the directory
    return _library_file(path) if os.path.isabs(path) else _is_library(path)


def _is_library(path: str) -> bool:
    p = os.path.abspath(path)
    return path.startswith("<frozen") or p.startswith((_TORCH_DIR, _PASSES_DIR, _package_dir()))


_library_file = functools.lru_cache(maxsize=4096)(_is_library)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*(?:\n\s*(?!File ")([^\n]*))?')


def source_line(node: fx.Node) -> str:
    """``file:line: code`` of the innermost frame outside torch and mbcompile.

    For a model that calls a block that calls the op, that is the op's own line
    in the block, the one to change.
    """
    frames = _FRAME.findall(node.stack_trace or "")
    for path, line, code in reversed(frames):
        if not is_library(path):
            return f"{path}:{line}: {code.strip()}" if code else f"{path}:{line}"
    return "<source line not recorded>"


def user_frame(tb: traceback.StackSummary | list[traceback.FrameSummary]) -> str:
    """The innermost frame of ``tb`` outside torch and mbcompile, as ``file:line: code``
    (where a refused call was made: capture's traced frames, a custom Function's apply)."""
    for frame in reversed(list(tb)):
        f = os.path.abspath(frame.filename)
        if is_library(f):
            continue
        return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown source line>"


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by this function's caller that names
    the first frame outside torch and mbcompile: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
