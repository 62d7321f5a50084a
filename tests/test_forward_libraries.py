"""A call forward makes into an installed package for its effect (``bar.update(1)`` on a
``tqdm`` bar, ``yaml.safe_dump`` into a stream, a logging function handed the loss),
refused at compile with nothing changed (issue 35; ``passes/library_writes.py``): capture
runs forward once, so the call would be made once, there, and never in a step. Calls that
compute (numpy on Python numbers, a package's function given traced values that returns
traced values, as einops' do) are made and traced, exact against eager.

A package the tests write to a temporary folder is taken as installed, as in
``test_library_state.py``. Plan: 7 rows over 2 systems, MBS 2, float64.
"""

from __future__ import annotations

import copy
import importlib
import io
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_library_state import _assert_step_like_eager as assert_step_like_eager
from test_library_state import _batch

import mbcompile
from mbcompile.errors import CaptureError
from mbcompile.passes import library_calls, sources, whose_code

tqdm = pytest.importorskip("tqdm")
yaml = pytest.importorskip("yaml")
np = pytest.importorskip("numpy")

_PACKAGE = '''
RECORDS = []


def scale_rows(h, by):
    """Computes: traced values in, traced values out (as einops' functions)."""
    return h * by


def log(values) -> None:
    RECORDS.append(values)


def log_unannotated(values):
    RECORDS.append(values)


def log_or_reduce(values, reduce=False):
    """Returns a value on one path: whether it returns none is known only as it returns."""
    if reduce:
        return values["loss"] * 2
    RECORDS.append(values)


def checked(h):
    raise ValueError("rows must be sorted")
'''

BAR = tqdm.tqdm(total=100, file=io.StringIO(), mininterval=0)
STREAM = io.StringIO()
FAKE: Any = None  # the fake installed package, set by the fixture


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``fake_metrics_lib``, a module the walks take as an installed package's."""
    global FAKE
    (tmp_path / "fake_metrics_lib.py").write_text(textwrap.dedent(_PACKAGE))
    folder = str(tmp_path) + os.sep
    monkeypatch.syspath_prepend(str(tmp_path))
    for owner in (sources, library_calls):
        monkeypatch.setattr(owner, "SITE_DIRS", (*sources.SITE_DIRS, folder))
    monkeypatch.setattr(whose_code, "_NOT_USERS", (*whose_code._NOT_USERS, folder))
    monkeypatch.setattr(whose_code, "_USER", {})
    monkeypatch.setattr(library_calls, "_INSTALLED", {})
    FAKE = importlib.import_module("fake_metrics_lib")
    yield FAKE
    FAKE = None
    sys.modules.pop("fake_metrics_lib", None)


class _Logged(nn.Module):
    """Makes one library call in forward, chosen by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.how = how
        self.bar = tqdm.tqdm(total=100, file=io.StringIO(), mininterval=0)
        self.loggers = {"progress": [self.bar]}  # a package's object two levels down
        self.path = ""  # where np.save writes

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.lin(x), y)
        if self.how == "global bar":
            BAR.update(1)
        elif self.how == "own bar":
            self.bar.update(x.shape[0])
        elif self.how == "deep bar":
            self.loggers["progress"][0].update(1)
        elif self.how == "np.save":
            np.save(self.path, np.zeros(2))
        elif self.how == "yaml":
            yaml.dump({"calls": 1}, STREAM)
        elif self.how == "log":
            FAKE.log({"loss": loss.detach()})
        elif self.how == "log unannotated":
            FAKE.log_unannotated({"loss": loss.detach()})
        elif self.how == "log or reduce":
            FAKE.log_or_reduce({"loss": loss.detach()})
        elif self.how == "raises":
            FAKE.checked(loss)
        return loss


class _Hooked(nn.Module):
    """A submodule of the user's, traced, whose forward hook updates a bar."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 1))
        self.inner = _Inner()
        self.inner.register_forward_hook(lambda m, a, o: BAR.update(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.inner(self.block(x)), y)


class _Inner(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h)


@pytest.mark.parametrize(("how", "capture", "package"), [
    ("global bar", "fx", "tqdm"), ("global bar", "export", "tqdm"), ("own bar", "export", "tqdm"),
    ("deep bar", "fx", "tqdm"), ("yaml", "fx", "yaml"), ("log", "export", "fake_metrics_lib"),
    ("hook", "fx", "tqdm")])
def test_a_call_made_for_its_effect_is_refused_with_nothing_changed(fake, how, capture,
                                                                    package):
    """Refused at compile, naming the package, the line and the fixes; the bar's count, the
    stream, the package's records, the parameters and their gradients as they were."""
    torch.manual_seed(0)
    model = (_Hooked() if how == "hook" else _Logged(how)).double()
    params = [p.detach().clone() for p in model.parameters()]
    n, own = BAR.n, getattr(model, "bar", BAR).n
    with pytest.raises(CaptureError) as refusal:
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture=capture)
    message = str(refusal.value)
    assert f"installed package {package!r}" in message, message
    assert "test_forward_libraries.py" in message and "training loop" in message
    assert "print or logging" in message
    assert BAR.n == n and getattr(model, "bar", BAR).n == own
    assert STREAM.getvalue() == "" and fake.RECORDS == []
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))


def test_a_file_a_package_writes_is_refused_before_it_is_written(tmp_path):
    """``np.save(path, ...)``: numpy computes, but its file writers open a file: refused
    there, the file not written."""
    model = _Logged("np.save").double()
    model.path = str(tmp_path / "h.npy")
    with pytest.raises(CaptureError, match="opens a file"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture="fx")
    assert not os.path.exists(model.path)


def test_a_logging_call_given_the_loss_is_refused_before_it_runs(fake):
    """Not declared to return None, but its code returns nothing else (read from its
    bytecode): refused before it runs, the package's own list and the model unchanged."""
    torch.manual_seed(0)
    model = _Logged("log unannotated").double()
    with pytest.raises(CaptureError, match="returns nothing but None"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture="fx")
    assert fake.RECORDS == []
    assert all(p.grad is None for p in model.parameters())


def test_a_call_that_returns_none_on_one_path_is_refused_as_it_returns(fake):
    """Code that returns a value on another path: made (it might compute), and refused when
    it returns nothing traced (the package's list holds what the trace handed it, once, as
    the message says); an error the package raises is the one named, not "returns none"."""
    torch.manual_seed(0)
    model = _Logged("log or reduce").double()
    with pytest.raises(CaptureError, match="returns none"):
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture="fx")
    assert len(fake.RECORDS) == 1
    assert all(p.grad is None for p in model.parameters())
    model.how = "raises"
    with pytest.raises(CaptureError, match="rows must be sorted") as failure:
        mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture="fx")
    assert "returns none" not in str(failure.value)


class _Computes(nn.Module):
    """Calls that compute: numpy on Python numbers, a package's function on traced values.
    The forward also names a bar (in a branch not taken), so the calls are watched."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.log = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.log:
            BAR.update(1)
        h = FAKE.scale_rows(self.lin(x), float(np.prod((2, 3))) / float(np.sqrt(4.0)))
        return F.mse_loss(h, y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_calls_that_compute_are_made_and_exact(fake, capture):
    torch.manual_seed(0)
    model = _Computes().double()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=_batch(), capture=capture)
    assert_step_like_eager(cm, model, ref)
    assert BAR.n == 0
