"""Sharded training from a config: ``shard: fsdp``, ``mbcompile fit --nproc N``, and
checkpoints of the shards through ``torch.distributed.checkpoint`` that resume exactly.

The config and refusal tests run in process; the rest spawn 2 gloo ranks, through the
installed ``mbcompile`` command (as a user runs it) or the Trainer.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mbcompile.check import relative_error
from mbcompile.execution.launcher import free_port
from mbcompile.training.checkpoint import latest_checkpoint, read_checkpoint
from mbcompile.training.cli.main import main
from mbcompile.training.config import ConfigError, build_trainer, load_config
from mbcompile.training.trainer import Trainer, TrainerError, shard_model

TESTS = Path(__file__).resolve().parent
EXAMPLE = TESTS.parent / "examples" / "fsdp" / "tiny_gpt.yaml"
HF_EXAMPLE = TESTS.parent / "examples" / "hf" / "llama_fsdp.yaml"
sys.path.insert(0, str(TESTS))
import fsdp_training_workers  # noqa: E402
from test_checkpoint import (  # noqa: E402
    assert_one_row_per_step,
    environment,
    mbcompile_command,
    rows,
    steps_of,
)
from test_distributed import _run  # noqa: E402

MAX_STEPS = 8  # 40 samples / gbs 8: passes of 5 batches, so the run is in its second pass
STOP_AT = 5  # SIGTERM (every rank) while it fetches this step's batch: ranks stop after 6
CONFIG = f"""
    model: {{name: fsdp_training_workers:Regressor, kwargs: {{width: 8, depth: 2}}}}
    data: {{source: checkpoint_workers:shuffled, kwargs: {{samples: 40}}}}
    batch_size: 8
    num_csx: 2
    shard: fsdp
    optimizer: {{name: AdamW, lr: 1.0e-2}}
    callbacks:
      - GlobalFlags: {{micro_batch_size: 2}}
    fit: {{max_steps: {MAX_STEPS}, val_steps: 1, checkpoint_every: 3}}
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def fit(tmp_path: Path, *args: str, timeout: float = 240, **env: str
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([mbcompile_command(), "fit", *args], cwd=tmp_path,
                          env=environment(**env), capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------- #
# The config key, and what refuses to shard
# --------------------------------------------------------------------------- #


def test_shard_fsdp_makes_the_backend_torch_distributed(tmp_path):
    cfg = load_config(write(tmp_path, CONFIG))
    assert cfg.shard == "fsdp" and cfg.backend == "torch.distributed"
    assert cfg.to_plain()["shard"] == "fsdp"  # stored in each checkpoint's config
    plain = load_config(write(tmp_path, CONFIG.replace("shard: fsdp", "shard: none")))
    assert plain.shard == "none" and plain.backend == "auto"
    assert load_config(EXAMPLE).shard == "fsdp"


@pytest.mark.parametrize("line,message", [
    ("shard: fdsp", "unknown value 'fdsp' (did you mean 'fsdp'?); choose one of none, fsdp"),
    ("shard: no", "must be one of none, fsdp, got boolean False"),
    ("shard: fsdp\n    backend: simulated", "but backend is 'simulated' (line 7)"),
])
def test_a_wrong_shard_key_names_the_file_and_line(tmp_path, line, message):
    path = write(tmp_path, CONFIG.replace("shard: fsdp", line))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:6: shard: "), info.value
    assert message in str(info.value)


def test_shard_fsdp_needs_two_systems(tmp_path):
    path = write(tmp_path, CONFIG.replace("num_csx: 2", "num_csx: 1"))
    with pytest.raises(ConfigError, match=r"run.yaml:6: shard: .* num_csx is 1"):
        load_config(path)


def test_sharding_outside_ranks_is_refused_clearly(tmp_path, capsys, monkeypatch):
    model = fsdp_training_workers.Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TrainerError, match="give backend='torch.distributed'"):
        Trainer(model, opt, gbs=8, num_csx=2, shard="fsdp")
    with pytest.raises(TrainerError, match="num_csx is 1"):
        Trainer(model, opt, gbs=8, num_csx=1, shard="fsdp", backend="torch.distributed")
    with pytest.raises(TypeError, match="shard must be 'fsdp' or None"):
        Trainer(model, opt, gbs=8, num_csx=2, shard="zero3")
    with pytest.raises(TrainerError, match="no process group is initialized"):
        shard_model(model)
    path = write(tmp_path, CONFIG)
    with pytest.raises(TrainerError, match="--nproc N"):
        build_trainer(load_config(path), progress=False)
    # the command: fit without ranks, and compile (one process) say how to run it
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.delenv("RANK", raising=False)
    capsys.readouterr()
    assert main(["fit", "run.yaml"]) == 1
    assert capsys.readouterr().err.startswith(
        "error: shard: fsdp needs ranks: run with --nproc 2, or launch with torchrun "
        "--nproc-per-node 2 -m mbcompile fit")
    assert main(["compile", "run.yaml"]) == 1
    err = capsys.readouterr().err
    assert "plan it here with --compile-only" in err and "mbcompile fit run.yaml --nproc 2" in err


@pytest.mark.parametrize("example", [EXAMPLE, HF_EXAMPLE], ids=["tiny_gpt", "hf_llama"])
def test_the_sharded_examples_are_planned_in_one_process(tmp_path, capsys, example):
    """``mbcompile compile examples/fsdp/tiny_gpt.yaml --compile-only`` (and the
    transformers Llama's, built from its class and config): FSDP2 over the config's 2
    ranks, costed with no process group (issue 26 item 4). Both train on ranks in
    ``test_fsdp.py``."""
    import torch.distributed as dist

    if example is HF_EXAMPLE:
        pytest.importorskip("transformers")
    assert main(["compile", str(example), "--compile-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sharded with FSDP2 over 2 ranks" in out and "fsdp: reshard_after_forward=" in out
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- #
# On ranks
# --------------------------------------------------------------------------- #


@pytest.mark.slow
def test_trainer_shards_and_trains_exactly(tmp_path):
    """``Trainer(..., shard="fsdp")`` on a model and optimizer built the plain way: the
    parameters become shards, the optimizer updates the shards, and three AdamW steps
    equal the single-process full-batch steps (float64)."""
    gbs, steps = 8, 3
    _run(fsdp_training_workers.trainer_steps, 2, str(tmp_path), gbs, steps)
    losses, params = fsdp_training_workers.reference_steps(gbs, steps)
    total = sum(p.numel() for p in params.values())
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert sum(g["local_numel"] for g in got) == total  # each rank holds its half
    for g in got:
        assert g["sharded"] and g["optimizer_holds_shards"]
        assert g["losses"] == pytest.approx(losses, rel=1e-12)
        for name, p in params.items():
            assert relative_error(g["params"][name], p) <= 1e-10, name


@pytest.mark.slow
@pytest.mark.zoo  # the launchers: test_launchers; the example's plan: planned in one process
def test_the_example_runs_with_nproc_2_and_under_torchrun(tmp_path):
    result = fit(tmp_path, str(EXAMPLE), "--nproc", "2", "--max-steps", "2", "--out", "run")
    assert result.returncode == 0, result.stderr
    assert "sharded with FSDP2 (shard: fsdp)" in result.stdout
    assert "trained 2 steps" in result.stdout
    last = latest_checkpoint(tmp_path / "run" / "checkpoints")
    files = {p.name for p in (last / "dcp").iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files and \
        not (last / "state.pt").exists()
    ck = read_checkpoint(last)  # the shards, read back whole in one process
    assert ck.state["model"]["tok.weight"].shape == (64, 32)
    assert set(ck.state["optimizer"]["state"]) == set(ck.state["model"])  # keyed by name
    # torchrun's ranks join its group and run the same steps
    port = str(free_port())
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", port, "-m", "mbcompile", "fit", str(EXAMPLE), "--max-steps", "2",
         "--out", "torchrun"], cwd=tmp_path, env=environment(), capture_output=True,
        text=True, timeout=240)
    assert torchrun.returncode == 0, torchrun.stderr
    assert rows(tmp_path / "torchrun") == rows(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.zoo  # a sharded resume in CI: test_elastic_resume's fsdp case
def test_a_sharded_run_stopped_by_sigterm_resumes_exactly(tmp_path):
    """Reference run; a run whose ranks get SIGTERM in step STOP_AT (they agree to stop
    after the next step and write a DCP checkpoint of their shards); its resume to the
    end. Every loss, learning rate and final parameter is bit-identical to the reference,
    on both ranks: the shards, the optimizer state, every rank's RNG (dropout, shuffle,
    noise) and the data position all came back."""
    write(tmp_path, CONFIG)
    ref = fit(tmp_path, "run.yaml", "--nproc", "2", "--out", "ref")
    assert ref.returncode == 0, ref.stderr
    stopped = fit(tmp_path, "run.yaml", "--nproc", "2", "--out", "run",
                  MBC_SIGNAL_AT=str(STOP_AT), MBC_SIGNAL="SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert stopped.stderr.startswith("interrupted by SIGTERM\n"), stopped.stderr
    assert f"checkpoint of step {STOP_AT + 1}" in stopped.stderr
    assert steps_of(tmp_path / "run") == [3, STOP_AT + 1]
    resumed = fit(tmp_path, "run.yaml", "--nproc", "2", "--out", "run", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from run/checkpoints/step-{STOP_AT + 1:08d}" in resumed.stdout
    assert_one_row_per_step(rows(tmp_path / "run"), MAX_STEPS)
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")
    assert not (tmp_path / "run" / "rank1").exists()  # rank 0 alone writes the metrics
    final = {name: read_checkpoint(latest_checkpoint(tmp_path / name / "checkpoints")).state
             for name in ("ref", "run")}
    for part in ("model", "optimizer"):
        flat = dict(_tensors(final["ref"][part]))
        other = dict(_tensors(final["run"][part]))
        assert flat.keys() == other.keys()
        for key, value in flat.items():
            assert torch.equal(value, other[key]), key
    # the same folder without sharding: refused before anything is loaded into the model
    write(tmp_path, CONFIG.replace("shard: fsdp", "backend: torch.distributed"), "plain.yaml")
    refused = fit(tmp_path, "plain.yaml", "--nproc", "2", "--out", "run", "--resume")
    assert refused.returncode == 1
    assert "was written with shard fsdp (now None)" in refused.stderr, refused.stderr


def _tensors(value, key=""):
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{key}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{key}/{i}")
