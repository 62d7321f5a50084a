"""Every warning names the user's line: the call in this file, not a line of mbcompile or torch.

Each case triggers one warning class the way a user's script does and checks the
``filename`` warnings report (what a terminal prints before the message).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.models import make_mlp


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.scale = nn.Linear(8, 3), 1.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.scale * F.mse_loss(self.lin(x), y)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8), torch.randn(n, 3)


def _adjusted_mbs() -> None:
    model, batch = make_mlp(16)
    mbcompile.compile(model, 16, 2, 6, example_inputs=batch)  # pbs 8: 6 is not supported


def _retained_activations() -> None:
    x = torch.randn(8, 8)
    cm = mbcompile.compile(nn.Linear(8, 3), 8, 2, 2, example_inputs=(x,))  # no loss inside
    cm(x)


def _recompiled() -> None:
    model = _Scaled()
    batch = _batch(8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch)
    model.scale = 2.0
    cm(*batch)


def _per_microbatch_statistics() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    mbcompile.compile(model, 8, 2, 2, example_inputs=(torch.randn(8, 8),),
                      batch_norm="per_microbatch")


@pytest.mark.parametrize("trigger, kind", [
    (_adjusted_mbs, mbcompile.MbsAdjustedWarning),
    (_retained_activations, mbcompile.RetainedActivationsWarning),
    (_recompiled, mbcompile.RecompileWarning),
    (_per_microbatch_statistics, mbcompile.PerMicrobatchStatisticsWarning),
], ids=lambda v: getattr(v, "__name__", "").strip("_"))
def test_the_warning_points_at_the_users_line(trigger: Callable[[], None], kind: type) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trigger()
    mine = [w for w in caught if issubclass(w.category, kind)]
    assert mine, f"no {kind.__name__} was raised"
    assert all(w.filename == __file__ for w in mine), [(w.filename, w.lineno) for w in mine]
