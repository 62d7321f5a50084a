"""User journeys, fourth round continued (tests/test_user_journeys_4.py says what the round
covers): ``mbcompile.Trainer`` on two gloo ranks, its batches padded to their own length,
validation between steps, and the epoch's short last batch that the same Trainer trains
exactly on one process (each rank's rows and parameters against a plain full-batch loop);
a call refused on one rank only; the HF Trainer on a LoRA model with gradient
checkpointing; what ``cm.plan`` says of a token budget's call at another length."""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from test_user_journeys import _batch
from test_user_journeys_4 import GBS, LENGTHS, MBS, _data

import mbcompile
from mbcompile.models import TinyGPT

RANKS = pytest.mark.xdist_group("user_journeys_4.ranks")  # one forkserver, one rank pair at a time


def _validation(short: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validation batches at other lengths: of gbs, and one of 4 samples if ``short``."""
    return [_batch(10, GBS, seed=1)] + ([_batch(6, 4, seed=2)] if short else [])


def trainer_on_ranks(rank: int, world: int, out_dir: str, steps: int, short: bool) -> None:
    """``mbcompile.Trainer.fit`` with ``backend="torch.distributed"`` (it cuts each batch
    into this rank's share), SGD, validation every 4 steps; saves the rows, what it raised
    and the parameters."""
    from rich.console import Console

    torch.manual_seed(0)
    model = TinyGPT().double()
    trainer = mbcompile.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gbs=GBS,
        num_csx=world, console=Console(file=io.StringIO()), progress=False,
        compile_options={"cost_model": False}, backend="torch.distributed",
        callbacks=[mbcompile.GlobalFlags(micro_batch_size=MBS)])
    outcome, rows = "ok", []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # lengths compiled once
            rows = trainer.fit(_data()[:steps], _validation(short), max_steps=steps,
                               val_every=4, val_steps=len(_validation(short)))
    except Exception as exc:  # what each rank saw is the result
        outcome = f"{type(exc).__name__}: {exc}"
    torch.save({"outcome": outcome, "rows": rows,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _plain(steps: int, short: bool) -> tuple[torch.nn.Module, list[float], list[float]]:
    """The same fit in one process, by hand: losses, validation losses (after steps 4, 8
    and at the end, as fit validates), the model."""
    torch.manual_seed(0)
    model = TinyGPT().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, val = [], []
    for i, batch in enumerate(_data()[:steps]):
        opt.zero_grad()
        loss = model(*batch)[0]
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if i % 4 == 3 or i == steps - 1:
            model.eval()
            with torch.no_grad():
                val += [float(model(*b)[0]) for b in _validation(short)]
            model.train()
    return model, losses, val


def _check_ranks(folder: Path, steps: int, short: bool) -> None:
    from test_distributed import _run

    _run(trainer_on_ranks, 2, str(folder), steps, short, timeout_s=120,
         collective_timeout_s=30)
    model, losses, val = _plain(steps, short)
    for rank in range(2):
        got = torch.load(folder / f"rank{rank}.pt")
        assert got["outcome"] == "ok", (rank, got["outcome"])
        rows: list[dict[str, Any]] = got["rows"]
        assert [r["loss"] for r in rows if r["phase"] == "train"] == pytest.approx(
            losses, rel=1e-12), rank
        assert [r["loss"] for r in rows if r["phase"] == "validate"] == pytest.approx(
            val, rel=1e-12), rank
        for name, p in model.named_parameters():
            assert (got["params"][name] - p.detach()).abs().max() < 1e-12, (rank, name)


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
def test_trainer_on_two_ranks_at_changing_lengths_with_validation_is_the_plain_loop(tmp_path):
    """Eight batches padded to their own length (3 to 16), validation at another length
    every 4 steps and at the end: every rank logs the global loss, as one process does."""
    _check_ranks(tmp_path, len(LENGTHS), short=False)


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
def test_trainer_on_two_ranks_trains_a_short_last_batch_and_validates_a_small_one(tmp_path):
    """The epoch's short last batch (5 of gbs 7) and a validation batch of 4: every rank
    runs its share of a plan for that size, as one process runs the batch (it was refused
    on both ranks by shard()'s InputError naming drop_last=True)."""
    _check_ranks(tmp_path, len(LENGTHS) + 1, short=True)


@pytest.mark.slow  # two ranks: 8 s or more on 2 cores
@RANKS
@pytest.mark.parametrize("kind, fsdp", [("train", False), ("no_grad", True)])
def test_a_call_refused_on_one_rank_is_refused_on_every_rank(tmp_path, kind, fsdp):
    # (4 + 4 rows of an 8-row batch where gbs 7 shares 4 + 3: rank 1 refused alone, before
    # any collective; rank 0 ran the step, its collectives paired with rank 1's next step,
    # then gloo's 'Connection closed by peer', SIGABRT in eval; then, under no_grad with
    # FSDP2, rank 1 refused before its gathers: gloo's size mismatch, SIGABRT)
    from test_distributed import _run
    from test_user_journeys_4 import RANK_STEPS, _plain_ranks, ranks_journey

    rows = _batch(9, 8, seed=4)
    steps = [RANK_STEPS[0], (kind, None, (tuple(t[:4] for t in rows),
                                         tuple(t[4:] for t in rows))), RANK_STEPS[0]]
    _run(ranks_journey, 2, str(tmp_path), steps, MBS, fsdp, timeout_s=60,
         collective_timeout_s=15)
    _, losses, _ = _plain_ranks(steps)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["outcomes"][1].startswith("InputError"), (rank, got["outcomes"])
        assert got["outcomes"][2] == "ok", (rank, got["outcomes"])
        assert got["losses"][2] == pytest.approx(losses[2], rel=1e-12), rank


@pytest.mark.slow  # two Trainer runs: 12 s on 2 cores
def test_hf_trainer_trains_a_lora_model_with_checkpointing_and_saves_its_adapter(tmp_path):
    """``Trainer(model=cm)`` on a LoRA ``PeftModel`` (compiled through its wrapper) with the
    padding collator, ``gradient_checkpointing=True`` (its input hook: one recompile),
    evaluation every 2 steps and a checkpoint at step 2: as the plain Trainer, and the
    checkpoint is the adapter's own files (no recompile for it)."""
    tf = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_user_journeys_4 import _bench, _compile_copy, _hf_trainer, _logged, _updates

    tf.logging.set_verbosity_error()
    bd = _bench()
    torch.manual_seed(1)
    plain = peft.get_peft_model(bd.make_model(tf, "gpt2", layers=1), peft.LoraConfig(
        r=4, target_modules=["c_attn"], init_lora_weights=False, fan_in_fan_out=True,
        lora_dropout=0.0))
    model, cm = _compile_copy(tf, plain)
    start = {k: v.clone() for k, v in plain.state_dict().items()}
    runs = []
    for i, m in enumerate((plain, cm)):
        trainer = _hf_trainer(tf, m, tmp_path / f"run{i}", eval_strategy="steps", eval_steps=2,
                              learning_rate=1e-2, save_strategy="steps", save_steps=2,
                              gradient_checkpointing=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            trainer.train()
        runs.append({"trainer": trainer, "recompiles": [
            str(w.message) for w in seen if issubclass(w.category, mbcompile.RecompileWarning)]})
    assert max(_updates(start, plain, model).values()) < 1e-9
    for key in ("loss", "eval_loss"):
        assert _logged(runs[1], key) == pytest.approx(_logged(runs[0], key), rel=1e-12), key
    assert len(runs[1]["recompiles"]) == 1 and "hooks of" in runs[1]["recompiles"][0]
    assert (tmp_path / "run1" / "checkpoint-2" / "adapter_model.safetensors").exists()


def test_a_token_budgets_plan_reason_is_the_calls_length():
    """What ``cm.plan`` (and a Trainer's log of it) says of the last call, at each length.
    (At a length whose MBS is the example's, it said the example's: '2 samples of 12
    tokens' at length 8.)"""
    torch.manual_seed(0)
    model = TinyGPT().double()
    cm = mbcompile.compile(model, GBS, 2, {"tokens": 24}, example_inputs=_batch(12),
                           cost_model=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for length in (6, 8):
            cm(*_batch(length))[0].backward()
            assert cm.plan.tokens_per_sample == length
            assert "12 tokens" not in cm.plan.reason, (length, cm.plan.reason)
