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
from mbcompile.passes import sources, whose_code

_SOURCE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

SCALE = 2.0
CLAMP = (None, 4)
ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid}  # a registry: its entries
UNREAD = {"scale": 1.0}  # named by no code of the model's: not guarded


class Interface:
    """A registry object, as transformers' ``AttentionInterface``: a mapping the class
    shares, and one of the instance's own that overrides it."""

    _shared = {"offset": 0.0}

    def __init__(self):
        self._own = {}

    def get(self, key):
        return self._own.get(key, self._shared.get(key))


OFFSETS = Interface()


class Recorder:
    """A plain object a registry's entry holds (as transformers' ``OutputRecorder``)."""

    def __init__(self, factor):
        self.factor = factor


#: entries that hold containers and objects (as ``ACT2FN["gelu_10"]``'s keyword dict)
CLIPS = {"clip": (torch.clamp, {"min": -10.0, "max": 10.0}), "by": [Recorder(1.0)]}


class Matches:
    """An object whose own ``==`` says equal to anything: no copy of it can be compared."""

    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


ODD = {"odd": [Matches()]}


def _scaled(h):
    clamp, bounds = CLIPS["clip"]
    h = clamp(ACTIVATIONS["tanh"](h * SCALE), **bounds) * CLIPS["by"][0].factor
    return h + OFFSETS.get("offset")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(x), y)

    def head(self, x):
        return _scaled(self.lin(x)).clamp(max=CLAMP[1])


class OddNet(Net):
    def forward(self, x, y):
        return F.mse_loss(self.head(x), y) * len(ODD["odd"])
'''


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``fake_installed_modeling``, a module the walks take as an installed package's."""
    (tmp_path / "fake_installed_modeling.py").write_text(textwrap.dedent(_SOURCE))
    folder = str(tmp_path) + os.sep
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sources, "SITE_DIRS", (*sources.SITE_DIRS, folder))
    monkeypatch.setattr(whose_code, "_NOT_USERS", (*whose_code._NOT_USERS, folder))
    monkeypatch.setattr(whose_code, "_USER", {})  # where each file was classified
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
    a dict the code does not name is not guarded (its change compiles nothing)."""
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
    installed.UNREAD["scale"] = 5.0
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        _assert_step_like_eager(cm, model, ref)


def test_a_registry_of_installed_model_code_is_guarded_by_its_entries(installed):
    """An entry of a module-level dict replaced, and a registry object's mappings (its own,
    its class's) written after compile: each compiles again, exact, as eager follows it;
    the same entries put back are the first compile's state again."""
    torch.manual_seed(0)
    model = installed.Net().double()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch())
    _assert_step_like_eager(cm, model, ref)
    installed.ACTIVATIONS["tanh"] = torch.sigmoid
    with pytest.warns(mbcompile.RecompileWarning, match="ACTIVATIONS changed"):
        _assert_step_like_eager(cm, model, ref)
    installed.OFFSETS._own["offset"] = 0.5  # the instance's own mapping
    with pytest.warns(mbcompile.RecompileWarning, match="OFFSETS._own changed"):
        _assert_step_like_eager(cm, model, ref)
    installed.Interface._shared["offset"] = 0.25  # the class's: shadowed here, still guarded
    with pytest.warns(mbcompile.RecompileWarning, match="Interface._shared changed"):
        _assert_step_like_eager(cm, model, ref)


def test_what_a_registry_entry_holds_is_guarded_deeper(installed):
    """A dict inside an entry's tuple, and a plain object inside an entry's list, changed in
    place after compile: each compiles again (a warning naming the registry), exact, as
    eager follows it. An entry holding an object whose own ``==`` answers for a copy cannot
    be guarded: refused at compile, naming it, with the parameters unchanged."""
    torch.manual_seed(0)
    model = installed.Net().double()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch())
    _assert_step_like_eager(cm, model, ref)
    installed.CLIPS["clip"][1]["max"] = 0.05
    with pytest.warns(mbcompile.RecompileWarning, match="CLIPS changed"):
        _assert_step_like_eager(cm, model, ref)
    installed.CLIPS["by"][0].factor = 3.0
    with pytest.warns(mbcompile.RecompileWarning, match="CLIPS changed"):
        _assert_step_like_eager(cm, model, ref)
    odd = installed.OddNet().double()
    with pytest.raises(mbcompile.CaptureError, match="ODD, an installed package's container"):
        mbcompile.compile(odd, 7, 2, 2, example_inputs=_batch())
    assert all(p.grad is None for p in odd.parameters())


class _Attending(torch.nn.Module):
    """A model of the user's around one transformers attention layer (its decorated
    ``forward`` reads the attention function from ``ALL_ATTENTION_FUNCTIONS``)."""

    def __init__(self, tf):
        super().__init__()
        config = tf.GPT2Config(n_embd=8, n_head=2, attn_pdrop=0.0, resid_pdrop=0.0,
                               attn_implementation="sdpa")
        self.attn = tf.models.gpt2.modeling_gpt2.GPT2Attention(config)

    def forward(self, h, y):
        return torch.nn.functional.mse_loss(self.attn(h)[0].sum(-1), y)


def test_an_attention_function_registered_after_compile_is_followed():
    """transformers' ``ALL_ATTENTION_FUNCTIONS["sdpa"] = f`` after compile (its own
    mapping): compiles again, exact against eager with ``f``; taken back (``del``), the
    first compile's state again, without a compile."""
    tf = pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def halved(*args, **kwargs):
        out, weights = sdpa_attention_forward(*args, **kwargs)
        return out * 0.5, weights

    torch.manual_seed(0)
    model = _Attending(tf).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(7, 3, 8, generator=g, dtype=torch.float64),
             torch.randn(7, 3, generator=g, dtype=torch.float64))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)
    first = cm(*batch).detach()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = halved
    try:
        with pytest.warns(mbcompile.RecompileWarning, match="ALL_ATTENTION_FUNCTIONS._local"):
            loss = cm(*batch)
        expected = ref(*batch)
        loss.backward()
        expected.backward()
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert rel_err(loss.detach(), expected.detach()) < 1e-12 and rel_err(loss, first) > 1e-6
    for p, q in zip(model.parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad, 1e-3) < 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("error", mbcompile.RecompileWarning)
        assert torch.equal(cm(*batch).detach(), first)
