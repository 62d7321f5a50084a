"""Whose code a stack frame is in: torch's, mbcompile's, or the user's.

Errors point at the user's source line, so the frames of torch and of mbcompile
itself (the package and its passes, wherever they are installed) are skipped.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["is_library"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PASSES_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PACKAGE = (__package__ or "").rpartition(".")[0]  # "mbcompile": imported before its passes


def _package_dir() -> str:
    module = sys.modules.get(_PACKAGE)  # never imported from here: the passes depend downward
    path = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else _PASSES_DIR


def is_library(path: str) -> bool:
    """True for frames in torch, in mbcompile's package or its passes, or Python's own."""
    p = os.path.abspath(path)
    return path.startswith("<frozen") or p.startswith((_TORCH_DIR, _PASSES_DIR, _package_dir()))
