"""What watching forward's calls into installed packages costs a compile.

    OMP_NUM_THREADS=1 python benchmarks/bench_library_writes.py

A forward whose code names a ``tqdm`` bar (in a branch not taken) is captured with its
calls into installed packages watched (``passes/library_writes.py``: ``sys.setprofile``
on the trace), and, side by side in one run, with the watch left off (as for a forward
that names no such package). Printed: the compile's seconds each way (best of two) and
their ratio, for the ``torch.fx`` and the ``torch.export`` capture. Nothing is watched in
a step: the watch costs compile time only.
"""

from __future__ import annotations

import io
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
import tqdm

import mbcompile
from mbcompile.passes import library_writes

BAR = tqdm.tqdm(total=1, file=io.StringIO())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
        self.log = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.log:
            BAR.update(1)  # names tqdm: the trace is watched
        for block in self.blocks:
            x = torch.tanh(block(x))
        return F.mse_loss(x.sum(-1, keepdim=True), y)


def _compile_seconds(capture: str, watched: bool) -> float:
    names = library_writes.names_other_package
    if not watched:
        library_writes.names_other_package = lambda *args: False  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        mbcompile.compile(Net(), 8, 2, 2, example_inputs=(torch.randn(8, 16), torch.randn(8, 1)),
                          capture=capture, cost_model=False)
        return time.perf_counter() - start
    finally:
        library_writes.names_other_package = names


def main() -> None:
    warnings.simplefilter("ignore")
    _compile_seconds("export", False)  # warm up torch.export's own caches
    for capture in ("fx", "export"):
        times: dict[bool, Any] = {True: [], False: []}
        for _ in range(2):
            for watched in (True, False):
                times[watched].append(_compile_seconds(capture, watched))
        on, off = min(times[True]), min(times[False])
        print(f"{capture:6s} compile: watched {on:6.2f} s, not watched {off:6.2f} s "
              f"({on / off:.1f}x)")


if __name__ == "__main__":
    main()
