"""The cost model against a real device: modelled peak memory and step time, measured.

    python benchmarks/gpu_check.py             # CUDA: a GPT-2-small-sized model, bf16-free fp32
    python benchmarks/gpu_check.py --tiny      # anywhere (CI runs it on CPU): a 2-layer GPT

One training step (forward, backward, AdamW update) of the GPT at the MBS ``mbs="auto"``
picks, compiled for one system with ``outputs="loss"``:

1. **memory**: the plan's modelled peak (``cm.estimate.memory.peak``: parameters,
   gradients, the optimizer's state, the batch and one microbatch's activations) against
   the measured peak of the step. CUDA: ``torch.cuda.max_memory_allocated``. CPU: the
   peak of live tensor storages (``common.LiveBytes``: the host has no allocator counter,
   and RSS also holds Python and torch's libraries). The goal is a ratio within ±10%.
2. **time**: the modelled step time (``cm.estimate.time.step``) against the median of
   measured steps after warm-up steps (on CPU the process's CPU time, so a shared CI
   host's other work does not count).

The system is the device's: on CUDA the ``h100-80gb`` preset with the device's own
memory (an H100's and an H200's compute are the same part); on CPU the ``"host"``
preset, which is measured from this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import LiveBytes, add_output_args, finish  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile.models import TinyGPT, token_batch  # noqa: E402
from mbcompile.planning.systems import get_system  # noqa: E402

#: GPT-2 small's shape (124M parameters with its 50257-token vocabulary).
GPT2_SMALL = dict(vocab=50257, width=768, depth=12, heads=12, seq=1024)
TINY = dict(vocab=256, width=64, depth=2, heads=4, seq=64)


def _system(device: torch.device) -> Any:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return dataclasses.replace(get_system("h100-80gb"), name=torch.cuda.get_device_name(device),
                                   memory_bytes=float(total) * 0.9)
    return get_system("host")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check(config: dict[str, int], gbs: int, device: torch.device, steps: int = 5
          ) -> dict[str, Any]:
    """Compile the GPT for ``device`` and measure one step's peak and the step time."""
    torch.manual_seed(0)
    model = TinyGPT(**config).to(device)
    batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"], seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, gbs, 1, "auto", example_inputs=batch, outputs="loss",
                               system=_system(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        cm(*batch)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in the model's steady state
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        measured = float(torch.cuda.max_memory_allocated(device))
    else:
        with LiveBytes() as mem:
            mem.track(list(model.parameters()), list(model.buffers()), batch,
                      [s for st in opt.state.values() for s in st.values()])
            step()
        measured = float(mem.peak)
    # CPU: the process's CPU time (a shared host's other work does not count), one thread
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = []
    for _ in range(steps):
        _sync(device)
        start = clock()
        step()
        _sync(device)
        times.append(clock() - start)
    estimate = cm.estimate
    return {"device": str(device), "system": estimate.system, "gbs": gbs, "mbs": cm.plan.mbs,
            "microbatches": estimate.num_microbatches,
            "modelled_peak_bytes": estimate.memory.peak, "measured_peak_bytes": measured,
            "memory_ratio": measured / estimate.memory.peak,
            "modelled_step_s": estimate.time.step, "measured_step_s": statistics.median(times),
            "time_ratio": statistics.median(times) / estimate.time.step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 GPT")
    parser.add_argument("--gbs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    add_output_args(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"  # GPT-2 small on a CPU takes minutes a step
    config, gbs = (TINY, args.gbs or 16) if tiny else (GPT2_SMALL, args.gbs or 64)
    figures = check(config, gbs, device, args.steps)
    out = [
        "### The cost model against the device",
        "",
        f"{'GPT ' + str(config)} on {figures['device']} ({figures['system']}), gbs {gbs}, "
        f"mbs {figures['mbs']} ({figures['microbatches']} microbatches), AdamW, outputs='loss'.",
        "",
        "| figure | modelled | measured | measured / modelled |",
        "|---|---:|---:|---:|",
        f"| peak memory, MiB | {figures['modelled_peak_bytes'] / 2**20:.1f} | "
        f"{figures['measured_peak_bytes'] / 2**20:.1f} | **{figures['memory_ratio']:.3f}** |",
        f"| step time, ms | {figures['modelled_step_s'] * 1e3:.2f} | "
        f"{figures['measured_step_s'] * 1e3:.2f} | **{figures['time_ratio']:.3f}** |",
        "",
        "Goal: memory within ±10% (0.90-1.10).",
    ]
    return finish(out, figures, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
