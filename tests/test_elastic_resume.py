"""Elastic resume: a checkpoint written with N systems or ranks resumes with M at the same
GBS, and the run goes on as the uninterrupted one: the same sample order, steps, LR
schedule and metrics rows, losses and parameters equal to rounding (float64, TOL).

The model draws nothing at random (dropout off: its draws depend on the split, the
documented exception); the data shuffles with the global torch RNG each pass and adds
noise from Python's and numpy's, so the resumed run must restore all of them. What
cannot carry over (another GBS or optimizer) is refused without suggesting the command
that failed.
"""

from __future__ import annotations

import io
import json
import random
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from mbcompile.training.checkpoint import CheckpointError, latest_checkpoint, read_checkpoint
from mbcompile.training.flags import GlobalFlags
from mbcompile.training.trainer import Trainer

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from checkpoint_workers import DropoutMLP, shuffled  # noqa: E402
from models import TOL  # noqa: E402
from test_checkpoint import here  # noqa: E402, F401  (a fixture: mbcompile ARGS in process)

GBS, STEPS, STOP = 8, 7, 4  # 24 samples: passes of 3 batches, stopped inside the second
SAME = ("phase", "step", "global_step", "lr", "samples")  # equal; the plan's columns differ


def fit(folder: Path, num_csx: int, max_steps: int, resume: bool = False,
        gbs: int = GBS, optimizer: type = torch.optim.AdamW) -> tuple[Trainer, list, str]:
    """A trainer and data as a new process builds them, and its fit's rows and output."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = DropoutMLP(p=0.0, double=True)
    out = io.StringIO()
    trainer = Trainer(model, optimizer(model.parameters(), lr=1e-2), gbs=gbs, num_csx=num_csx,
                      callbacks=[GlobalFlags(micro_batch_size=2)], console=Console(file=out),
                      log_dir=folder, checkpoint_every=2, reference_batch_size=4,
                      warmup_steps=5)
    rows = trainer.fit(shuffled(gbs, samples=24, double=True), max_steps=max_steps,
                       resume=resume)
    return trainer, rows, out.getvalue()


def assert_same_run(rows: list[dict], reference: list[dict]) -> None:
    assert [[r[k] for k in SAME] for r in rows] == [[r[k] for k in SAME] for r in reference]
    for r, ref in zip(rows, reference):
        assert abs(r["loss"] - ref["loss"]) <= TOL * max(1.0, abs(ref["loss"])), r["step"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1)])
def test_simulated_systems_resume_on_another_number(tmp_path, before, after):
    references = {n: fit(tmp_path / f"ref{n}", n, STEPS) for n in (before, after)}
    fit(tmp_path / "run", before, STOP)
    trainer, rows, out = fit(tmp_path / "run", after, STEPS, resume=True)
    # the console wraps long lines at its width (80 columns without a terminal)
    assert f"written with {before} systems on 1 process, resumed with {after} on 1" in \
        " ".join(out.split())
    assert len(rows) == STEPS  # the whole fit's rows: those before the checkpoint read back
    assert [r["num_microbatches"] for r in rows] == \
        [r["num_microbatches"] for r in references[before][1][:STOP]] + \
        [r["num_microbatches"] for r in references[after][1][STOP:]]
    params = trainer.model.state_dict()
    for n, (ref, ref_rows, _) in references.items():
        assert_same_run(rows, ref_rows)
        assert max_difference(params, ref.model.state_dict()) <= TOL, n
        assert trainer.optimizer.state_dict()["state"][0]["step"] == STEPS
        assert trainer.lr_scaling == ref.lr_scaling


def test_another_gbs_or_optimizer_is_refused_with_what_differs(tmp_path):
    fit(tmp_path / "run", 2, 2)
    with pytest.raises(CheckpointError, match=r"written with gbs 8 \(now 12\): the global "
                       "batch fixes the sample order") as info:
        fit(tmp_path / "run", 3, 4, resume=True, gbs=12)
    assert "number of systems and ranks may change" in str(info.value)
    with pytest.raises(CheckpointError, match=r"optimizer AdamW \(now SGD\)"):
        fit(tmp_path / "run", 2, 4, resume=True, optimizer=torch.optim.SGD)


def test_a_model_of_the_same_class_and_another_shape_is_refused_loading_nothing(tmp_path):
    """torch's own RuntimeError halfway through load_state_dict, some tensors copied in,
    before (found by a hunt)."""
    fit(tmp_path / "run", 2, 2)
    torch.manual_seed(0)
    model = DropoutMLP(hidden=32, p=0.0, double=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), gbs=GBS,
                      num_csx=2, callbacks=[GlobalFlags(micro_batch_size=2)], progress=False,
                      log_dir=tmp_path / "run", checkpoint_every=2)
    with pytest.raises(CheckpointError, match=r"l1.weight has shape \(16, \d+\) \(the model's: "
                       r"\(32, \d+\)\).*nothing was loaded"):
        trainer.fit(shuffled(GBS, samples=24, double=True), max_steps=4, resume=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------- #
# torch.distributed ranks, through ``mbcompile fit --nproc``
# --------------------------------------------------------------------------- #

CONFIG = """
    model: {{name: checkpoint_workers:DropoutMLP, kwargs: {{p: 0.0, double: true}}}}
    data: {{source: checkpoint_workers:shuffled, kwargs: {{samples: 24, double: true}}}}
    batch_size: {gbs}
    num_csx: {num_csx}
    optimizer: {{name: AdamW, lr: 1.0e-2}}
    callbacks:
      - GlobalFlags: {{micro_batch_size: 2}}
    lr_scaling: {{reference_batch_size: 4, warmup_steps: 5}}
    fit: {{max_steps: 6, checkpoint_every: 2}}
    shard: {shard}
"""


def config(tmp_path: Path, num_csx: int, gbs: int = GBS, shard: str = "none") -> str:
    name = f"run{num_csx}-{gbs}-{shard}.yaml"
    text = CONFIG.format(gbs=gbs, num_csx=num_csx, shard=shard)
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name


def logged(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    last = latest_checkpoint(folder / "checkpoints")
    assert last is not None and last.name == "step-00000006"
    return dict(read_checkpoint(last).state["model"])


@pytest.mark.slow
@pytest.mark.parametrize("before,after,shard", [(2, 3, "none"), (3, 2, "none"),
                                                (3, 2, "fsdp")])
def test_ranks_resume_on_another_number(tmp_path, here, before, after, shard):  # noqa: F811
    """FSDP2 too: DCP reads the shards of 3 ranks into the DTensors of 2 (resharding)."""
    code, _, err = here("fit", config(tmp_path, before), "--out", "ref")  # one process
    assert code == 0, err
    code, _, err = here("fit", config(tmp_path, before, shard=shard), "--out", "run",
                        "--nproc", str(before), "--max-steps", "3")
    assert code == 0, err
    code, out, err = here("fit", config(tmp_path, after, shard=shard), "--out", "run",
                          "--nproc", str(after), "--resume")
    assert code == 0, err
    assert f"written with {before} systems on {before} processes, resumed with {after} on " \
           f"{after}" in " ".join(out.split())  # wrapped at the console's width
    assert "config differs" not in err and "fewer than" not in err, err  # num_csx may change
    assert_same_run(logged(tmp_path / "run"), logged(tmp_path / "ref"))
    assert not list((tmp_path / "run").glob("rank*"))  # rank 0 alone writes the metrics
    assert max_difference(final_model(tmp_path / "run"), final_model(tmp_path / "ref")) <= TOL
    # another global batch is refused by every rank, and the command is not suggested again
    code, _, err = here("fit", config(tmp_path, after, gbs=12, shard=shard), "--out", "run",
                        "--nproc", str(after), "--resume")
    assert code == 1
    assert err.startswith("error: checkpoint run/checkpoints/step-00000006 was written with "
                          "gbs 8 (now 12)"), err
    assert "resume with" not in err and "Traceback" not in err, err


def test_ranks_whose_rngs_drifted_apart_shuffle_each_pass_alike():
    from checkpoint_workers import shuffles_alike

    from mbcompile.execution.launcher import launch

    launch(shuffles_alike, 3)


def test_check_run_fixes_gbs_model_optimizer_and_sharding_and_lets_systems_change():
    from mbcompile.training.elastic import check_run

    run = {"gbs": 8, "num_csx": 2, "world_size": 2, "shard": "fsdp", "model": "FSDPGPT",
           "optimizer": "AdamW"}
    assert check_run(Path("ck"), run, run) is None
    assert check_run(Path("ck"), run, {**run, "num_csx": 4, "world_size": 4}) == (
        "written with 2 systems on 2 processes, resumed with 4 on 4: the same gbs 8, sample "
        "order and LR schedule; the plan is recomputed")
    assert check_run(Path("ck"), run, {**run, "model": "GPT"}) is None  # FSDP2's class name
    with pytest.raises(CheckpointError, match=r"with model FSDPGPT \(now MLP\), shard fsdp "
                       r"\(now None\): .*another model's; sharded and unsharded .* Resume "
                       "it with the model and shard it was written with"):
        check_run(Path("ck"), run, {**run, "shard": None, "model": "MLP", "world_size": 1})


def test_a_changed_config_says_which_values_the_resumed_run_keeps(capsys):
    """A changed lr was said to continue "with the new values", while the optimizer's
    state dict restored the checkpoint's (found by a hunt)."""
    from mbcompile.training.elastic import warn_config

    then = {"optimizer_kwargs": {"lr": 0.01}, "outputs": "loss", "lr_scaling": {"warmup_steps": 2}}
    now = {"optimizer_kwargs": {"lr": 0.001}, "outputs": "all", "lr_scaling": {"warmup_steps": 8}}
    warn_config(Path("ck"), then, now)
    err = capsys.readouterr().err
    assert "outputs (the run continues with the new values)" in err
    assert "lr_scaling, optimizer_kwargs (the run continues with the checkpoint's" in err
