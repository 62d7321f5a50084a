"""What checking a torch layer's hooks inside a step costs (``passes/hook_sandbox.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_layer_hooks.py [--layers 16] [--rounds 5]
        [--before REV]

Each call of a live layer's hook inside a compiled step is checked: a hook whose code
provably writes nothing runs as it is (``passes/hook_reads.py``); any other is sandboxed,
the Python state reachable from the layer and from the hook recorded, compared after the
call and put back if it changed, with the record of its last clean call on that layer
kept while nothing in it changed (``hook_sandbox._watch``). "before" is the same check
with both shortcuts off (every call sandboxed and walked afresh, as before issue 35's
cost work), measured side by side in the same run:

1. one checked call (``call_sandboxed`` with the watch a step's wrapper keeps) against the
   bare call, µs, for a hook that only reads its layer, one that calls a builtin
   (``isinstance``: read-only too, ``hook_reads._PURE_CALLS``), both run without the
   sandbox, one that calls a method (``out.size(0)``) and one that calls a function of the
   user's, both sandboxed, each reaching only its layer, and one that calls and whose
   closure holds the whole model (the record covers every module). Each in a microbatch
   (the sandbox's patches held, as a step holds them: ``sandbox_patches.hold``), through
   the step's wrapper in a microbatch (``live_hooks.WatchedHook``: what a step pays), and
   alone (put in place and back around the call), and with ``--before REV`` as
   ``passes/hook_sandbox.py`` at that git revision checks it, in turns in short rounds
   (CPU time);
2. a compiled training step of an MLP of ``--layers`` Linear layers (gbs 32 over 2
   systems, MBS 4) with a hook that only computes (``out * 1.0``) on every layer,
   checked, before, and marked ``per_microbatch`` (run unchecked: the hook's own
   cost), and with a hook that calls ``out.size(0)`` (sandboxed; also as at ``REV``),
   against the same step without hooks;
3. the same step of the MLP without hooks of its own, with a global module hook that only
   reads (``register_module_forward_hook``, checked as a layer's hook on each layer call)
   and with it marked ``mbcompile.per_microbatch`` (called as written), against that step
   with the global hooks hidden (``passes/global_hooks.hidden``), in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.execution import live_hooks
from mbcompile.passes import global_hooks, hook_sandbox, sandbox_patches
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


def _step(layers: int, hooked: bool, marked: bool = False, hook: Any = _scaled
          ) -> Callable[[], None]:
    torch.manual_seed(0)
    model = Net(layers)
    if hooked:  # marked: the same hook run as written, unchecked (its own cost)
        hook = mbcompile.per_microbatch(_scaled_marked) if marked else hook
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


def _with(sandboxed: Callable[..., Any], fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` (a step) with its layers' hooks sandboxed by ``sandboxed`` (another
    revision's ``call_sandboxed``)."""
    def run() -> None:
        live_hooks.call_sandboxed = sandboxed
        try:
            fn()
        finally:
            live_hooks.call_sandboxed = call_sandboxed
    return run


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


def _at(rev: str, path: str, name: str) -> types.ModuleType:
    """``path`` (a module of ``passes/``) as it is at git revision ``rev``, importing today's
    other modules."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader(f"mbcompile.passes.{name}", loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    module.__package__ = "mbcompile.passes"
    sys.modules[module.__name__] = module  # (its dataclasses look their module up)
    exec(compile(text, f"{rev}:{path}", "exec"), vars(module))  # noqa: S102
    return module


def sandbox_at(rev: str) -> types.ModuleType:
    """``passes/hook_sandbox.py`` at ``rev``, with ``print_calls.prints_recorded`` as it was
    there too (its other helpers are today's: the same code where it was moved)."""
    module = _at(rev, "passes/hook_sandbox.py", "_hook_sandbox_before")
    module.prints_recorded = _at(rev, "passes/print_calls.py",
                                 "_print_calls_before").prints_recorded
    return module


def _size(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
    return None if o.size(0) else None


def _rows(o: torch.Tensor) -> int:
    return o.shape[0]


def _helper(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
    return None if _rows(o) else None


def _in_turns(batches: dict[str, Callable[[int], None]], calls: int, rounds: int
              ) -> dict[str, list[float]]:
    """CPU µs per call of each of ``batches`` (each makes ``calls`` calls), in turns, the
    order rotating, ``4 * rounds`` short rounds each."""
    names = list(batches)
    times: dict[str, list[float]] = {name: [] for name in names}
    for batch in batches.values():
        batch(calls)
    for i in range(4 * rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.process_time()
            batches[name](calls)
            times[name].append((time.process_time() - start) / calls * 1e6)
    return times


def _calls(fn: Callable[[], Any], held: bool = False) -> Callable[[int], None]:
    def batch(n: int) -> None:
        if held:  # as in a microbatch of a step: the sandbox's patches stay between calls
            sandbox_patches.hold()
        try:
            for _ in range(n):
                fn()
        finally:
            if held:
                sandbox_patches.release()
    return batch


def _wrapped(hook: Any, layer: nn.Module, x: torch.Tensor, out: torch.Tensor
             ) -> Callable[[int], None]:
    """Calls of ``hook`` as a step makes them: through its wrapper (``WatchedHook``, the
    hook present at compile), in a microbatch (``in_step``: the patches held)."""
    wrapper = live_hooks.WatchedHook(hook, "layers.0", checked=True)

    def batch(n: int) -> None:
        live_hooks.in_step.enter()
        try:
            for _ in range(n):
                wrapper(layer, (x,), out)
        finally:
            live_hooks.in_step.leave()
    return batch


def _per_call(layers: int, rounds: int, before: types.ModuleType | None, rev: str) -> None:
    """Part 1: one checked call of a hook, now (in a microbatch, and alone) and at ``rev``,
    against the bare call."""
    model = Net(layers)
    layer, x = model.layers[0], torch.randn(4, 64)
    out = layer(x)

    def reads(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        return None

    def calls(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        return None if isinstance(o, torch.Tensor) else None

    def reaching(m: nn.Module, a: tuple, o: torch.Tensor, model: nn.Module = model) -> None:
        return None if isinstance(model, nn.Module) else None

    print("CPU µs per call (median of rounds; best round in brackets)")
    for name, hook in (("only reads its layer", reads), ("calls isinstance", calls),
                       ("calls out.size(0)", _size), ("calls a function of the user's",
                                                      _helper),
                       ("calls, reaches the model", reaching)):
        sandboxes = {"now, in a microbatch": (call_sandboxed, True),
                     "now, alone": (call_sandboxed, False)}
        if before is not None:
            sandboxes[rev] = (before.call_sandboxed, False)
        batches = {"bare": _calls(lambda h=hook: h(layer, (x,), out)),
                   "now, the step's wrapper": _wrapped(hook, layer, x, out)}
        for label, (sandboxed, held) in sandboxes.items():
            kept: dict[Any, Any] = {}  # as a step's wrapper of the hook keeps it
            batches[label] = _calls(lambda h=hook, k=kept, c=sandboxed: c(
                h, layer, ((x,), out), kept=k), held)
        times = _in_turns(batches, 500, rounds)
        cells = ", ".join(f"{label} {statistics.median(t):.1f} ({min(t):.1f})"
                          for label, t in times.items())
        ratio = ""
        if before is not None:
            per_round = [b / a for a, b in zip(times["now, in a microbatch"], times[rev])]
            ratio = f"; {rev} / now in a microbatch {statistics.median(per_round):.2f}x"
        print(f"hook that {name}: {cells}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", metavar="REV",
                        help="also time passes/hook_sandbox.py as it is at git revision REV")
    args = parser.parse_args()
    before = sandbox_at(args.before) if args.before else None
    _per_call(args.layers, args.rounds, before, args.before)
    plain, hooked = _step(args.layers, False), _step(args.layers, True)
    times = _alternated({"no hooks": plain, "hooked": hooked, "hooked, before":
                         _before(hooked), "hooked, marked per_microbatch (unchecked)":
                         _step(args.layers, True, marked=True)}, args.rounds)
    _ratios(times, "no hooks", f"step with a hook on each of {args.layers} layers")
    sized = _step(args.layers, True, hook=_size)
    contenders = {"no hooks": plain, "hooked": sized}
    if before is not None:
        contenders[f"hooked, {args.before}"] = _with(before.call_sandboxed, sized)
    _ratios(_alternated(contenders, args.rounds), "no hooks",
            f"step with a hook calling out.size(0) on each of {args.layers} layers")
    _global(args.layers, args.rounds)


if __name__ == "__main__":
    main()
