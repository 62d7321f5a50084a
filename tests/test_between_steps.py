"""What users change between steps, found by a hunt: each was silent or crashed before.

- A torch layer fx calls whole had its settings read once by the batch rules: a loss's
  ``reduction`` changed from "mean" to "sum" after compile kept the mean (1.036 against
  eager's 8.289, every gradient 8x off), and a softmax's ``dim`` moved onto the batch
  kept the per-sample split (0.0998 against 0.2705). They are guarded now
  (``passes/layer_settings.py``); what only the layer's forward reads stays live.
- A numpy float64 attribute (``np.cos`` of a schedule) crashed every call: fx wrote
  ``np.float64(0.5)`` into code that has no ``np``.
- ``torch.nn.utils.prune`` before or after compile crashed inside mbcompile (deepcopy of
  its computed weight).

Each step is compared with eager's: the loss, every ``.grad`` (None too) and the
parameters after an optimizer step.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import prune

import mbcompile

DTYPE = torch.float64
GBS, NUM_CSX, MBS = 8, 2, 2
TOL = 1e-12


class Criterion(nn.Module):
    """A loss layer and a softmax layer, both leaves of the fx graph."""

    def __init__(self, crit: nn.Module) -> None:
        super().__init__()
        self.lin, self.sm, self.crit = nn.Linear(4, 3), nn.Softmax(dim=-1), crit

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.crit(self.sm(self.lin(x)), y)


class Tempered(nn.Module):
    def __init__(self, temp: Any) -> None:
        super().__init__()
        self.lin, self.temp = nn.Linear(4, 3), temp

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x) / self.temp, y)


class Pruned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(torch.tanh(self.inp(x))), y)


def _data(targets: str = "classes") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GBS, 4, generator=g, dtype=DTYPE)
    if targets == "classes":
        return x, torch.randint(0, 3, (GBS,), generator=g)
    return x, torch.rand(GBS, 3, generator=g, dtype=DTYPE)


def _pair(make: Callable[[], nn.Module], **options: Any) -> tuple[nn.Module, nn.Module, Any]:
    torch.manual_seed(0)
    model = make().to(DTYPE)
    eager = copy.deepcopy(model)
    x, y = _data("classes" if not isinstance(getattr(model, "crit", None), nn.MSELoss)
                 else "values")
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y), cost_model=False,
                           **options)
    return model, eager, cm


def _step(model: nn.Module, eager: nn.Module, cm: Any, data: tuple[torch.Tensor, ...],
          opts: tuple[torch.optim.Optimizer, torch.optim.Optimizer]) -> list[str]:
    """One step of each, compared; the RecompileWarnings it raised."""
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = cm(*data)
    want = eager(*data)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, rtol=TOL, atol=TOL), (got, want)
    got.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=TOL, atol=TOL), name
    for opt in opts:
        opt.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p, q, rtol=TOL, atol=TOL)
    return [str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]


def _sgd(*models: nn.Module) -> tuple[torch.optim.Optimizer, ...]:
    return tuple(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models)


@pytest.mark.parametrize("crit, reductions", [
    (nn.CrossEntropyLoss, ("sum",)),
    (nn.MSELoss, ("sum", "none")),
])
def test_a_loss_layers_reduction_changed_after_compile_compiles_again(crit: type,
                                                                      reductions: tuple) -> None:
    model, eager, cm = _pair(lambda: Criterion(crit()))
    opts = _sgd(model, eager)
    data = _data("classes" if crit is nn.CrossEntropyLoss else "values")
    assert _step(model, eager, cm, data, opts) == []
    for reduction in reductions:
        model.crit.reduction = eager.crit.reduction = reduction
        recompiled = _step(model, eager, cm, data, opts)
        assert any("crit.reduction" in w for w in recompiled), recompiled
    model.crit.reduction = eager.crit.reduction = "mean"
    assert _step(model, eager, cm, data, opts) == []  # the first state's compile, kept


def test_a_softmax_layers_dim_moved_onto_the_batch_after_compile_is_eagers() -> None:
    """dim 0 mixes the samples: the step that splits them may not run it."""
    model, eager, cm = _pair(lambda: Criterion(nn.CrossEntropyLoss()))
    opts = _sgd(model, eager)
    _step(model, eager, cm, _data(), opts)
    model.sm.dim = eager.sm.dim = 0
    recompiled = _step(model, eager, cm, _data(), opts)
    assert any("sm.dim" in w for w in recompiled), recompiled


def test_what_only_a_layers_forward_reads_stays_live_without_compiling_again() -> None:
    model, eager, cm = _pair(lambda: Criterion(nn.CrossEntropyLoss()))
    opts = _sgd(model, eager)
    _step(model, eager, cm, _data(), opts)
    for smoothing, ignored in ((0.1, 1), (0.2, 2), (0.0, -100)):
        for m in (model, eager):
            m.crit.label_smoothing, m.crit.ignore_index = smoothing, ignored
        assert _step(model, eager, cm, _data(), opts) == []


@pytest.mark.parametrize("first", [np.float64(0.5), 1.0, np.float32(0.5)],
                         ids=["np.float64", "float", "np.float32"])
def test_a_numpy_scalar_attribute_and_a_numpy_schedule_are_eagers(first: Any) -> None:
    model, eager, cm = _pair(lambda: Tempered(first))
    opts = _sgd(model, eager)
    recompiles = _step(model, eager, cm, _data(), opts)
    for t in range(6):  # a cosine schedule: np.float64 numbers
        model.temp = eager.temp = 0.5 * (1 + np.cos(np.pi * t / 10)) + 0.1
        recompiles += _step(model, eager, cm, _data(), opts)
    assert len(recompiles) <= 3, recompiles  # then the number is fed as a graph input


@pytest.mark.parametrize("capture", ["fx", "export"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_layer_pruned_before_or_after_compile_trains_as_eager(capture: str, when: str) -> None:
    torch.manual_seed(0)
    model = Pruned().to(DTYPE)
    eager = copy.deepcopy(model)  # (a pruned layer's computed weight cannot be deep-copied)
    if when == "before":
        for m in (model, eager):
            prune.l1_unstructured(m.head, "weight", amount=0.5)
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=_data(), cost_model=False,
                           capture=capture)
    opts = _sgd(model, eager)
    _step(model, eager, cm, _data(), opts)
    if when == "after":
        for m in (model, eager):
            prune.l1_unstructured(m.head, "weight", amount=0.5)
            m.zero_grad(set_to_none=True)
        opts = _sgd(model, eager)  # weight_orig is a new parameter
    for _ in range(2):
        _step(model, eager, cm, _data(), opts)
        # the plain weight the pre-hook computes holds this step's value, as eager's
        assert torch.allclose(model.head.weight, eager.head.weight.detach(), rtol=TOL, atol=TOL)
    assert (model.head.weight == 0).sum() == (eager.head.weight == 0).sum() > 0


class Encoded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.enc(x).mean(1)), y)


def test_a_setting_of_a_layer_inside_a_layer_called_whole_is_guarded() -> None:
    """The rule reads a stack's ``batch_first`` off its attention layer, a child of the
    layer fx calls whole."""
    torch.manual_seed(0)
    model = Encoded().to(DTYPE)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(GBS, 5, 8, generator=g, dtype=DTYPE), torch.randint(0, 3, (GBS,))
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x, y), cost_model=False,
                           capture="fx")
    cm(x, y)
    model.enc.self_attn.batch_first = False
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = cm(x, y)
    assert any("enc.self_attn.batch_first" in str(w.message) for w in seen)
    assert torch.allclose(got, copy.deepcopy(model)(x, y), rtol=TOL, atol=TOL)


class Scaled(nn.Module):
    """A tensor made in forward (``torch.tensor(2.0)``: the default dtype's) and a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.lin(x) * torch.tensor(2.0) + torch.tensor(0.1), y)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_model_cast_after_its_first_step_is_compiled_for_the_new_dtype(capture: str) -> None:
    """``model.to(dtype)`` keeps the Parameter objects, but a graph captured before holds
    casts and constants of the old dtype (Lightning's "64-true", a Trainer's
    ``bf16_full_eval``): the dtype is part of what a graph is kept for."""
    torch.manual_seed(0)
    model = Scaled().float()
    x, y = _data()
    cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_inputs=(x.float(), y),
                           cost_model=False, capture=capture)
    cm(x.float(), y).backward()
    model.to(DTYPE)
    eager = copy.deepcopy(model)
    before = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)  # as Lightning's "64-true" runs fit
    try:
        recompiled = _step(model, eager, cm, _data(), _sgd(model, eager))
        recompiled += _step(model, eager, cm, _data(), _sgd(model, eager))
    finally:
        torch.set_default_dtype(before)
    assert len(recompiled) == 1, recompiled
    # torch.export's graph holds its inputs' dtypes too: the call's float64 input is what
    # compiles it then (as a dtype variant, from the call, with the model as cast)
    said = ("passes torch.float64 for input 'x' where the example passed torch.float32"
            if capture == "export" else "float32 on cpu, now float64 on cpu")
    assert said in recompiled[0], recompiled
