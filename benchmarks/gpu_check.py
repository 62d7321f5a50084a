"""mbcompile against a real device: the cost model, the step's overhead and its exactness.

    python benchmarks/gpu_check.py             # CUDA: a GPT-2-small-sized model, fp32
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
3. **overhead**: the compiled step against the hand-written loop on the same microbatches,
   taking turns; that GPT at auto's MBS, and the small GPT of ``bench_overhead.py`` (gbs
   32) at MBS 2, 4 and 16, where a GPU step is bound by kernel launches.
4. **exactness**: float64 against eager's full batch on an uneven plan (the tiny GPT, and
   on CUDA transformers' GPT-2 and Llama); bf16 autocast's gradients against a hand
   loop's distance from eager; fp16 with a ``GradScaler`` skipping the steps eager skips,
   on the device's own kernels.

On CUDA, 1 and 2 run again under bf16 autocast (``precision="bf16-mixed"``), and
``--torch-compile`` adds ``torch_compile=True`` (inductor) against the eager step.

The system is the device's: on CUDA the ``h100-80gb`` preset with the device's own
memory (an H100's and an H200's compute are the same part); on CPU the ``"host"``
preset, which is measured from this machine.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    GPT_CONFIG,
    LiveBytes,
    add_output_args,
    alternate,
    build_hf,
    even_slices,
    finish,
    hand_step,
    median,
    paired_ratio,
)

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


def check(config: dict[str, int], gbs: int, device: torch.device, steps: int = 5,
          precision: str = "32") -> dict[str, Any]:
    """Compile the GPT for ``device`` and measure one step's peak and the step time;
    ``precision="bf16-mixed"``: planned for, and run under, bf16 autocast."""
    torch.manual_seed(0)
    model = TinyGPT(**config).to(device)
    batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"], seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, gbs, 1, "auto", example_inputs=batch, outputs="loss",
                               system=_system(device), precision=precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    region = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision != "32")

    def step() -> None:
        with region:
            loss = cm(*batch)[0]
        loss.backward()
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


# ------------------------------------------------------------------------ overhead
def overhead(config: dict[str, int], gbs: int, mbs: int, device: torch.device, rounds: int
             ) -> dict[str, Any]:
    """The compiled step (``outputs="loss"``) against the hand-written loop on the very same
    microbatches (``common.hand_step``), one system, taking turns round by round.

    Wall time with the device synchronised after each step: on a GPU a small model's step
    is bound by the host's kernel launches, which is where a compiled step's own Python
    would show.
    """
    torch.manual_seed(0)
    model = TinyGPT(**config).to(device)
    batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"], seed=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mbcompile.MbcompileWarning)
        cm = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, outputs="loss",
                               system=_system(device))
    slices = even_slices(gbs, 1, mbs)

    def synced(step: Any) -> Any:
        def run() -> None:
            step()
            _sync(device)
        return run

    contenders = {"mbcompile": synced(lambda: cm(*batch)[0].backward()),
                  "hand loop": synced(lambda: hand_step(model, batch, slices, False))}
    timings = alternate(contenders, rounds, warmup=2,
                        before=lambda: model.zero_grad(set_to_none=True))
    ours, theirs = timings.wall["mbcompile"], timings.wall["hand loop"]
    return {"mbs": mbs, "microbatches": len(slices), "mbcompile_ms": median(ours) * 1e3,
            "hand_loop_ms": median(theirs) * 1e3, "ratio": paired_ratio(ours, theirs)}


# ---------------------------------------------------------------------- exactness
def _grads(model: torch.nn.Module) -> torch.Tensor:
    g = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return g


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def float64_step(device: torch.device, steps: int = 2) -> dict[str, float]:
    """Float64, gbs 7 over 2 systems at mbs 2 (uneven): the compiled step against eager's
    full batch, two SGD steps. The largest relative gradient and loss differences."""
    model = TinyGPT(**TINY).to(device=device, dtype=torch.float64)
    ref = copy.deepcopy(model)
    batch = tuple(t.to(device) for t in token_batch(7, TINY["seq"], TINY["vocab"], seed=2))
    cm = mbcompile.compile(model, 7, 2, 2, example_inputs=batch)

    def loss_of(m: Any) -> torch.Tensor:
        out = m(*batch)
        assert out[1].dtype == torch.float64  # the logits keep eager's dtype
        return out[0]

    return _against_eager(model, ref, cm, loss_of, steps)


def _against_eager(model: torch.nn.Module, ref: torch.nn.Module, cm: Any, loss_of: Any,
                   steps: int) -> dict[str, float]:
    """``steps`` SGD steps of ``cm`` (compiled from ``model``) and of ``ref`` (eager, the
    whole batch), ``loss_of(module)`` each step's loss: the largest relative loss and
    gradient differences."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    grad, loss = 0.0, 0.0
    for _ in range(steps):
        ours, theirs = loss_of(cm), loss_of(ref)
        ours.backward()
        theirs.backward()
        loss = max(loss, float((ours - theirs).detach().abs() / theirs.detach().abs()))
        for opt in opts:
            opt.step()
        grad = max(grad, _distance(_grads(model), _grads(ref)))
    return {"loss_rel": loss, "grad_rel": grad}


def bf16_step(config: dict[str, int], device: torch.device, gbs: int = 16, mbs: int = 4
              ) -> dict[str, float]:
    """Under bf16 autocast: how far the compiled step's gradients and a hand loop's lie from
    eager's full batch (relative norms). The goal is the compiled one no further."""
    torch.manual_seed(0)
    model = TinyGPT(**config).to(device)
    ref, hand = copy.deepcopy(model), copy.deepcopy(model)
    batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"], seed=3))
    cm = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, precision="bf16-mixed")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        cm(*batch)[0].backward()
        ref(*batch)[0].backward()
        hand_step(hand, batch, even_slices(gbs, 1, mbs), False)
    want = _grads(ref)
    return {"mbcompile": _distance(_grads(model), want), "hand_loop": _distance(_grads(hand), want)}


def fp16_scaler(config: dict[str, int], device: torch.device, steps: int = 12, gbs: int = 8,
                mbs: int = 2) -> dict[str, Any]:
    """fp16 autocast with a ``GradScaler``; every 6th step's output layer overflows float16.
    The scale after each step, compiled against eager's full batch and the hand loop."""
    def run(kind: str) -> list[float]:
        torch.manual_seed(0)
        model = TinyGPT(**config).to(device)
        batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"],
                                                        seed=4))
        call = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch,
                                 precision="fp16-mixed") \
            if kind == "mbcompile" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 12, growth_interval=4)
        scales = []
        for step in range(steps):
            with torch.no_grad():
                model.head.weight.mul_(1e8 if step % 6 == 5 else 1.0)
            with torch.autocast(device.type, dtype=torch.float16):
                if kind == "hand loop":
                    hand_step(model, batch, even_slices(gbs, 1, mbs), False, scaler.scale)
                else:
                    scaler.scale(call(*batch)[0]).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.head.weight.div_(1e8 if step % 6 == 5 else 1.0)
            scales.append(scaler.get_scale())
        return scales

    got = {kind: run(kind) for kind in ("mbcompile", "eager", "hand loop")}
    return {"scales": got["mbcompile"], "same_as_eager": got["mbcompile"] == got["eager"],
            "hand_loop_same": got["hand loop"] == got["eager"]}


def hf_float64(arch: str, device: torch.device, steps: int = 2) -> dict[str, float]:
    """A transformers model (``common.build_hf``, width 64) in float64, gbs 7 over 2 systems
    at mbs 2, two SGD steps against eager's full batch. transformers computes some regions
    in float32 whatever the model's dtype (the loss; Llama's RMSNorm), so rounding of
    float32's size is expected there."""
    model, batch = build_hf(arch, width=64, gbs=7, vocab=256)
    model = model.to(device=device, dtype=torch.float64)
    batch = {k: v.to(device) for k, v in batch.items()}
    ref = copy.deepcopy(model)
    cm = mbcompile.compile(model, 7, 2, 2, example_kwargs=batch)
    return _against_eager(model, ref, cm, lambda m: m(**batch).loss, steps)


def torch_compiled(config: dict[str, int], device: torch.device, rounds: int, gbs: int = 32,
                   mbs: int = 4) -> dict[str, Any]:
    """``torch_compile=True`` (inductor: Triton on a GPU) against eager's full batch (float32
    gradients' relative distance) and against mbcompile's eager step, wall per step."""
    torch.manual_seed(0)
    model = TinyGPT(**config).to(device)
    ref = copy.deepcopy(model)
    batch = tuple(t.to(device) for t in token_batch(gbs, config["seq"], config["vocab"], seed=5))
    start = time.perf_counter()
    fast = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, outputs="loss",
                             torch_compile=True)
    fast(*batch)[0].backward()  # inductor compiles here
    _sync(device)
    compile_s = time.perf_counter() - start
    ref(*batch)[0].backward()
    distance = _distance(_grads(model), _grads(ref))
    plain = mbcompile.compile(model, gbs, 1, mbs, example_inputs=batch, outputs="loss")

    def synced(cm: Any) -> Any:
        def run() -> None:
            cm(*batch)[0].backward()
            _sync(device)
        return run

    timings = alternate({"torch_compile": synced(fast), "eager": synced(plain)}, rounds,
                        warmup=2, before=lambda: model.zero_grad(set_to_none=True))
    ours, theirs = timings.wall["torch_compile"], timings.wall["eager"]
    return {"grad_rel": distance, "compile_s": compile_s, "compiled_ms": median(ours) * 1e3,
            "eager_ms": median(theirs) * 1e3, "ratio": paired_ratio(ours, theirs)}


def _attempt(figures: dict[str, Any], key: str, run: Any, *args: Any) -> Any:
    """``figures[key] = run(*args)``; a failure is printed and kept under ``errors``, so one
    broken check on a device lease does not lose the others' figures."""
    try:
        figures[key] = run(*args)
    except Exception:  # noqa: BLE001 - reported, and the run goes on to the next check
        figures.setdefault("errors", {})[key] = traceback.format_exc()
        print(f"{key} FAILED:\n{figures['errors'][key]}", file=sys.stderr)
    return figures.get(key)


def _cost_lines(figures: dict[str, Any], config: dict[str, int], gbs: int) -> list[str]:
    return [
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


def _overhead_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = ["### The compiled step against a hand-written loop (wall, device synchronised)", "",
           "| model | gbs | mbs | microbatches | mbcompile, ms | hand loop, ms | ratio |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        out.append(f"| {row['model']} | {row['gbs']} | {row['mbs']} | {row['microbatches']} | "
                   f"{row['mbcompile_ms']:.2f} | {row['hand_loop_ms']:.2f} | "
                   f"**{row['ratio']:.3f}** |")
    return out


def _exact_lines(figures: dict[str, Any]) -> list[str]:
    out = ["### Exactness on the device", ""]
    for key in ("float64", "gpt2", "llama"):
        if key in figures:
            f = figures[key]
            what = "the tiny GPT" if key == "float64" else f"transformers' {key}"
            out.append(f"- {what} in float64, gbs 7 over 2 systems at mbs 2, two SGD steps "
                       f"against eager's full batch: loss {f['loss_rel']:.1e}, gradients "
                       f"{f['grad_rel']:.1e} (relative).")
    if "bf16" in figures:
        bf16 = figures["bf16"]
        out.append(f"- bf16 autocast, gbs 16 at mbs 4, gradients' distance from eager's full "
                   f"batch: mbcompile {bf16['mbcompile']:.2e}, hand loop {bf16['hand_loop']:.2e}.")
    if "torch_compile" in figures:
        tc = figures["torch_compile"]
        out.append(f"- `torch_compile=True`, gbs 32 at mbs 4: gradients {tc['grad_rel']:.1e} from "
                   f"eager's full batch (float32); compile and first step {tc['compile_s']:.1f} s;"
                   f" step {tc['compiled_ms']:.2f} ms against mbcompile's eager step "
                   f"{tc['eager_ms']:.2f} ms (**{tc['ratio']:.3f}**).")
    if "fp16_scaler" in figures:
        fp16 = figures["fp16_scaler"]
        out.append(f"- fp16 autocast with a GradScaler, 12 steps, every 6th overflowing: scales "
                   f"{'equal to' if fp16['same_as_eager'] else 'DIFFERENT from'} eager's "
                   f"({', '.join(f'{s:g}' for s in fp16['scales'])}); the hand loop's "
                   f"{'equal' if fp16['hand_loop_same'] else 'differ'}.")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer width-64 GPT")
    parser.add_argument("--gbs", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--torch-compile", action="store_true",
                        help="also torch_compile=True (inductor) against the eager step")
    parser.add_argument("--full", action="store_true",
                        help="the GPT-2-small-sized model even on CPU (minutes a step)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or (device.type != "cuda" and not args.full)
    config, gbs = (TINY, args.gbs or 16) if tiny else (GPT2_SMALL, args.gbs or 64)
    small = TINY if tiny else GPT_CONFIG
    figures: dict[str, Any] = {}
    cost = _attempt(figures, "cost", check, config, gbs, device, args.steps)
    if cost is not None:
        figures.update(figures.pop("cost"))
    if not tiny:  # the plan under bf16 autocast, as GPUs train (CI runs it in test_precision)
        _attempt(figures, "cost_bf16", check, config, gbs, device, args.steps, "bf16-mixed")
    runs = ([(config, gbs, figures["mbs"], args.steps)] if cost is not None else []) + [
        (small, 32, m, 4 * args.steps) for m in ((4,) if tiny else (2, 4, 16))]
    figures["overhead"] = []
    for cfg, g, mbs, rounds in runs:
        row = _attempt(figures, f"overhead_{cfg['width']}_{mbs}", overhead, cfg, g, mbs, device,
                       rounds)
        if row is not None:
            figures["overhead"].append(dict(figures.pop(f"overhead_{cfg['width']}_{mbs}"),
                                            gbs=g, model=f"width {cfg['width']}, depth "
                                            f"{cfg['depth']}, seq {cfg['seq']}"))
    _attempt(figures, "float64", float64_step, device)
    if not tiny:  # CI runs transformers' float64 steps in its own tests
        for arch in ("gpt2", "llama"):
            _attempt(figures, arch, hf_float64, arch, device)
    _attempt(figures, "bf16", bf16_step, small, device)
    _attempt(figures, "fp16_scaler", fp16_scaler, TINY, device)
    if args.torch_compile:
        _attempt(figures, "torch_compile", torch_compiled, small, device, 4 * args.steps)
    if "cost_bf16" in figures:
        b = figures["cost_bf16"]
        out_bf16 = ["", f"Under bf16 autocast (`precision='bf16-mixed'`): mbs {b['mbs']}, peak "
                    f"{b['modelled_peak_bytes'] / 2**20:.1f} MiB modelled, "
                    f"{b['measured_peak_bytes'] / 2**20:.1f} measured "
                    f"(**{b['memory_ratio']:.3f}**); step {b['modelled_step_s'] * 1e3:.2f} ms "
                    f"modelled, {b['measured_step_s'] * 1e3:.2f} measured "
                    f"(**{b['time_ratio']:.3f}**)."]
    else:
        out_bf16 = []
    out = (_cost_lines(figures, config, gbs) + out_bf16 if cost is not None else []) + [""] + \
        _overhead_lines(figures["overhead"]) + [""] + _exact_lines(figures)
    for key, error in figures.get("errors", {}).items():
        out += ["", f"**{key} failed**: `{error.strip().splitlines()[-1]}`"]
    return finish(out, figures, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
