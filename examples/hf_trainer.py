"""The Hugging Face Trainer with a compiled model, unmodified.

    python examples/hf_trainer.py [gpt2 | llama]

Compile the model from one batch and hand the compiled module to the Trainer as the
model; ``per_device_train_batch_size`` is the global batch ``gbs``, and the Trainer's
own gradient accumulation stays off (``gradient_accumulation_steps=1``, the default):

    model = AutoModelForCausalLM.from_pretrained(name)          # in eval mode, as loaded
    cm = mbcompile.compile(model, gbs, num_csx, mbs, example_kwargs=batch)
    trainer = Trainer(model=cm, args=TrainingArguments(per_device_train_batch_size=gbs, ...),
                      train_dataset=train, eval_dataset=test)
    trainer.train(); trainer.evaluate(); trainer.save_model(out)   # from_pretrained(out)

What the Trainer reads off the model is the model's: ``cm.__class__`` (label names,
``save_pretrained`` for tied weights), ``inspect.signature(cm.forward)`` (the dataset
columns it keeps), ``cm.config`` and ``cm.loss_type``. It passes ``num_items_in_batch``
through forward's ``**kwargs``, where the model scales its loss by it: a keyword the
example batch did not have, whose graph compiles once per mode (the first training step,
the first ``evaluate()``) on compile()'s plan, without a warning (compile() knows the
Trainer adds it); a short last batch is planned and lowered on that capture in
milliseconds (a ``BatchSizeWarning``), and a model compiled in eval mode says so in
``cm.plan.warnings``.

The script trains a one-layer GPT-2 (or Llama) of width 32 in float64 for one epoch of
7 samples (batches of 3, 3 and 1) with the plain Trainer and with the compiled module,
and compares the parameters: they agree to the float32 rounding of transformers'
causal-LM loss (tests/test_hf_trainer.py says why that is the bound).
"""

from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers

import mbcompile

GBS, NUM_CSX, MBS, SEQ, VOCAB = 3, 2, 1, 8, 64


class Tokens(torch.utils.data.Dataset):
    """Token rows with a few labels masked (-100) and a column forward does not take."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        labels = self.ids[i].clone()
        labels[: i % 3] = -100  # rows count different numbers of tokens
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": labels, "source": "web"}  # 'source': the Trainer drops it


def make_model(name: str = "gpt2") -> Any:
    """A one-layer causal LM of width 32 in float64 and eval mode (as from_pretrained
    leaves a model), without dropout so that two runs can be compared."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config).double().eval()
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config).double().eval()


def compile_for_trainer(model: Any, **options: Any) -> mbcompile.CompiledModule:
    """The model compiled from one batch as the Trainer's collator builds it."""
    batch = transformers.default_data_collator([Tokens(GBS, 0)[i] for i in range(GBS)])
    return mbcompile.compile(model, GBS, NUM_CSX, MBS, example_kwargs=batch, **options)


def train(model: Any, out: Path) -> dict[str, Any]:
    """One epoch with the Trainer's defaults, then evaluate, predict and save; what each
    returned, the losses it logged and mbcompile's warnings."""
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=GBS, per_device_eval_batch_size=GBS,
        num_train_epochs=1, learning_rate=1e-2, seed=0, use_cpu=True, report_to=[],
        save_strategy="no", disable_tqdm=True, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(7, 1),
                                   eval_dataset=Tokens(6, 2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
        evaluated = trainer.evaluate()
        predicted = trainer.predict(Tokens(3, 3))
        trainer.save_model(str(out / "saved"))
    return {"trainer": trainer, "eval": evaluated, "predict": predicted, "saved": out / "saved",
            "warnings": [w for w in seen if issubclass(w.category, mbcompile.MbcompileWarning)],
            "losses": [log["loss"] for log in trainer.state.log_history if "loss" in log]}


def update_errors(start: dict[str, torch.Tensor], plain: Any, compiled: Any
                  ) -> dict[str, float]:
    """Per parameter: how far the compiled run's update is from the plain run's, relative
    to the plain update's size."""
    want, got = plain.state_dict(), compiled.state_dict()
    return {k: float((got[k] - want[k]).norm() / (want[k] - w0).norm())
            for k, w0 in start.items() if (want[k] - w0).norm() > 0}


def main(name: str) -> float:
    plain = make_model(name)
    model = copy.deepcopy(plain)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    cm = compile_for_trainer(model)
    with tempfile.TemporaryDirectory() as out:
        train(plain, Path(out) / "plain")
        run = train(cm, Path(out) / "compiled")
        again = type(plain).from_pretrained(run["saved"])
    print(cm.plan)
    for w in run["warnings"]:
        print(f"{type(w.message).__name__}: {w.message}")
    error = max(update_errors(start, plain, model).values())
    print(f"Trainer(model=cm) vs Trainer(model=model), one epoch: parameter updates differ by "
          f"{error:.1e} of their size; from_pretrained of the saved folder: "
          f"{type(again).__name__}")
    return error


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1] if len(sys.argv) > 1 else "gpt2") < 3e-5 else 1)
