"""Compile-only at the scale users train: Llama-shaped models on the meta device.

    python benchmarks/bench_scale.py [--shapes 1b 7b 70b] [--markdown RESULTS.md]

Builds transformers' ``LlamaForCausalLM`` from a config (bf16, vocabulary 128256) on the
meta device, so no memory of the model's size is touched, and compiles it with
``compile_only=True``, ``mbs="auto"``, ``outputs="loss"``, gbs 1024 of 2048 tokens on
``h100-80gb`` systems. Each row is one compile, in CPU seconds per stage (one torch
thread; wall time on a shared machine mostly measures the neighbours):

- static: the static-memory check run before anything is traced;
- capture: torch.export of the model (its transformers forward);
- shapes: the shape pass (two fake runs of the graph);
- batch: the batch analysis;
- cost + MBS: the cost model's probes (one repeated block probed, counted N times) and
  the MBS choice (with activation checkpointing per block costed when memory binds);
- rest: building the compiled module (the rewrite) and everything else.

Cases: the 1B (16 layers, tied embeddings) and the 7B (32 layers) on 8 systems, the 7B
with SGD's state (``optimizer="sgd"``: Adam's does not fit an 80 GB replica), the 70B
(80 layers, 8 KV heads) replicated on 64 systems, which the static check refuses, the
same 70B on a simulated 2 TB system, where it fits, to time the whole path, and the 70B
sharded with FSDP2 over the 64 H100s (``shard="fsdp"``: planned in one process), where
it fits by reduce-scattering gradients in every microbatch (``gradient_sync``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, finish  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile import analysis, compiler  # noqa: E402
from mbcompile.errors import MbcompileError  # noqa: E402
from mbcompile.planning.estimates import format_bytes  # noqa: E402
from mbcompile.planning.systems import PRESETS  # noqa: E402

GBS, SEQ, VOCAB = 1024, 2048, 128256
SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}
H100 = PRESETS["h100-80gb"]
BIG = replace(H100, name="h100-2tb-sim", memory_bytes=2e12)
#: (shape, systems, system, optimizer, shard)
CASES = [("1b", 8, H100, None, None), ("7b", 8, H100, None, None),
         ("7b", 8, H100, "sgd", None), ("70b", 64, H100, None, None),
         ("70b", 64, BIG, None, None), ("70b", 64, H100, None, "fsdp")]
#: stage -> (module, function name): the functions timed, as compile() calls them
STAGES = {"static": (compiler, "check_static_memory"), "capture": (analysis, "_capture"),
          "shapes": (analysis, "shapes_and_cut"), "batch": (analysis, "analyse_batch"),
          "cost + MBS": (compiler, "select")}


def _timed(seconds: dict[str, float], stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[stage] += time.process_time() - start
    return run


def _model(shape: str) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, **SHAPES[shape])
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def compile_one(shape: str, num_csx: int, system: Any, optimizer: str | None,
                shard: str | None = None) -> dict[str, Any]:
    """One compile-only of ``shape``: CPU seconds per stage, the MBS and the peak."""
    seconds = dict.fromkeys([*STAGES, "rest", "total"], 0.0)
    model = _model(shape)
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    saved = {stage: getattr(module, name) for stage, (module, name) in STAGES.items()}
    for stage, (module, name) in STAGES.items():
        setattr(module, name, _timed(seconds, stage, saved[stage]))
    start = time.process_time()
    try:
        cm = mbcompile.compile(model, GBS, num_csx, "auto", example_inputs=(ids,),
                               example_kwargs={"labels": ids}, outputs="loss",
                               system=system, optimizer=optimizer, compile_only=True,
                               shard=shard)
        answer = {"mbs": cm.plan.mbs, "recompute": cm.plan.recompute,
                  "gradient_sync": cm.plan.gradient_sync,
                  "peak": cm.estimate.memory.peak, "step_s": cm.estimate.time.step}
    except MbcompileError as exc:
        answer = {"refused": type(exc).__name__, "why": str(exc).splitlines()[0]}
    finally:
        seconds["total"] = time.process_time() - start
        seconds["rest"] = seconds["total"] - sum(seconds[s] for s in STAGES)
        for stage, (module, name) in STAGES.items():
            setattr(module, name, saved[stage])
    params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "num_csx": num_csx, "system": system.name, "shard": shard,
            "optimizer": optimizer or "adam (system)", "params": params,
            "layers": SHAPES[shape]["num_hidden_layers"], "seconds": seconds, **answer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    add_output_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers_config = SHAPES["1b"] | {"hidden_size": 64, "intermediate_size": 128,
                                          "num_hidden_layers": 2, "num_attention_heads": 4,
                                          "num_key_value_heads": 2}
    SHAPES["warm-up"] = transformers_config  # imports and torch's lazy set-up, untimed
    compile_one("warm-up", 8, H100, None)
    del SHAPES["warm-up"]
    rows = [compile_one(*case) for case in CASES if case[0] in args.shapes]
    stages = [*STAGES, "rest", "total"]
    out = ["### Compile-only at scale (meta-device Llama shapes)", "",
           f"transformers `LlamaForCausalLM` on the meta device, bf16, gbs {GBS} x {SEQ} "
           "tokens, `mbs='auto'`, `outputs='loss'`, `compile_only=True`; CPU seconds per "
           "stage, one compile each after a warm-up.", "",
           "| model | layers | params | systems | optimizer | "
           + " | ".join(stages) + " | answer |",
           "|---|---:|---:|---|---|" + "---:|" * len(stages) + "---|"]
    for r in rows:
        sync = (f", gradient_sync {r['gradient_sync']!r}" if r.get("gradient_sync") else "")
        answer = (f"mbs {r['mbs']}{' + recompute' if r['recompute'] else ''}{sync}, peak "
                  f"{format_bytes(r['peak'])}, step {r['step_s']:.2f} s"
                  if "mbs" in r else f"{r['refused']}: {r['why'][:90]}")
        out.append(f"| {r['shape']} | {r['layers']} | {r['params'] / 1e9:.2f} B | "
                   f"{r['num_csx']} x {r['system']}{' (FSDP2)' if r['shard'] else ''} | "
                   f"{r['optimizer']} | "
                   + " | ".join(f"{r['seconds'][s]:.2f}" for s in stages) + f" | {answer} |")
    out.append("")
    return finish(out, {"rows": rows}, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
