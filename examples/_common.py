"""Shared by the example scripts: compile, print the plan, check against eager."""

from __future__ import annotations

import sys

import torch

import mbcompile
from mbcompile.check import compare_to_eager


def run(make, gbs: int, num_csx: int, mbs: object) -> None:
    model, batch = make(gbs, dtype=torch.float64)
    cm = mbcompile.compile(model, gbs, num_csx, mbs, example_inputs=batch)
    print(cm.plan)
    print()
    report = compare_to_eager(model, cm, batch)
    print(f"compiled vs eager full batch (float64): {report}")
    sys.exit(0 if report.max_relative_error <= 1e-10 else 1)
