"""What checking a torch layer's hooks inside a step costs (``passes/hook_sandbox.py``).

    OMP_NUM_THREADS=1 python benchmarks/bench_layer_hooks.py [--layers 16] [--rounds 5]

Each call of a live layer's hook inside a compiled step is sandboxed: the Python state
reachable from the layer and from the hook is recorded, compared after the call and put
back if it changed. Side by side, in one run:

1. one sandboxed call against the bare call, µs, for a hook that reaches its layer only
   and for one whose closure holds the whole model (the walk covers every module);
2. a compiled training step of an MLP of ``--layers`` Linear layers (gbs 32 over 2
   systems, MBS 4) with a hook that only computes (``out * 1.0``) on every layer,
   against the same step without hooks: the ratio is what the checks cost a step;
3. the same step of the MLP without hooks of its own, with a global module hook that only
   reads (``register_module_forward_hook``, checked as a layer's hook on each layer call)
   and with it marked ``mbcompile.per_microbatch`` (called as written), against that step
   with the global hooks hidden (``passes/global_hooks.hidden``), in one run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile
from mbcompile.passes import global_hooks
from mbcompile.passes.hook_sandbox import call_sandboxed


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


def _step(layers: int, hooked: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = Net(layers)
    if hooked:
        for layer in model.layers:
            layer.register_forward_hook(_scaled)
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


def _median_ratio(fns: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each of ``fns``, alternating with the order rotating: load hits all
    alike."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(4 * rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name].append(_cpu(fns[name]))
    return times


def _global(layers: int, rounds: int) -> None:
    """Part 3: a read-only global hook, unmarked and marked, against none."""
    warnings.simplefilter("ignore", mbcompile.RecompileWarning)  # each hook: compiled once
    register = torch.nn.modules.module.register_module_forward_hook
    step = _step(layers, False)

    def hidden() -> None:
        with global_hooks.hidden():
            step()

    fns: dict[str, Callable[[], None]] = {"none": hidden}
    handles = [register(_reads)]
    step()  # compiled once more: the global hooks are part of the mode key
    fns["unmarked"] = step
    times = _median_ratio(fns, rounds)
    handles[0].remove()
    handles.append(register(mbcompile.per_microbatch(_reads)))
    step()
    times.update({k: v for k, v in _median_ratio({"none": hidden, "marked": step},
                                                 rounds).items() if k == "marked"})
    handles[1].remove()
    for name in ("unmarked", "marked"):
        ratio = statistics.median(h / p for h, p in zip(times[name], times["none"]))
        print(f"step with a read-only global hook, {name}: "
              f"{statistics.median(times[name]) * 1e3:8.2f} ms CPU ({ratio:.2f}x of no "
              "global hook, median ratio)")


def _cpu(fn: Callable[[], None]) -> float:
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = Net(args.layers)
    layer, x = model.layers[0], torch.randn(4, 64)
    out = layer(x)

    def alone(m: nn.Module, a: tuple, o: torch.Tensor) -> None:
        return None

    def reaching(m: nn.Module, a: tuple, o: torch.Tensor, model: nn.Module = model) -> None:
        return None

    for name, hook in (("reaches its layer", alone), ("reaches the model", reaching)):
        bare = _best(lambda h=hook: h(layer, (x,), out), 200, args.rounds)
        boxed = _best(lambda h=hook: call_sandboxed(h, layer, ((x,), out)), 200, args.rounds)
        print(f"hook that {name} ({args.layers} layers): sandboxed {boxed * 1e6:8.1f} µs, "
              f"bare {bare * 1e6:6.2f} µs per call ({boxed / bare:.0f}x)")
    plain, hooked = _step(args.layers, False), _step(args.layers, True)
    times: dict[str, list[float]] = {"plain": [], "hooked": []}
    for i in range(4 * args.rounds):  # alternating, order rotating: load hits both alike
        for name in (("plain", "hooked") if i % 2 else ("hooked", "plain")):
            times[name].append(_cpu(plain if name == "plain" else hooked))
    ratio = statistics.median(h / p for h, p in zip(times["hooked"], times["plain"]))
    print(f"step without hooks: {statistics.median(times['plain']) * 1e3:8.2f} ms CPU")
    print(f"step with a hook on each of {args.layers} layers: "
          f"{statistics.median(times['hooked']) * 1e3:8.2f} ms CPU ({ratio:.2f}x, median ratio)")
    _global(args.layers, args.rounds)


if __name__ == "__main__":
    main()
