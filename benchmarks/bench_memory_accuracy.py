"""The memory figure against the measured live peak: five transformers architectures.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_accuracy.py [--arch gpt2 llama ...]
        [--mbs 1 2 3 4 5 8 16] [--outputs loss all] [--width 256] [--quick]

For GPT-2, Llama, BERT (masked LM), T5 and ViT (4 layers, width 256, sequence 128,
each config's own vocabulary, float32, dropout 0), gbs 16 on one system, Adam (torch's default for
CPU tensors: one parameter at a time): ``cm.estimate.memory.peak`` against the
measured peak live tensor bytes of one training step of the compiled module
(``mbcompile.planning.measure.training_step_peak``: every storage an op creates,
counted while it lives; the parameters, buffers, Adam's state and the batch counted
from the start), the step being ``cm(**batch)``, ``backward()`` and ``opt.step()``
after a warm-up step, with the gradients set to None before it as ``zero_grad()``
does. MBS 1-16 give even
and uneven splits (16 = 5+5+3+3 at MBS 5, say), and ``outputs`` is ``"loss"`` (the
Trainer's and CLI's setting: the logits are not returned) or ``"all"``.

Target (issue 34): every ratio predicted / measured in [0.98, 1.05].
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, finish  # noqa: E402

import mbcompile  # noqa: E402
from mbcompile.planning.measure import training_step_peak  # noqa: E402

GBS, SEQ, LAYERS, WIDTH, HEADS = 16, 128, 4, 256, 4
LOW, HIGH = 0.98, 1.05  # the band the estimate must lie in (issue 34)
MB = 2**20


def _config(arch: str, width: int, vocab: int | None) -> tuple[str, str, dict[str, Any]]:
    """(model class, config class, config) of ``arch`` at ``width`` (``vocab`` None: the
    config's own vocabulary)."""
    common: dict[str, Any] = dict(pad_token_id=0)
    if vocab is not None:
        common["vocab_size"] = vocab
    if arch == "gpt2":
        return "GPT2LMHeadModel", "GPT2Config", dict(
            common, n_embd=width, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
            bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return "LlamaForCausalLM", "LlamaConfig", dict(
            common, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, num_key_value_heads=HEADS,
            max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=2)
    if arch == "bert":
        return "BertForMaskedLM", "BertConfig", dict(
            common, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=SEQ)
    if arch == "t5":
        return "T5ForConditionalGeneration", "T5Config", dict(
            common, d_model=width, d_kv=width // HEADS, d_ff=4 * width, num_layers=LAYERS // 2,
            num_decoder_layers=LAYERS // 2, num_heads=HEADS, eos_token_id=1,
            decoder_start_token_id=0)
    if arch == "vit":
        return "ViTForImageClassification", "ViTConfig", dict(
            image_size=64, patch_size=8, num_channels=3, hidden_size=width,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=4 * width,
            num_labels=10)
    raise ValueError(f"unknown architecture {arch!r}")


ARCHS = ("gpt2", "llama", "bert", "t5", "vit")


def build(arch: str, width: int = WIDTH, gbs: int = GBS, vocab: int | None = None
          ) -> tuple[torch.nn.Module, dict]:
    """The model (float32, dropout 0, training mode) and a batch of ``gbs`` samples."""
    import transformers

    model_class, config_class, config = _config(arch, width, vocab)
    cfg = getattr(transformers, config_class)(**config)
    for key, value in cfg.to_dict().items():
        if "drop" in key and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).float().train()
    g = torch.Generator().manual_seed(1)
    if arch == "vit":
        return model, {"pixel_values": torch.randn(gbs, 3, 64, 64, generator=g),
                       "labels": torch.randint(0, 10, (gbs,), generator=g)}
    ids = torch.randint(3, cfg.vocab_size, (gbs, SEQ), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "labels": ids.clone()}


def run(archs: list[str], sizes: list[int], outputs: list[str], width: int,
        vocab: int | None, out: list[str], fig: dict[str, Any]) -> None:
    rows = []
    worst_low, worst_high = 9.0, 0.0
    for arch in archs:
        model, batch = build(arch, width, vocab=vocab)
        for kept in outputs:
            for mbs in sizes:
                t0 = time.perf_counter()
                cm = mbcompile.compile(model, GBS, 1, mbs, example_kwargs=batch, outputs=kept,
                                       recompute=False)
                predicted = cm.estimate.memory.peak
                measured = training_step_peak(model, lambda cm=cm, b=batch: cm(**b), batch)
                ratio = predicted / measured
                worst_low, worst_high = min(worst_low, ratio), max(worst_high, ratio)
                k = cm.plan.num_microbatches
                ok = "" if LOW <= ratio <= HIGH else " **out**"
                rows.append(f"| {arch} | {kept} | {mbs} | {k} | {predicted / MB:.1f} | "
                            f"{measured / MB:.1f} | {ratio:.3f}{ok} | "
                            f"{cm.estimate.memory.phase} |")
                print(rows[-1], f"({time.perf_counter() - t0:.1f} s)", flush=True)
                fig[f"{arch} {kept} mbs{mbs}"] = ratio
                del cm
    fig.update(worst_low=worst_low, worst_high=worst_high)
    out += ["## The memory figure against the measured live peak", "",
            f"gbs {GBS} on one system, width {width}, {LAYERS} layers, sequence {SEQ}, "
            f"vocabulary {vocab or 'of the config'}, float32, Adam; MiB.", "",
            "| model | outputs | MBS | microbatches | predicted | measured | "
            "predicted / measured | peak at |", "|---|---|---:|---:|---:|---:|---:|---|",
            *rows, "",
            f"Ratios from {worst_low:.3f} to {worst_high:.3f} (target: within "
            f"[{LOW}, {HIGH}]): "
            f"{'holds' if LOW <= worst_low and worst_high <= HIGH else 'DOES NOT HOLD'}.", ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--mbs", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16])
    parser.add_argument("--outputs", nargs="+", default=["loss", "all"])
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--vocab", type=int, help="vocabulary (default: each config's own)")
    add_output_args(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out: list[str] = ["# bench_memory_accuracy", ""]
    fig: dict[str, Any] = {}
    run(args.arch, args.mbs, args.outputs, args.width, args.vocab, out, fig)
    return finish(out, fig, args.markdown, args.json)


if __name__ == "__main__":
    sys.exit(main())
