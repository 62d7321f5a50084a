"""Per-call cost of the guards: the Python values a compiled module checks before each step.

    OMP_NUM_THREADS=1 python benchmarks/bench_guards.py [--calls 20000]

A model whose forward reads about 30 guarded values (numbers and flags on several
layers, an enum, a dict of flags, a config object, a module-level constant, helper
methods, and through a helper function: a module-level dict and a closure's variable) is
compiled; then, side by side in one run:

1. the guard check alone, µs per call (goal: at most 20 µs): ``fast_check(guards)()``, the
   guards as one function (``passes/guard_code.py``), which a call runs, beside
   ``failed_guard(guards)``, each guard asked in turn (what a call ran before, and still
   runs to name the guard that failed when the fast check says no);
2. ``CompiledModule._compiled()``: the whole lookup a call makes before it runs the graph
   (the mode key, the cache of guarded states, the guards), µs per call;
3. one eager forward of the model under ``no_grad`` for scale, and the ratio of (2) to it;
4. with transformers installed, a tiny GPT-2's guard check, beside the check of its guards
   on what transformers' own code reads at module level alone (its flags, and its
   registries by their entries: ``ALL_ATTENTION_FUNCTIONS``, ``passes/library_reach.py``),
   and the guard on its config alone (a ``PretrainedConfig`` of some 40 values and two
   dicts, compared by value);
5. with ``--before REV``: sections 1 and 4's checks as ``passes/guard_code.py`` at git
   revision ``REV`` writes them, in turns with today's, on the same guards.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.passes.guard_code import fast_check
from mbcompile.passes.guards import failed_guard

SCALE = 1.0  # a module-level constant forward reads
SETTINGS = {"weight": 1.0, "center": False}  # a module-level dict a helper function reads


def _make_shift(shift: float):
    def shifted(loss: torch.Tensor) -> torch.Tensor:
        return loss + shift  # a closure's variable
    return shifted


SHIFT = _make_shift(0.0)


def weighted(loss: torch.Tensor) -> torch.Tensor:
    """A helper function forward calls: its globals are guarded too (passes/code_reach.py)."""
    return SHIFT(loss * SETTINGS["weight"])


class Mode(enum.Enum):
    SOFT = "soft"
    HARD = "hard"


@dataclass
class Config:
    beta: float = 0.5
    hidden: int = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.alpha, self.use_skip, self._gain = 1.0, True, 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x)) * self.alpha * self._gain
        return h + x if self.use_skip else h


class Net(nn.Module):
    def __init__(self, depth: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(16, 3)
        self.mode, self.cfg = Mode.SOFT, Config()
        self.flags = {"clip": False, "scale_loss": True}
        self.temp = 1.0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * SCALE * self.cfg.beta

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out = self.head(x) / self.temp
        if self.mode is Mode.HARD or self.flags["clip"]:
            out = out.clamp(-1, 1)
        loss = F.mse_loss(out, y)
        return weighted(self.scaled(loss) if self.flags["scale_loss"] else loss)


def _per_call(fn, calls: int) -> float:
    """Median over 5 rounds of the µs one call of ``fn`` takes."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(rounds)[2]


def _fast_check_at(rev: str) -> Callable[[Sequence[Any]], Callable[[], bool]]:
    """``fast_check`` as ``passes/guard_code.py`` at git revision ``rev`` writes it (run
    against today's guards and guard values)."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:passes/guard_code.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("mbcompile.passes._guard_code_before", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    module.__package__ = "mbcompile.passes"
    exec(compile(text, f"{rev}:passes/guard_code.py", "exec"), vars(module))  # noqa: S102
    return module.fast_check


def _side_by_side(label: str, guards: Sequence[Any], before: Callable | None, calls: int
                  ) -> None:
    """Today's check and ``before``'s of ``guards`` in 21 short rounds, in turns (a loaded
    machine hits both alike): µs per call, median and best round, and the ratio."""
    if before is None:
        return
    checks = {"now": fast_check(guards), "before": before(guards)}
    assert all(check() for check in checks.values())
    times: dict[str, list[float]] = {"now": [], "before": []}
    n = max(calls // 20, 100)
    for _ in range(21):
        for name, check in checks.items():
            start = time.perf_counter()
            for _ in range(n):
                check()
            times[name].append((time.perf_counter() - start) / n * 1e6)
    mid = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"{label}: now {mid['now']:6.2f} µs (best {best['now']:.2f}), before "
          f"{mid['before']:6.2f} µs (best {best['before']:.2f}) per call; before / now "
          f"{mid['before'] / mid['now']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--before", metavar="REV", help="also time guard_code.py at REV")
    args = parser.parse_args()
    before = _fast_check_at(args.before) if args.before else None
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 16), torch.randn(8, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 8, 2, 2, example_inputs=(x, y), cost_model=False)
    guards = cm._compiled().guards
    fast = fast_check(guards)
    assert failed_guard(guards) is None and fast()
    check = _per_call(fast, args.calls)
    each = _per_call(lambda: failed_guard(guards), args.calls)
    lookup = _per_call(cm._compiled, args.calls)
    with torch.no_grad():
        eager = _per_call(lambda: model(x, y), max(args.calls // 20, 50))
    print(f"guards checked per call: {len(guards)}")
    print(f"guard check:     {check:7.2f} µs per call (goal <= 20 µs; one function)")
    print(f"each guard asked:{each:7.2f} µs per call ({each / check:.1f}x the check)")
    print(f"whole lookup:    {lookup:7.2f} µs per call")
    print(f"eager forward:   {eager:7.2f} µs per call (no_grad, for scale)")
    print(f"lookup / eager forward: {lookup / eager:.3f}")
    _side_by_side("guard check", guards, before, args.calls)
    _transformers_guards(args.calls, before)


def _transformers_guards(calls: int, before: Callable | None) -> None:
    """Section 4: a tiny GPT-2 LM's guard check, and that of its guards on transformers'
    code alone."""
    try:
        import transformers as tf
    except ImportError:
        return
    tf.logging.set_verbosity_error()
    config = tf.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=16,
                           attn_implementation="sdpa")
    model = tf.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (8, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 8, 2, 2, example_inputs=(ids,), cost_model=False)
    guards = cm._compiled().guards
    package = [g for g in guards if "transformers." in g.where]  # on the package's code
    full, alone = _per_call(fast_check(guards), calls), _per_call(fast_check(package), calls)
    print(f"GPT-2 guards: {len(guards)}, {len(package)} on transformers' code")
    config = [g for g in guards if g.name == "config" and g.contents is not None]
    print(f"GPT-2 guard check:{full:7.2f} µs per call; those on transformers' code alone: "
          f"{alone:.2f} µs ({alone / full:.2f} of it); the config's alone: "
          f"{_per_call(fast_check(config), calls):.2f} µs")
    _side_by_side(f"GPT-2 guard check ({len(guards)} guards)", guards, before, calls)
    _side_by_side("GPT-2 config guard", config, before, calls)


if __name__ == "__main__":
    main()
