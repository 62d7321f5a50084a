"""An installed package's model code (transformers' modeling files) reads module-level
values too: a flag or a number it names is guarded like a global of the user's
(``passes/library_reach.py``), so changing it after compile compiles again instead of
running the value baked in at compile time.

The tests cannot install a package, so a module written to a temporary folder is taken as
one: the folder is added to the places the walks call installed (site-packages).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from models import rel_err

import mbcompile
from mbcompile.passes import code_reach, library_reach, sources

_SOURCE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

SCALE = 2.0
CLAMP = (None, 4)
REGISTRY = {"scale": 1.0}  # an object of the package's: not looked into


def _scaled(h):
    return h * SCALE


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(x), y)

    def head(self, x):
        return _scaled(self.lin(x)).clamp(max=CLAMP[1])
'''


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``fake_installed_modeling``, a module the walks take as an installed package's."""
    (tmp_path / "fake_installed_modeling.py").write_text(textwrap.dedent(_SOURCE))
    folder = str(tmp_path) + os.sep
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sources, "SITE_DIRS", (*sources.SITE_DIRS, folder))
    monkeypatch.setattr(code_reach, "_NOT_USERS", (*code_reach._NOT_USERS, folder))
    monkeypatch.setattr(code_reach, "_USER", {})  # where each file was classified
    module = importlib.import_module("fake_installed_modeling")
    yield module
    sys.modules.pop("fake_installed_modeling", None)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(7, 4, generator=g, dtype=torch.float64), \
        torch.randn(7, 1, generator=g, dtype=torch.float64)


def _assert_step_like_eager(cm: mbcompile.CompiledModule, model: torch.nn.Module,
                            ref: torch.nn.Module) -> None:
    x, y = _batch()
    for net in (model, ref):
        net.zero_grad(set_to_none=True)
    loss = cm(x, y)
    loss.backward()
    expected = ref(x, y)
    expected.backward()
    assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12


def test_a_module_level_value_of_installed_model_code_is_guarded(installed):
    """``SCALE``, read by a function the model's method calls, and ``CLAMP``, a tuple read
    by the method: each change after compile compiles again (a warning naming it), exact;
    the package's dict is not guarded (its change compiles nothing)."""
    torch.manual_seed(0)
    model = installed.Net().double()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch())
    _assert_step_like_eager(cm, model, ref)
    installed.SCALE = 3.0
    with pytest.warns(mbcompile.RecompileWarning, match="fake_installed_modeling.SCALE"):
        _assert_step_like_eager(cm, model, ref)
    installed.CLAMP = (None, 0.1)
    with pytest.warns(mbcompile.RecompileWarning, match="fake_installed_modeling.CLAMP"):
        _assert_step_like_eager(cm, model, ref)
    installed.REGISTRY["scale"] = 5.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _assert_step_like_eager(cm, model, ref)


def test_transformers_models_have_no_module_level_value_guarded():
    """GPT-2's and Llama's modeling code read no plain module-level value: the walk adds
    no guard to them (their per-call cost is unchanged)."""
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    found: list[str] = []

    class Recorder:
        def slot(self, owner: object, key: str, where: str) -> None:
            found.append(where)

        def enter(self, code: object, space: object) -> bool:
            key = (id(code), id(space))
            if key in seen:
                return False
            seen.add(key)
            return True

    seen: set[tuple[int, int]] = set()
    library_reach.walk_installed_models(model, Recorder(), code_reach._code)
    assert len(seen) > 3  # the walk entered GPT-2's code
    assert found == []
