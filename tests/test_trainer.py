"""Trainer: scoped MBS per phase, restore after a failing phase, compile once per phase
(once for both at a shared pinned MBS), exact steps, per-step logs."""

from __future__ import annotations

import copy
import csv
import inspect
import io
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.console import Console

from mbcompile import compiler
from mbcompile.errors import ArgumentTypeError
from mbcompile.models import make_mlp
from mbcompile.training.flags import Callback, GlobalFlags, ScopedTrainFlags, ScopedValidateFlags
from mbcompile.training.trainer import (
    COMPILE_OPTIONS,
    Trainer,
    TrainerError,
    batch_args,
)

GBS, NUM_CSX = 12, 2  # pbs 6: supported MBS 1, 2, 3, 6


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GBS, 8, generator=g, dtype=torch.float64),
             torch.randn(GBS, 3, generator=g, dtype=torch.float64)) for _ in range(n)]


class Recorder(Callback):
    """Records the MBS flag the trainer sees at each step, and phase boundaries."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def on_train_step_end(self, trainer, row):
        self.seen.append(("train", trainer.flags.micro_batch_size))

    def on_validate_step_end(self, trainer, row):
        self.seen.append(("validate", trainer.flags.micro_batch_size))


def make_trainer(*callbacks, model=None, **kwargs):
    if model is None:
        model, _ = make_mlp(GBS, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs.setdefault("console", Console(file=io.StringIO()))
    return Trainer(model, opt, gbs=GBS, num_csx=NUM_CSX, callbacks=list(callbacks), **kwargs)


def test_each_phase_runs_with_its_own_mbs_and_globals_come_back():
    rec = Recorder()
    trainer = make_trainer(GlobalFlags(micro_batch_size=6), ScopedTrainFlags(micro_batch_size=2),
                           ScopedValidateFlags(**{"csx.performance.micro_batch_size": 3}), rec)
    assert trainer.flags.micro_batch_size == 6
    rows = trainer.fit(batches(3), batches(2, seed=1), max_steps=4, val_every=2, val_steps=1)
    # validation in the middle (step 2) and at the end; train flags never leak into it
    assert rec.seen == [("train", 2), ("train", 2), ("validate", 3), ("train", 2), ("train", 2),
                        ("validate", 3)]
    assert [(r["phase"], r["mbs"]) for r in rows] == [
        ("train", 2), ("train", 2), ("validate", 3), ("train", 2), ("train", 2), ("validate", 3)]
    assert trainer.flags.micro_batch_size == 6 and trainer.flags.depth == 0
    summary = trainer.validate(batches(1, seed=2))  # standalone: the validation scope again
    assert summary["mbs"] == 3 and summary["steps"] == 1
    assert trainer.flags.micro_batch_size == 6


def test_flags_and_modes_are_restored_when_a_phase_raises():
    class Boom(Callback):
        def on_train_step_end(self, trainer, row):
            if row["step"] == 2:
                raise RuntimeError("boom")

    trainer = make_trainer(GlobalFlags(micro_batch_size=6), ScopedTrainFlags(micro_batch_size=2),
                           Boom())
    trainer.model.eval()
    before = trainer.flags.snapshot()
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(batches(3), max_steps=3)
    assert trainer.flags.snapshot() == before == {"micro_batch_size": 6}
    assert trainer.flags.depth == 0
    assert not trainer.model.training  # the user's mode is back
    assert trainer._live is None  # the progress display is closed

    def broken_data():
        yield batches(1)[0]
        raise ValueError("reader failed")

    with pytest.raises(ValueError, match="reader failed"):
        trainer.validate(broken_data())
    assert trainer.flags.snapshot() == before and trainer.flags.depth == 0


def count_compiles(monkeypatch) -> list:
    """The MBS of every ``mbcompile.compile`` call from here on."""
    calls = []
    real = compiler.compile

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "compile", counting)
    return calls


def test_each_phase_compiles_once_and_reuses(monkeypatch):
    calls = count_compiles(monkeypatch)
    trainer = make_trainer(ScopedTrainFlags(micro_batch_size=2),
                           ScopedValidateFlags(micro_batch_size=3))
    trainer.fit(batches(2), batches(1), max_steps=4, val_every=1, val_steps=1)
    trainer.fit(batches(2), batches(1), max_steps=2, val_steps=1)
    assert calls == [2, 3]  # one compile per phase, across steps and fits
    assert sorted(k[0] for k in trainer.compiled) == ["train", "validate"]


class DropoutMLP(nn.Module):
    """Different in eval mode: the module must switch to its eval graph to validate."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x, y):
        pred = self.net(x)
        return F.mse_loss(pred, y), pred


def test_validation_runs_on_the_train_phase_module_at_a_pinned_mbs(monkeypatch):
    """The model compiles once for both phases when they share a pinned MBS (plan
    arithmetic, the same in either mode): the compiled module builds its eval-mode graph
    itself, and validation gives, bit for bit, what a compile in eval mode gives."""
    fresh_compile = compiler.compile
    calls = count_compiles(monkeypatch)
    torch.manual_seed(0)
    model = DropoutMLP().double()
    trainer = make_trainer(GlobalFlags(micro_batch_size=3), model=model)
    val = batches(1, seed=1)
    rows = trainer.fit(batches(2), val, max_steps=2, val_every=1, val_steps=1)
    assert calls == [3]
    assert trainer.compiled[("validate", "3")] is trainer.compiled[("train", "3")]
    assert [(r["phase"], r["mbs"], r["num_microbatches"]) for r in rows] == [
        ("train", 3, 2), ("validate", 3, 2), ("train", 3, 2), ("validate", 3, 2)]
    model.eval()
    with torch.no_grad():
        fresh, _ = fresh_compile(model, GBS, NUM_CSX, 3, example_inputs=val[0])(*val[0])
        eager, _ = model(*val[0])
    assert rows[-1]["loss"] == float(fresh)
    assert rows[-1]["loss"] == pytest.approx(float(eager), rel=1e-12)  # no dropout: eval mode


def test_validation_runs_on_the_train_phase_module_at_auto_unless_laid_out_otherwise(
        monkeypatch):
    """``auto``'s MBS was checked for a training step, which holds more than a forward: the
    validation phase runs on the train phase's module (it compiled its own, planned as a
    training step without activation checkpointing). A module takes only batches laid out
    like its example: then the validation phase compiles for itself."""
    calls = count_compiles(monkeypatch)
    trainer = make_trainer(GlobalFlags(micro_batch_size="auto"))
    trainer.fit(batches(1), batches(1, seed=1), max_steps=1, val_steps=1)
    assert calls == ["auto"]
    assert trainer.compiled[("validate", '"auto"')] is trainer.compiled[("train", '"auto"')]
    calls.clear()
    trainer = make_trainer(GlobalFlags(micro_batch_size=3))
    x, y = batches(1, seed=1)[0]
    rows = trainer.fit(batches(1), [{"x": x, "y": y}], max_steps=1, val_steps=1)
    assert calls == [3, 3] and rows[-1]["phase"] == "validate"


def test_a_validation_on_systems_that_fit_training_only_with_checkpointing_runs():
    """The demo's systems (``cli/demo.py``): memory between what MBS 1 needs with
    activation checkpointing and the whole batch. Training picks a split that fits; the
    first validation was refused ("even mbs=1 does not fit", 10 steps into a fit): its own
    compile in eval mode charged gradients and optimizer state and no checkpointing."""
    from mbcompile.models import make_tiny_gpt
    from mbcompile.training.cli.demo import _demo_system

    torch.manual_seed(0)
    model, batch = make_tiny_gpt(16, dtype=torch.float32)
    system = _demo_system(model, batch, 16, 4).spec
    trainer = Trainer(model, torch.optim.AdamW(model.parameters()), gbs=16, num_csx=4,
                      callbacks=[GlobalFlags(micro_batch_size="auto")], system=system,
                      console=Console(file=io.StringIO()))
    rows = trainer.fit([batch], [batch], max_steps=1, val_steps=1)
    assert [r["phase"] for r in rows] == ["train", "validate"]
    model.eval()
    with torch.no_grad():
        eager = model(*batch)[0]
    assert rows[-1]["loss"] == pytest.approx(float(eager), rel=1e-5)
    # validation alone (mbcompile validate): its own module, planned as a training step
    alone = Trainer(model, torch.optim.AdamW(model.parameters()), gbs=16, num_csx=4,
                    callbacks=[GlobalFlags(micro_batch_size="auto")], system=system,
                    console=Console(file=io.StringIO()))
    assert alone.validate([batch])["loss"] == pytest.approx(float(eager), rel=1e-5)
    assert not model.training  # the modes it had are back


def test_a_validation_alone_of_batchnorm_on_one_row_batches_is_eagers():
    """Compiled as training would be, a BatchNorm model cannot run a batch of one row (in
    train mode it needs two): the validation's own compile falls back to eval mode, as
    before, instead of refusing (found by a review)."""
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.lin = nn.BatchNorm1d(6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.lin(self.bn(x)), y)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    val = [(torch.randn(1, 6, generator=g), torch.randint(0, 3, (1,), generator=g))
           for _ in range(2)]
    model = Normed().double()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), gbs=1, num_csx=1,
                      callbacks=[GlobalFlags(micro_batch_size=1)],
                      compile_options={"cost_model": False}, console=Console(file=io.StringIO()))
    got = trainer.validate([(x.double(), y) for x, y in val])["loss"]
    model.eval()
    with torch.no_grad():
        want = sum(float(model(x.double(), y)) for x, y in val) / 2
    assert got == pytest.approx(want, rel=1e-12)
    assert model.bn.training is False and int(model.bn.num_batches_tracked) == 0


def test_the_trainer_takes_every_compile_option_it_does_not_set_itself():
    """``COMPILE_OPTIONS`` is stated by hand; this keeps it equal to ``compile``'s own
    keyword options (the product never reads compile's signature). ``shard`` is the
    Trainer's own: it shards the model on its ranks, where compile's plans without ranks."""
    params = inspect.signature(compiler.compile).parameters
    keyword = {name for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert set(COMPILE_OPTIONS) == keyword - {"example_inputs", "example_kwargs", "in_dims",
                                              "shard"}


def test_a_step_equals_a_full_batch_sgd_step():
    model, _ = make_mlp(GBS, dtype=torch.float64)
    reference = copy.deepcopy(model)
    data = batches(1)
    trainer = make_trainer(GlobalFlags(micro_batch_size=2), model=model, progress=False)
    (row,) = trainer.fit(data, max_steps=1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    loss, _ = reference(*data[0])
    loss.backward()
    opt.step()
    assert row["loss"] == pytest.approx(loss.item(), rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


def test_rows_go_to_csv_jsonl_and_the_terminal(tmp_path):
    out = io.StringIO()
    trainer = make_trainer(GlobalFlags(micro_batch_size=3), log_dir=tmp_path / "run",
                           metrics={"pred_mean": lambda output, batch: output[1].mean()},
                           console=Console(file=out, width=200), log_every=2)
    trainer.fit(batches(2), batches(1), max_steps=3, val_steps=1)
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["phase"] for r in rows] == ["train"] * 3 + ["validate"]
    assert [r["step"] for r in rows] == ["1", "2", "3", "1"]
    assert all(float(r["loss"]) > 0 and r["mbs"] == "3" for r in rows)
    assert rows[0]["lr"] == "0.1" and rows[-1]["lr"] == ""
    assert "pred_mean" in rows[0]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["global_step"] for line in lines] == [1, 2, 3, 3]
    text = out.getvalue()
    assert "train step 2/3: loss" in text and "train step 3/3" in text
    assert "train step 1/3" not in text  # log_every=2; the last step is always shown
    assert "validate: mean loss" in text


def test_noise_scale_monitor_logs_b_simple_in_training_rows_only(tmp_path):
    """b_simple is in each training row as the row is written (not added after it), and
    validation rows, in the middle of fit and at its end, carry none."""
    from mbcompile.training.monitors import NoiseScaleMonitor

    trainer = make_trainer(GlobalFlags(micro_batch_size=3), NoiseScaleMonitor(),
                           log_dir=tmp_path / "run")
    trainer.fit(batches(3), batches(1), max_steps=3, val_every=2, val_steps=1)
    lines = [json.loads(line)
             for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["phase"], isinstance(r["b_simple"], float)) for r in lines] == [
        ("train", True), ("train", True), ("validate", False), ("train", True),
        ("validate", False)]
    assert [r["b_simple"] for r in lines] == [r["b_simple"] for r in trainer.history]
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert [r["b_simple"] for r in csv.DictReader(f)] == [
            "" if r["b_simple"] is None else str(r["b_simple"]) for r in lines]


def test_batch_forms():
    """(The loss a step logs is the compiled module's cm.loss_of: test_compiled_module.)"""
    x = torch.ones(2)
    assert batch_args(x) == ((x,), {})
    assert batch_args({"x": x}) == ((), {"x": x})
    assert batch_args([x, x]) == ((x, x), {})
    with pytest.raises(TrainerError, match="a batch must be"):
        batch_args(3)


def test_bad_arguments_fail_before_anything_runs():
    model, _ = make_mlp(GBS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ArgumentTypeError, match="torch.optim.Optimizer"):
        Trainer(model, "sgd", gbs=GBS, num_csx=NUM_CSX)
    with pytest.raises(ArgumentTypeError, match="callbacks must be"):
        Trainer(model, opt, gbs=GBS, num_csx=NUM_CSX, callbacks=[{"micro_batch_size": 2}])
    with pytest.raises(TrainerError, match="no 'frobnicate' option"):
        Trainer(model, opt, gbs=GBS, num_csx=NUM_CSX, compile_options={"frobnicate": 1})
    trainer = make_trainer()
    with pytest.raises(TrainerError, match="yielded no batches"):
        trainer.fit([], max_steps=2)
    with pytest.raises(TrainerError, match="max_steps must be at least 1"):
        trainer.fit(batches(1), max_steps=0)


def test_a_precision_in_compile_options_is_the_autocast_the_steps_run_under():
    """``precision: bf16-mixed`` planned bfloat16 and trained in float32, silently (found by
    a hunt): the steps' calls now run in its autocast, the optimizer step outside it, as a
    loop over the compiled module under a per-step autocast does."""
    import mbcompile
    from mbcompile.models import make_tiny_gpt, token_batch

    torch.manual_seed(0)
    model, _ = make_tiny_gpt(8)
    data = [token_batch(8, seed=s) for s in range(2)]
    looped, trained = copy.deepcopy(model), copy.deepcopy(model)
    cm = mbcompile.compile(looped, 8, 2, 2, example_inputs=data[0], precision="bf16-mixed")
    opt = torch.optim.AdamW(looped.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = cm(*data[step % 2])[0]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    trainer = Trainer(trained, torch.optim.AdamW(trained.parameters(), lr=1e-2), gbs=8,
                      num_csx=2, callbacks=[GlobalFlags(micro_batch_size=2)], progress=False,
                      compile_options={"precision": "bf16-mixed"})
    assert [r["loss"] for r in trainer.fit(data, max_steps=3)] == losses
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), looped.parameters()))
    with pytest.raises(TrainerError, match="GradScaler"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), gbs=8, num_csx=2,
                compile_options={"precision": "fp16-mixed"})


def test_validation_draws_nothing_training_reads(tmp_path):
    """A validation ``DataLoader``'s ``iter()`` draws a seed from the global RNG: a finished
    fit extended with ``resume=True`` drew other dropout masks and shuffles than the
    uninterrupted run (parameters 1.6e-2 apart; found by a hunt)."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(3)
    train = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 3, generator=g))
    val = DataLoader(TensorDataset(torch.randn(16, 8, generator=g),
                                   torch.randn(16, 3, generator=g)), batch_size=8)

    def trainer(folder: str) -> tuple[Trainer, nn.Module]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
        wrapped = _Regressor(model)
        return Trainer(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2), gbs=8,
                       num_csx=2, callbacks=[GlobalFlags(micro_batch_size=2)], progress=False,
                       log_dir=folder, checkpoint_every=3), wrapped

    def fit(folder: str, steps: int, resume: bool = False) -> nn.Module:
        t, model = trainer(folder)
        t.fit(DataLoader(train, batch_size=8, shuffle=True), val, max_steps=steps,
              val_every=2, val_steps=1, resume=resume)
        return model

    whole = fit(str(tmp_path / "a"), 8)
    fit(str(tmp_path / "b"), 4)
    extended = fit(str(tmp_path / "b"), 8, resume=True)
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), extended.parameters()))


class _Regressor(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def test_resumed_metrics_stay_under_their_own_headers(tmp_path):
    """A resumed Trainer whose metrics come in another order wrote its values under the
    first run's headers in metrics.csv (pred_mean and pred_max swapped; found by a hunt)."""
    from mbcompile.training.metrics import MetricsLog

    first = MetricsLog(tmp_path, ["phase", "a", "b"])
    first.write({"phase": "train", "a": 1, "b": 2})
    first.write({"phase": "train", "a": 3, "b": 4})
    again = MetricsLog(tmp_path, ["phase", "b", "a"])
    again.resume(1)
    again.write({"phase": "train", "a": 5, "b": 6})
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["a"], r["b"]) for r in rows] == [("1", "2"), ("5", "6")]
