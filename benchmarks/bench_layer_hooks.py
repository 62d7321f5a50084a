"""What checking a torch layer's hooks inside a step costs (``passes/hook_sandbox.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_layer_hooks.py [--layers 16] [--rounds 5]

Each call of a live layer's hook inside a compiled step is checked: a hook whose code
provably writes nothing runs as it is (``passes/hook_reads.py``); any other is sandboxed,
the Python state reachable from the layer and from the hook recorded, compared after the
call and put back if it changed, with the record of its last clean call on that layer
kept while nothing in it changed (``hook_sandbox._watch``). "before" is the same check
with both shortcuts off (every call sandboxed and walked afresh, as before issue 35's
cost work), measured side by side in the same run:

1. one checked call against the bare call, µs, for a hook that only reads its layer, one
   that calls a builtin (``isinstance``: read-only too, ``hook_reads._PURE_CALLS``) and
   reaches its layer, and one that calls and whose closure holds the whole model (the
   record covers every module: sandboxed), each also sandboxed with its watch kept (what
   a hook that calls anything cost before ``_PURE_CALLS``);
2. a compiled training step of an MLP of ``--layers`` Linear layers (gbs 32 over 2
   systems, MBS 4) with a hook that only computes (``out * 1.0``) on every layer,
   checked, before, and marked ``per_microbatch`` (run unchecked: the hook's own
   cost), against the same step without hooks;
3. the same step of the MLP without hooks of its own, with a global module hook that only
   reads (``register_module_forward_hook``, checked as a layer's hook on each layer call)
   and with it marked ``mbcompile.per_microbatch`` (called as written), against that step
   with the global hooks hidden (``passes/global_hooks.hidden``), in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import live_hooks
from mbcompile.passes import global_hooks, hook_sandbox
from mbcompile.passes.hook_sandbox import call_sandboxed


@contextlib.contextmanager
def shortcuts_off(keep_watch: bool = False) -> Iterator[None]:
    """The check as before the shortcuts: every call sandboxed, its state walked afresh
    (``keep_watch``: only the first shortcut off, each call sandboxed with its watch kept,
    as a hook that calls a builtin was before ``hook_reads`` let it call ``isinstance``)."""
    reads_only, watch = hook_sandbox.reads_only, hook_sandbox._watch
    hook_sandbox.reads_only = live_hooks.reads_only = lambda fn, passed: False
    if not keep_watch:
        hook_sandbox._watch = lambda fn, module, kept: watch(fn, module, None)
    try:
        yield
    finally:
        hook_sandbox.reads_only = live_hooks.reads_only = reads_only
        hook_sandbox._watch = watch


class Net(nn.Module):
    def __init__(self, layers: int, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def _best(fn: Callable[[], Any], n: int, rounds: int) -> float:
    """Best of ``rounds`` of ``n`` calls: seconds per call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return min(times)


def _scaled(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 1.0


def _scaled_marked(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    return out * 1.0


def _step(layers: int, hooked: bool, marked: bool = False) -> Callable[[], None]:
    torch.manual_seed(0)
    model = Net(layers)
    if hooked:  # marked: the same hook run as written, unchecked (its own cost)
        hook = mbcompile.per_microbatch(_scaled_marked) if marked else _scaled
        for layer in model.layers:
            layer.register_forward_hook(hook)
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cm = mbcompile.compile(model, 32, 2, 4, example_inputs=(x, y), cost_model=False)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        cm(x, y).backward()

    step()
    return step


def _reads(module: nn.Module, args: tuple, out: Any) -> None:
    return None


def _before(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with shortcuts_off():
            fn()
    return run


def _alternated(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each of ``fns``, alternating with the order rotating: load hits all
    alike."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(4 * rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(_cpu(fns[name]))
    return times


def _ratios(times: dict[str, list[float]], base: str, what: str) -> None:
    for name in (n for n in times if n != base):
        ratio = statistics.median(h / p for h, p in zip(times[name], times[base]))
        print(f"{what}, {name}: {statistics.median(times[name]) * 1e3:8.2f} ms CPU "
              f"({ratio:.2f}x of {base}, median ratio)")


def _global(layers: int, rounds: int) -> None:
    """Part 3: a read-only global hook, unmarked (now and before) and marked, against none."""
    warnings.simplefilter("ignore", mbcompile.RecompileWarning)  # each hook: compiled once
    register = torch.nn.modules.module.register_module_forward_hook
    step = _step(layers, False)

    def hidden() -> None:
        with global_hooks.hidden():
            step()

    handle = register(_reads)
    step()  # compiled once more: the global hooks are part of the mode key
    times = _alternated({"no global hook": hidden, "unmarked": step,
                         "unmarked, before": _before(step)}, rounds)
    handle.remove()
    handle = register(mbcompile.per_microbatch(_reads))
    step()
    marked = _alternated({"no global hook": hidden, "marked": step}, rounds)
    handle.remove()
    _ratios(times, "no global hook", "step with a read-only global hook")
    _ratios(marked, "no global hook", "step with a read-only global hook")


def _cpu(fn: Callable[[], None]) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def _per_call(layers: int, rounds: int) -> None:
    """Part 1: one checked call of a hook, now and before, against the bare call."""
    model = Net(layers)
    layer, x = model.layers[0], torch.randn(4, 64)
    out = layer(x)

    def reads(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        return None

    def calls(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        return None if isinstance(o, torch.Tensor) else None

    def reaching(m: nn.Module, a: tuple, o: torch.Tensor, model: nn.Module = model) -> None:
        return None if isinstance(model, nn.Module) else None

    for name, hook in (("only reads its layer", reads), ("calls, reaches its layer", calls),
                       ("calls, reaches the model", reaching)):
        kept: hook_sandbox.Kept = {}  # as a step's wrapper of the hook keeps it
        bare = _best(lambda h=hook: h(layer, (x,), out), 200, rounds)
        now = _best(lambda h=hook, k=kept: call_sandboxed(h, layer, ((x,), out), kept=k), 200,
                    rounds)
        with shortcuts_off(keep_watch=True):
            boxed = _best(lambda h=hook, k=kept: call_sandboxed(h, layer, ((x,), out), kept=k),
                          200, rounds)
        with shortcuts_off():
            before = _best(lambda h=hook, k=kept: call_sandboxed(h, layer, ((x,), out), kept=k),
                           200, rounds)
        print(f"hook that {name} ({layers} layers): checked {now * 1e6:8.1f} µs, sandboxed "
              f"(watch kept) {boxed * 1e6:8.1f} µs, before {before * 1e6:8.1f} µs, bare "
              f"{bare * 1e6:6.2f} µs per call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    _per_call(args.layers, args.rounds)
    plain, hooked = _step(args.layers, False), _step(args.layers, True)
    times = _alternated({"no hooks": plain, "hooked": hooked, "hooked, before":
                         _before(hooked), "hooked, marked per_microbatch (unchecked)":
                         _step(args.layers, True, marked=True)}, args.rounds)
    _ratios(times, "no hooks", f"step with a hook on each of {args.layers} layers")
    _global(args.layers, args.rounds)


if __name__ == "__main__":
    main()
