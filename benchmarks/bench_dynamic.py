"""The HF Trainer on batches of random lengths: ``Trainer(model=cm)`` against the plain one.

    OMP_NUM_THREADS=1 python benchmarks/bench_dynamic.py [--steps 200]
        [--model gpt2|llama|gpt2-cls|bert-mlm] [--upfront] [--floor]
        [--num-csx 2] [--mbs 2|auto] [--layers 2] [--width 32]

The collator pads each batch to its own longest row (rows of 5 to 60 tokens), so every
step has another sequence length: ``DataCollatorForLanguageModeling(tok, mlm=False)`` for
the causal LMs (``gpt2``, ``llama``), ``DataCollatorWithPadding`` for
``GPT2ForSequenceClassification`` (``gpt2-cls``, a label per row) and
``DataCollatorForLanguageModeling(tok, mlm=True)`` for ``BertForMaskedLM`` (``bert-mlm``,
15% of the tokens masked at random). ``compile()`` compiles the call as the Trainer makes
it (its ``num_items_in_batch``, ``use_cache=False``, the padded lengths symbolic:
``mbcompile/integrations/transformers.py``), so the Trainer runs every length on that one
compile; ``--upfront`` does the same by hand (the example and ``dynamic=`` as the
Trainer's call has them), as a check of it. A third run is the plain Trainer with its own
gradient accumulation in batches of ``MBS`` rows: the loop a user writes when ``GBS`` rows
do not fit, at the compiled module's microbatch size (each microbatch padded to its own
longest row). The Trainers run in this one process, one
after the other, compile included; the script prints both wall times and their ratio
(goal: compiled at most 1.3x plain), the process's CPU time of each (this machine is
shared: CPU time is the steadier figure), the seconds spent compiling (``compile()`` and
every variant it compiled later, timed around compile()'s chain) and the largest
difference of the trained parameters (float64 model, transformers' float32 regions kept
in float64: <= 1e-9). ``tests/test_dynamic_shapes.py`` runs ``run_both``: 40 steps of the
causal LMs, 12 of the other two. ``--floor`` times the step alone instead (no Trainer): the
whole batch, the plan's microbatches run by hand on the model, and the compiled module;
then the seed of a step's backwards, replayed and traced (``seed_costs``). The compiled
module is planned for ``NUM_CSX`` (2) systems at ``MBS`` (2) rows, the case where ``GBS``
rows do not fit; ``--num-csx 1 --mbs auto`` plans it as a user on one machine whose
batch fits gets it (``"auto"`` on this host: the whole batch in one microbatch), the
accumulating Trainer staying at ``MBS`` rows. ``--layers`` and ``--width`` size the model
(two layers of width 32 by default): the compile's fixed cost (one ``torch.export``,
whose first use in a process imports ``torch._dynamo``) against steps that take longer.
"""

from __future__ import annotations

import argparse
import copy
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

GBS, NUM_CSX, MBS, VOCAB, PAD, MASK = 6, 2, 2, 64, 0, 63
SHORTEST, LONGEST, CLASSES = 5, 60, 3
MODELS = ("gpt2", "llama", "gpt2-cls", "bert-mlm")


class RandomLengths(torch.utils.data.Dataset):
    """Rows of token ids (never the pad id) of random lengths ``SHORTEST..LONGEST``."""

    def __init__(self, n: int, seed: int, labelled: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(SHORTEST, LONGEST + 1, (n,), generator=g).tolist()
        self.rows = [torch.randint(1, MASK, (k,), generator=g).tolist() for k in lengths]
        self.labels = torch.randint(0, CLASSES, (n,), generator=g).tolist() if labelled \
            else None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.labels is None:
            return {"input_ids": self.rows[i]}
        return {"input_ids": self.rows[i], "labels": self.labels[i]}


def tokenizer(transformers: Any) -> Any:
    """A word-level tokenizer built here (no download): the collator only pads with it."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": PAD, **{f"t{i}": i for i in range(1, MASK)}, "<mask>": MASK}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>",
        mask_token="<mask>")
    tok.padding_side = "right"
    return tok


def collator(transformers: Any, name: str) -> Any:
    """The collator of ``name``'s task: each pads a batch to its own longest row."""
    tok = tokenizer(transformers)
    if name == "gpt2-cls":
        return transformers.DataCollatorWithPadding(tok)
    return transformers.DataCollatorForLanguageModeling(tok, mlm=name == "bert-mlm")


def make_model(transformers: Any, name: str, layers: int = 2, width: int = 32) -> nn.Module:
    """A model of ``layers`` layers of ``width`` (two of 32 by default) in float64, without
    dropout; its loss without transformers' float32 upcast (``float64_regions`` keeps
    Llama's RMSNorm in float64)."""
    torch.manual_seed(0)
    if name in ("gpt2", "gpt2-cls"):
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=PAD, num_labels=CLASSES, problem_type="single_label_classification")
        # (without problem_type, the first call sets it: a change of the config that forward
        # reads, so the next call compiles again, once, as a guard must)
        model = (transformers.GPT2LMHeadModel if name == "gpt2" else
                 transformers.GPT2ForSequenceClassification)(config)
    elif name == "bert-mlm":
        config = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
            num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=PAD)
        model = transformers.BertForMaskedLM(config)
        # softmax ignores a key bias (it adds the same to every key of a query): its gradient
        # is rounding alone, which Adam scales to full steps, different for any other
        # order of the sums (microbatches); frozen, in both Trainers
        for layer in model.bert.encoder.layer:
            layer.attention.self.key.bias.requires_grad_(False)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=PAD)
        model = transformers.LlamaForCausalLM(config)
    model = model.double()
    if name != "gpt2-cls":  # its loss is a CrossEntropyLoss() in the logits' dtype already
        model.loss_function = _masked_lm_loss_float64 if name == "bert-mlm" \
            else _causal_lm_loss_float64
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


def _masked_lm_loss_float64(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                            **kwargs: Any) -> torch.Tensor:
    """transformers' ForMaskedLMLoss without its ``logits.float()`` upcast: the labels are
    the tokens' own (no shift)."""
    return _causal_lm_loss_float64(logits, labels, vocab_size, shift_labels=labels, **kwargs)


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


def train(transformers: Any, model: nn.Module, name: str, steps: int, out: Path,
          accumulate: bool = False) -> tuple[float, float]:
    """``steps`` Trainer steps of batches of ``GBS`` rows, padded per batch: (wall, CPU)
    seconds. ``accumulate``: each step as the Trainer's own gradient accumulation, in
    batches of ``MBS`` rows (each padded to its own longest row), the hand-written loop a
    user runs when ``GBS`` rows do not fit."""
    per_batch = MBS if accumulate else GBS
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=per_batch, max_steps=steps,
        gradient_accumulation_steps=GBS // per_batch,
        learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_strategy="no", dataloader_drop_last=True)
    trainer = transformers.Trainer(
        model=model, args=args, data_collator=collator(transformers, name),
        train_dataset=RandomLengths(GBS * steps, 1, labelled=name == "gpt2-cls"))
    start, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    return time.perf_counter() - start, time.process_time() - cpu


@contextmanager
def compiles_timed() -> Iterator[list[tuple[float, float]]]:
    """(wall, CPU) seconds of every run of compile()'s chain after ``compile()`` in the
    block: each variant the module compiles (``compiler._variant``) and each state it
    lowers again for (``compiler._relower``: a train/eval switch, a guard that failed),
    warned or not (the Trainer's ``num_items_in_batch`` variant compiles without one)."""
    from mbcompile import compiler

    runs: list[tuple[float, float]] = []
    chain = {name: getattr(compiler, name) for name in ("_variant", "_relower")}

    def timed(run: Any) -> Any:
        def timing(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return run(*args, **kwargs)
            finally:
                runs.append((time.perf_counter() - start, time.process_time() - cpu))
        return timing

    for name, run in chain.items():  # the module's Recompile binds them at compile()
        setattr(compiler, name, timed(run))
    try:
        yield runs
    finally:
        for name, run in chain.items():
            setattr(compiler, name, run)


def run_both(transformers: Any, name: str, steps: int, upfront: bool = False,
             accumulate: bool = False, num_csx: int = NUM_CSX, mbs: int | str = MBS,
             layers: int = 2, width: int = 32) -> dict[str, Any]:
    """The plain Trainer and the compiled one from the same start, in this process: wall
    seconds of each (compile included), compile seconds, compiles, parameter errors.

    ``upfront``: compile what the Trainer will call in the first place: its
    ``num_items_in_batch`` in the example, the lengths symbolic (``dynamic=``) and the
    config as the Trainer sets it (``use_cache=False``, a value forward reads): one
    compile, no variant at the first step."""
    plain = make_model(transformers, name, layers, width)
    model, accumulated = copy.deepcopy(plain), copy.deepcopy(plain)
    data = RandomLengths(GBS, 0, labelled=name == "gpt2-cls")
    example = dict(collator(transformers, name)([data[i] for i in range(GBS)]))
    options: dict[str, Any] = {}
    if upfront:
        model.config.use_cache = plain.config.use_cache = False
        from mbcompile.integrations.transformers import trainer_keywords

        example.update(trainer_keywords(model, example))  # what it adds, if it adds any
        options["dynamic"] = {k: [1] for k, v in example.items() if getattr(v, "ndim", 0) == 2}
    with float64_regions(transformers), tempfile.TemporaryDirectory() as out, \
            warnings.catch_warnings(record=True) as seen, compiles_timed() as variants:
        warnings.simplefilter("always")
        plain_s, plain_cpu = train(transformers, plain, name, steps, Path(out) / "plain")
        accum_s = accum_cpu = float("nan")
        if accumulate:
            accumulated.config.use_cache = plain.config.use_cache
            accum_s, accum_cpu = train(transformers, accumulated, name, steps,
                                       Path(out) / "accumulated", accumulate=True)
        start, cpu = time.perf_counter(), time.process_time()
        cm = mbcompile.compile(model, GBS, num_csx, mbs, example_kwargs=example,
                               cost_model=isinstance(mbs, str), **options)
        first = (time.perf_counter() - start, time.process_time() - cpu)
        compiled_s, compiled_cpu = train(transformers, cm, name, steps, Path(out) / "compiled")
    recompiles = [w for w in seen if issubclass(w.category, mbcompile.MbcompileWarning)
                  and "compiled once" in str(w.message)]
    runs = [first, *variants]
    return {"plain_s": plain_s, "compiled_s": first[0] + compiled_s, "plain_cpu": plain_cpu,
            "accumulated_s": accum_s, "accumulated_cpu": accum_cpu,
            "accumulated_errors": _errors(plain, accumulated), "errors": _errors(plain, model),
            "compiled_cpu": first[1] + compiled_cpu, "compile_s": sum(w for w, _ in runs),
            "compile_cpu": sum(c for _, c in runs), "compiles": len(runs),
            "cm": cm, "warnings": [f"{w.category.__name__}: {w.message}" for w in recompiles]}


def _errors(want_model: nn.Module, got_model: nn.Module) -> dict[str, float]:
    """Each parameter's largest difference, relative to its largest value."""
    want, got = want_model.state_dict(), got_model.state_dict()
    return {k: float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-300))
            for k in want}


def step_floor(transformers: Any, name: str, steps: int) -> dict[str, float]:
    """CPU ms of one step (forward and backward, no Trainer) on the Trainer's batches, each
    way in turn, twice: the model on the whole batch, the model on the plan's microbatches
    by hand (eager's cost of the same split: the floor of any microbatching) and the
    compiled module; the last round's figures."""
    plain = make_model(transformers, name)
    plain.config.use_cache = False  # as the Trainer sets it
    cm = mbcompile.compile(copy.deepcopy(plain), GBS, NUM_CSX, MBS, cost_model=False,
                           example_kwargs=dict(collator(transformers, name)(
                               [RandomLengths(GBS, 0)[i] for i in range(GBS)])))
    data, pad = RandomLengths(GBS * steps, 1, labelled=name == "gpt2-cls"), \
        collator(transformers, name)
    batches = [dict(pad([data[i] for i in range(k * GBS, (k + 1) * GBS)]))
               for k in range(steps)]
    from mbcompile.integrations.transformers import trainer_keywords

    for batch in batches:  # the Trainer's keyword, as it passes it
        batch.update(trainer_keywords(plain, batch))
    slices = [s for system in cm.plan.microbatch_slices for s in system if s[1] > s[0]]

    def by_hand(batch: dict[str, Any]) -> None:
        for a, b in slices:
            plain(**{k: v[a:b] if v.dim() else v for k, v in batch.items()}).loss.backward()

    ways = {"whole batch": lambda b: plain(**b).loss.backward(), "microbatches by hand":
            by_hand, "compiled": lambda b: cm(**b).loss.backward()}
    ms: dict[str, float] = {}
    with float64_regions(transformers), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            for way, step in ways.items():
                step(batches[0])  # warm
                cpu = time.process_time()
                for batch in batches:
                    step(batch)
                ms[way] = (time.process_time() - cpu) / steps * 1e3
        ms.update(seed_costs(cm, batches[0]))
    return ms


def seed_costs(cm: Any, batch: dict[str, Any], calls: int = 2000) -> dict[str, float]:
    """CPU ms of the seed of one step's backwards (``execution/seeding.py``), computed the
    two ways a step does, on that step's inputs: replayed (the loss's tail, then autograd's
    backward) and as the aten ops that replay ran, traced (after ``TRACE_AFTER`` steps)."""
    from mbcompile.execution import seed_trace

    seed = cm._compiled().channels.config.seed
    seen: list[tuple[Any, ...]] = []
    real = seed.seed
    seed.seed = lambda *args: seen.append(args) or real(*args)  # the step's own inputs
    try:
        cm(**batch).loss.backward()
    finally:
        del seed.seed
    partial, count, first, *drawn = seen[0]
    args = (partial.detach(), *seed._guess(), *((count,) if seed.counted else ()),
            *(drawn[0] if drawn else ()), *(first[i] for i in seed.free))
    traced = seed_trace.trace(seed._replay, args)
    ways = {"seed, replayed": lambda: seed._replay(*args), "seed, traced": lambda: traced(*args)}
    best = {way: float("inf") for way in ways}
    for _ in range(3):  # in turn; the best of three rounds
        for way, fn in ways.items():
            cpu = time.process_time()
            for _ in range(calls):
                fn()
            best[way] = min(best[way], (time.process_time() - cpu) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", choices=MODELS, default="gpt2")
    parser.add_argument("--upfront", action="store_true",
                        help="compile the Trainer's keyword and symbolic lengths up front")
    parser.add_argument("--num-csx", type=int, default=NUM_CSX,
                        help="systems the compiled module plans for (the Trainer's own runs "
                             "are one process either way)")
    parser.add_argument("--mbs", default=str(MBS),
                        help="the compiled module's MBS: an int (planned without the cost "
                             "model), or auto (the cost model's pick for this host)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32,
                        help="the model's width (a multiple of 4): where the compile's fixed "
                             "cost is amortised")
    parser.add_argument("--floor", action="store_true",
                        help="time the step alone: whole batch, microbatches by hand, compiled")
    args = parser.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    if args.floor:
        ms = step_floor(transformers, args.model, args.steps)
        whole = ms["whole batch"]
        print(f"{args.model}, the step alone (forward and backward), {args.steps} batches:")
        for way, t in ms.items():
            if way.startswith("seed"):
                print(f"  {way}: {t * 1e3:.0f} us CPU per step")
                continue
            print(f"  {way}: {t:.1f} ms CPU per step ({t / whole:.2f}x the whole batch)")
        return
    mbs = int(args.mbs) if args.mbs.isdigit() else args.mbs
    run = run_both(transformers, args.model, args.steps, args.upfront, accumulate=True,
                   num_csx=args.num_csx, mbs=mbs, layers=args.layers, width=args.width)
    plan = run["cm"].plan
    print(f"{args.model}{' (up front)' if args.upfront else ''} ({args.layers} layers, width "
          f"{args.width}), {args.steps} steps of {GBS} "
          f"rows of {SHORTEST}-{LONGEST} tokens, padded per batch, {args.num_csx} system(s), "
          f"mbs {mbs!r} (the last step's plan: mbs {plan.mbs}, {plan.num_microbatches} "
          f"microbatch(es) per system):")
    print(f"  Trainer(model=model): {run['plain_s']:.2f} s ({run['plain_cpu']:.2f} s CPU)")
    print(f"  Trainer(model=cm):    {run['compiled_s']:.2f} s ({run['compiled_cpu']:.2f} s CPU),"
          f" of which compiling {run['compile_s']:.2f} s ({run['compile_cpu']:.2f} s CPU) in "
          f"{run['compiles']} compiles")
    print(f"  Trainer(model=model), gradient_accumulation_steps={GBS // MBS} of {MBS} rows: "
          f"{run['accumulated_s']:.2f} s ({run['accumulated_cpu']:.2f} s CPU)")
    steps_cpu = run["compiled_cpu"] - run["compile_cpu"]
    print(f"  ratio compiled / plain: {run['compiled_s'] / run['plain_s']:.2f} wall, "
          f"{run['compiled_cpu'] / run['plain_cpu']:.2f} CPU (goal <= 1.3); the steps alone "
          f"{steps_cpu / run['plain_cpu']:.2f} CPU")
    print(f"  ratio compiled / accumulated by the Trainer (the same microbatch size): "
          f"{run['compiled_s'] / run['accumulated_s']:.2f} wall, "
          f"{run['compiled_cpu'] / run['accumulated_cpu']:.2f} CPU")
    print(f"  largest relative difference of a trained parameter: "
          f"{max(run['errors'].values()):.1e} (the Trainer's accumulation: "
          f"{max(run['accumulated_errors'].values()):.1e})")


if __name__ == "__main__":
    main()
