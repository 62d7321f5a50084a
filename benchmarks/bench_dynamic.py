"""The HF Trainer on batches of random lengths: ``Trainer(model=cm)`` against the plain one.

    OMP_NUM_THREADS=1 python benchmarks/bench_dynamic.py [--steps 200] [--model gpt2|llama]

``DataCollatorForLanguageModeling(tok, mlm=False)`` pads each batch to its own longest row
(rows of 5 to 60 tokens), so every step has another sequence length: the compiled module
compiles at most twice (the example's, then once with the length symbolic, which the
Trainer's ``num_items_in_batch`` keyword variant is from its first step) and runs every
other length on that step. Both Trainers run in this one process, one after the other,
compile included; the script prints both wall times, their ratio (goal: compiled at most
1.3x plain), the seconds spent compiling and the largest difference of the trained
parameters (float64 model, transformers' float32 regions kept in float64: <= 1e-9).
``tests/test_dynamic_shapes.py`` runs ``run_both`` for 40 steps.
"""

from __future__ import annotations

import argparse
import copy
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import mbcompile

GBS, NUM_CSX, MBS, VOCAB, PAD = 6, 2, 2, 64, 0
SHORTEST, LONGEST = 5, 60


class RandomLengths(torch.utils.data.Dataset):
    """Rows of token ids (never the pad id) of random lengths ``SHORTEST..LONGEST``."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(SHORTEST, LONGEST + 1, (n,), generator=g).tolist()
        self.rows = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i]}


def tokenizer(transformers: Any) -> Any:
    """A word-level tokenizer built here (no download): the collator only pads with it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": PAD, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>")
    tok.padding_side = "right"
    return tok


def make_model(transformers: Any, name: str) -> nn.Module:
    """A two-layer causal LM of width 32 in float64, without dropout; its loss without
    transformers' float32 upcast (``float64_regions`` keeps Llama's RMSNorm in float64)."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=0, pad_token_id=PAD)
        model = transformers.LlamaForCausalLM(config)
    model = model.double()
    model.loss_function = _causal_lm_loss_float64
    return model


def _causal_lm_loss_float64(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            num_items_in_batch: Any = None, ignore_index: int = -100,
                            shift_labels: torch.Tensor | None = None, **kwargs: Any
                            ) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its ``logits.float()`` upcast."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.view(-1, vocab_size), shift_labels.view(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


@contextmanager
def float64_regions(transformers: Any) -> Iterator[None]:
    """Llama's RMSNorm in the input's dtype (float64) instead of float32, while it runs."""
    from transformers.models.llama import modeling_llama

    def rms_norm(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    norm = modeling_llama.LlamaRMSNorm
    forward = norm.forward
    norm.forward = rms_norm
    try:
        yield
    finally:
        norm.forward = forward


def train(transformers: Any, model: nn.Module, steps: int, out: Path) -> float:
    """``steps`` Trainer steps of batches of ``GBS`` rows, padded per batch; wall seconds."""
    collator = transformers.DataCollatorForLanguageModeling(tokenizer(transformers), mlm=False)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=GBS, max_steps=steps,
        learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no", dataloader_drop_last=True)
    trainer = transformers.Trainer(model=model, args=args, data_collator=collator,
                                   train_dataset=RandomLengths(GBS * steps, 1))
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start


def run_both(transformers: Any, name: str, steps: int) -> dict[str, Any]:
    """The plain Trainer and the compiled one from the same start, in this process: wall
    seconds of each (compile included), compile seconds, compiles, parameter errors."""
    plain = make_model(transformers, name)
    model = copy.deepcopy(plain)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer(transformers), mlm=False)
    example = collator([RandomLengths(GBS, 0)[i] for i in range(GBS)])
    with float64_regions(transformers), tempfile.TemporaryDirectory() as out, \
            warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plain_s = train(transformers, plain, steps, Path(out) / "plain")
        start = time.perf_counter()
        cm = mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=dict(example),
                               cost_model=False)
        compile_s = time.perf_counter() - start
        compiled_s = compile_s + train(transformers, cm, steps, Path(out) / "compiled")
    recompiles = [w for w in seen if issubclass(w.category, mbcompile.MbcompileWarning)
                  and "compiled once" in str(w.message)]
    compile_s += sum(float(m.group(1)) for w in recompiles
                     if (m := re.search(r"in (\d+\.\d+) s, and kept", str(w.message))))
    want, got = plain.state_dict(), model.state_dict()
    errors = {k: float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300))
              for k in want}
    return {"plain_s": plain_s, "compiled_s": compiled_s, "compile_s": compile_s,
            "compiles": 1 + len(recompiles), "errors": errors, "cm": cm,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in recompiles]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    run = run_both(transformers, args.model, args.steps)
    print(f"{args.model}, {args.steps} steps of {GBS} rows of {SHORTEST}-{LONGEST} tokens, "
          f"padded per batch, {NUM_CSX} systems, mbs {MBS}:")
    print(f"  Trainer(model=model): {run['plain_s']:.2f} s")
    print(f"  Trainer(model=cm):    {run['compiled_s']:.2f} s, of which compiling "
          f"{run['compile_s']:.2f} s in {run['compiles']} compiles")
    print(f"  ratio compiled / plain: {run['compiled_s'] / run['plain_s']:.2f} (goal <= 1.3)")
    print(f"  largest relative difference of a trained parameter: "
          f"{max(run['errors'].values()):.1e}")


if __name__ == "__main__":
    main()
