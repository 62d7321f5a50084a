"""An object (not a tensor) handed to forward as an argument, or held by the model, is
looked into as the model's own state is (issue 35): what forward reads of it is fixed in
the graph, so a change in place is refused before the call runs; a call it leads into an
installed package for its effect (``logger.log(loss)`` writing with ``yaml``) is refused at
compile, before it runs; a global its methods read is guarded.

Exactness against an eager step on a deep copy, 3 steps with an optimizer step each:
7 rows over 2 systems, MBS 2, float64, ``capture="fx"`` (``torch.export`` refuses such an
argument as an input).
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import rel_err
from test_library_state import _batch

import mbcompile
from mbcompile.errors import CaptureError, InputError

yaml = pytest.importorskip("yaml")

SCALE = 2.0  # read by a method of an object forward is handed or holds


class Config:
    """A plain object of the user's: forward reads its attributes and calls its method."""

    def __init__(self) -> None:
        self.temp = 2.0
        self.flags = {"hard": False}

    def scale(self) -> float:
        return SCALE


class YamlLogger:
    """The user's logger that writes through an installed package (``yaml``)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()

    def log(self, loss: torch.Tensor) -> None:
        yaml.safe_dump({"step": 1}, self.stream)


class Reads(nn.Module):
    """Reads an argument's attributes and its nested dict; ``held``: reads its own config's
    method instead."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.config = Config() if held else None

    def forward(self, x: torch.Tensor, y: torch.Tensor, cfg: Any = None) -> torch.Tensor:
        cfg = cfg or self.config
        loss = F.mse_loss(self.lin(x), y) * cfg.temp * cfg.scale()
        return loss * 2 if cfg.flags["hard"] else loss


class Logs(nn.Module):
    """Hands the loss to a logger: an argument's, or one it holds (``held``)."""

    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.logger = YamlLogger() if held else None

    def forward(self, x: torch.Tensor, y: torch.Tensor, logger: Any = None) -> torch.Tensor:
        loss = F.mse_loss(self.lin(x), y)
        (logger or self.logger).log(loss)
        return loss


def _steps_like_eager(cm: mbcompile.CompiledModule, model: nn.Module, ref: nn.Module,
                      *extra: Any, steps: int = 3) -> None:
    """``steps`` training steps of ``cm`` and of eager ``ref``: the same loss, gradients and
    parameters after each SGD step."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(steps):
        x, y = _batch()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss, expected = cm(x, y, *extra), ref(x, y, *extra)
        loss.backward()
        expected.backward()
        assert rel_err(loss.detach(), expected.detach(), 1e-3) < 1e-12
        for opt in opts:
            opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad, 1e-3) < 1e-12 and rel_err(p, q, 1e-3) < 1e-12


@pytest.mark.parametrize("change", ["attribute", "nested dict"])
def test_an_argument_changed_in_place_is_refused_before_the_call_runs(change):
    """Exact while the argument holds what it held at compile; changed in place (the same
    object, so ``is`` it still), the call is an ``InputError`` naming the argument and
    the fixes, with the parameters and their gradients as they were."""
    torch.manual_seed(0)
    model, cfg = Reads().double(), Config()
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(*_batch(), cfg), capture="fx")
    _steps_like_eager(cm, model, ref, cfg)
    if change == "attribute":
        cfg.temp = 0.5
    else:
        cfg.flags["hard"] = True
    params = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(InputError, match="argument 'cfg' changed in place") as refusal:
        cm(*_batch(), cfg)
    assert "as a tensor" in str(refusal.value) and "keep it on the model" in str(refusal.value)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("held", [False, True])
def test_a_global_a_method_of_an_object_reads_is_guarded(held):
    """``cfg.scale()`` returns the global ``SCALE``, for an object forward is handed or one
    the model holds: changing the global compiles again (a warning naming it), exact."""
    global SCALE
    torch.manual_seed(0)
    model, cfg = Reads(held).double(), Config()
    extra = () if held else (cfg,)
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=(*_batch(), *extra), capture="fx")
    try:
        _steps_like_eager(cm, model, ref, *extra, steps=1)
        SCALE = 0.5
        with pytest.warns(mbcompile.RecompileWarning, match="SCALE"):
            _steps_like_eager(cm, model, ref, *extra, steps=1)
    finally:
        SCALE = 2.0


@pytest.mark.parametrize("held", [False, True])
def test_a_logger_that_writes_through_a_package_is_refused_before_it_writes(held):
    """``logger.log(loss)``, whose method calls ``yaml.safe_dump`` into a stream, for a
    logger forward is handed or one the model holds: refused at compile, naming the
    package and the training-loop fix; the stream, parameters and gradients unchanged."""
    torch.manual_seed(0)
    model, logger = Logs(held).double(), YamlLogger()
    extra = () if held else (logger,)
    params = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(), pytest.raises(CaptureError) as refusal:
        mbcompile.compile(model, 7, 2, 2, example_inputs=(*_batch(), *extra), capture="fx")
    message = str(refusal.value)
    assert "installed package 'yaml'" in message and "training loop" in message, message
    assert (model.logger if held else logger).stream.getvalue() == ""
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
