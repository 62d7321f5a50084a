"""What watching a layer hook's calls into installed packages costs (``passes/library_calls.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_hook_libraries.py [--calls 2000] [--rounds 7]

A layer's hook inside a compiled step is called sandboxed (``hook_sandbox.call_sandboxed``).
Where the walk of its code finds a name bound to an installed package (here ``yaml``), its
calls are watched with ``sys.setprofile``, so that a call into the library is refused
before it runs. Side by side, in one run, µs per call (median of the rounds):

1. the bare call of a hook that only computes;
2. the same hook, sandboxed (it names no library: not watched; the scan that decides
   that, ``names_library``, is included);
3. a hook doing the same work that names ``yaml`` (in a branch not taken), sandboxed and
   watched;
4. ``names_library`` alone, on the layer.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import yaml

from mbcompile.passes.hook_sandbox import call_sandboxed
from mbcompile.passes.library_calls import names_library

STREAM = io.StringIO()


def plain(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    torch.tanh(out).sum()


def naming_yaml(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
    if out is None:  # never: the name alone makes the hook watched
        yaml.safe_dump({}, STREAM)
    torch.tanh(out).sum()


def _per_call(call: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    opts = parser.parse_args()
    layer = nn.Linear(64, 64)
    x = torch.randn(4, 64)
    out = layer(x)
    cases: dict[str, Callable[[], Any]] = {
        "bare call": lambda: plain(layer, (x,), out),
        "sandboxed, not watched": lambda: call_sandboxed(plain, layer, ((x,), out)),
        "sandboxed, watched": lambda: call_sandboxed(naming_yaml, layer, ((x,), out)),
        "names_library(layer)": lambda: names_library([layer]),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(opts.rounds):  # interleaved: the machine's load falls on all alike
        for name, call in cases.items():
            times[name].append(_per_call(call, opts.calls))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, us in median.items():
        print(f"{name:>24}: {us:8.1f} µs per call")
    ratio = median["sandboxed, watched"] / median["sandboxed, not watched"]
    print(f"watched / not watched: {ratio:.2f}x")


if __name__ == "__main__":
    main()
