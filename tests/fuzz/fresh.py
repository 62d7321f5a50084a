"""Module-level state of a model's own: each construct of ``globalstate.py`` is built from a
fresh copy of that file (and of ``global_helpers.py``), so that the compiled model and its
eager reference, built alike, never share a global, yet forward reads and writes true
module globals (``LOAD_GLOBAL``, ``global N``, ``helpers.SCALE``) as users write them."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path
from typing import Any

import torch

_COPIES = itertools.count()


def fresh_module(name: str) -> types.ModuleType:
    """A new module object run from ``fuzz/<name>.py``: globals of its own."""
    path = Path(__file__).with_name(f"{name}.py")
    full = f"{__package__}._{name}_copy{next(_COPIES)}"
    spec = importlib.util.spec_from_file_location(full, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module  # dataclasses and pickling look classes up by module name
    spec.loader.exec_module(module)
    return module


def state_value(value: Any) -> Any:
    """A comparable image of a global: a namespace's attributes, a generator's state."""
    if isinstance(value, types.SimpleNamespace):
        return dict(vars(value))
    if isinstance(value, torch.Generator):
        return value.get_state().tolist()
    return value


def module_state(*modules: types.ModuleType) -> dict[str, Any]:
    """The globals of ``modules`` that are state (upper-case names, as constants are written):
    numbers, containers, namespaces, generators; by ``module.NAME``."""
    return {f"{m.__name__.rpartition('_copy')[0].rpartition('._')[2]}.{k}": state_value(v)
            for m in modules for k, v in vars(m).items() if k.isupper() and not callable(v)}
