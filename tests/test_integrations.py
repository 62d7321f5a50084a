"""The training frameworks people use, with a compiled model: each example in ``examples/``
trains three optimizer steps and must equal three plain full-batch steps (float64)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's notes on workers, logging
@pytest.mark.parametrize("name", ["lightning", "accelerate_loop"])
def test_the_example_trains_like_plain_full_batch_steps(name):
    assert _example(name).max_difference() <= 1e-12

