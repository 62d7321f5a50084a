"""Launched the way people launch: ``backend="auto"`` and ``mbcompile fit`` under a launcher.

The launcher's environment (``RANK``, ``WORLD_SIZE``, an initialised process group) is
the contract (mbcompile/execution/world.py). In process, with the world size stood in
for: what ``auto`` resolves to and what is refused, before anything changes. Under the
real launchers (2 gloo processes on CPU, slow): ``torchrun`` and ``accelerate launch``
running tests/launcher_scripts/compile_on_ranks.py, which compiles without ``backend=``
and must match one process's full-batch steps in float64; and ``torchrun -m mbcompile
fit``, which must write one metrics file and one set of checkpoints.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mbcompile
from mbcompile.errors import InputError
from mbcompile.execution import world
from mbcompile.models import make_tiny_gpt
from mbcompile.training.cli.main import main
from mbcompile.training.trainer import Trainer

TESTS = Path(__file__).parent
SCRIPT = TESTS / "launcher_scripts" / "compile_on_ranks.py"


def environment() -> dict[str, str]:
    # one thread a rank: on a busy 2-core machine OpenMP's spinning threads slow every op
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def state(model: torch.nn.Module) -> dict[str, object]:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "grads": [p.grad for p in model.parameters()], "training": model.training}


def same_state(a: dict[str, object], b: dict[str, object]) -> bool:
    return (a["grads"] == b["grads"] and a["training"] == b["training"]
            and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"]))


# --------------------------------------------------------------------------- #
# backend="auto", in process
# --------------------------------------------------------------------------- #


def test_auto_without_a_group_simulates_the_systems():
    model, batch = make_tiny_gpt(8, seed=0, dtype=torch.float64)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch)  # no backend=
    assert cm.backend == "simulated"
    assert world.resolve_backend("auto", 4) == "simulated"  # no group in this process


@pytest.mark.parametrize("size", [1, 2])
def test_auto_follows_the_world(size):
    assert world.resolve_backend("auto", 2, size) == ("torch.distributed" if size > 1
                                                      else "simulated")
    assert world.resolve_backend("torch.distributed", 2, size) == "torch.distributed"


@pytest.mark.parametrize("backend,num_csx,says", [
    ("simulated", 2, ["backend='simulated'", "one of 2 ranks", "its own model",
                      "Leave backend at 'auto'"]),
    ("auto", 4, ["num_csx=4", "has 2 ranks", "chosen by backend=auto",
                 "compile with num_csx=2", "launch 4 ranks"]),
    ("torch.distributed", 3, ["num_csx=3", "has 2 ranks", "compile with num_csx=2"]),
])
def test_a_backend_that_contradicts_the_group_is_refused_and_nothing_changes(
        monkeypatch, backend, num_csx, says):
    monkeypatch.setattr(world, "group_world_size", lambda: 2)  # a launcher's group of 2
    model, batch = make_tiny_gpt(8, seed=0, dtype=torch.float64)
    before = state(model)
    with pytest.raises(InputError) as caught:
        mbcompile.compile(model, 8, num_csx, 2, example_inputs=batch, backend=backend)
    for text in says:
        assert text in str(caught.value), str(caught.value)
    assert same_state(before, state(model))


def test_an_unknown_backend_names_auto_among_the_choices():
    model, batch = make_tiny_gpt(8, seed=0)
    with pytest.raises(InputError, match="'auto', 'simulated', 'torch.distributed'"):
        mbcompile.compile(model, 8, 2, 2, example_inputs=batch, backend="nccl")


def test_the_trainer_resolves_its_backend_once(monkeypatch):
    model, _ = make_tiny_gpt(8, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert Trainer(model, opt, gbs=8, num_csx=2, progress=False).backend == "simulated"
    monkeypatch.setattr(world, "group_world_size", lambda: 2)
    with pytest.raises(InputError, match="each rank would train its own model"):
        Trainer(copy.deepcopy(model), opt, gbs=8, num_csx=2, backend="simulated")
    with pytest.raises(InputError, match="num_csx=4"):  # compile_options' backend counts
        Trainer(copy.deepcopy(model), opt, gbs=8, num_csx=4,
                compile_options={"backend": "torch.distributed"})


# --------------------------------------------------------------------------- #
# mbcompile fit under a launcher, refused before it joins (in process)
# --------------------------------------------------------------------------- #

CONFIG = """\
model: {name: mlp, kwargs: {features: 8, hidden: 16, out: 3}}
data: {source: synthetic, seed: 0, num_batches: 3}
batch_size: 8
num_csx: 2
backend: BACKEND
optimizer: {name: SGD, lr: 0.05}
callbacks:
  - GlobalFlags: {micro_batch_size: 2}
fit: {max_steps: 3, val_steps: 0, log_every: 1, checkpoint_every: 2}
"""


def config(folder: Path, backend: str = "auto", num_csx: int = 2) -> Path:
    path = folder / "run.yaml"
    path.write_text(CONFIG.replace("BACKEND", backend).replace("num_csx: 2",
                                                               f"num_csx: {num_csx}"))
    return path


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """This process as rank 0 of 2 that torchrun started (nothing listens: joining hangs,
    so a test passes only if the command refuses before it joins)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return tmp_path


@pytest.mark.parametrize("args,backend,num_csx,says", [
    (["--nproc", "2"], "auto", 2, ["--nproc 2 launches ranks", "rank 0 of 2",
                                   "drop --nproc"]),
    ([], "simulated", 2, ["run.yaml:5: backend:", "one of 2 ranks", "its own model"]),
    ([], "auto", 4, ["run.yaml:4: num_csx:", "num_csx=4", "has 2 ranks"]),
])
def test_fit_under_a_launcher_refuses_a_second_launch_and_a_contradicting_config(
        launched, capsys, args, backend, num_csx, says):
    config(launched, backend, num_csx)
    assert main(["fit", "run.yaml", "--out", "out", *args]) == 1
    err = capsys.readouterr().err
    for text in says:
        assert text in err, err
    assert not (launched / "out").exists()  # nothing trained, nothing written


def test_fit_nproc_refuses_a_simulated_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config(tmp_path, "simulated")
    assert main(["fit", "run.yaml", "--nproc", "2"]) == 1
    assert "run.yaml:5: backend: --nproc 2 launches ranks" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# Under the real launchers: 2 gloo processes on CPU
# --------------------------------------------------------------------------- #

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2"]
# accelerate 1.16 runs `--cpu --num_processes 2` as one process (it expects mpirun to
# start the others); `--multi_gpu` on a machine without GPUs starts 2 CPU processes
# through torchrun's launcher, the way users run it.
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", "0"]


def launch(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.xdist_group("launchers")
@pytest.mark.parametrize("launcher", [TORCHRUN, ACCELERATE], ids=["torchrun", "accelerate"])
def test_a_script_under_a_launcher_trains_one_model_on_its_ranks(tmp_path, launcher):
    launch([*launcher, str(SCRIPT), str(tmp_path)], tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        assert got["backend"] == "torch.distributed" and got["world"] == 2
        assert got["sizes"] == [4, 4] and got["mbs"] == 2
        assert got["loss_diff"] <= 1e-12 and got["param_diff"] <= 1e-12, got
        assert got["identical"]  # every rank holds the same weights, bit for bit


def rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.xdist_group("launchers")
def test_fit_under_torchrun_writes_one_set_of_metrics_and_checkpoints(tmp_path, monkeypatch):
    config(tmp_path)
    done = launch([*TORCHRUN, "-m", "mbcompile", "fit", "run.yaml", "--out", "run"], tmp_path)
    assert done.stdout.count("fit: mlp, gbs 8 over 2 systems") == 1, done.stdout  # rank 0
    train = [r for r in rows(tmp_path / "run") if r["phase"] == "train"]
    assert [r["step"] for r in train] == ["1", "2", "3"]  # no duplicated rows
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert not list((tmp_path / "run").glob("rank*"))  # rank 0 alone writes the metrics
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ["step-00000002", "step-00000003"]
    last = tmp_path / "run" / "checkpoints" / "step-00000003"
    # one checkpoint written by both ranks together: each its DCP part and RNG file
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (last / "dcp").iterdir()}
    assert {"rng-rank0.json", "rng-rank1.json"} <= {p.name for p in last.iterdir()}
    # the same run in one process (simulated systems) logs the same losses, to rounding:
    # run in this one, on one thread as the ranks (a fresh interpreter would import torch)
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["fit", "run.yaml", "--out", "one"]) == 0
    finally:
        torch.set_num_threads(threads)
    single = [r for r in rows(tmp_path / "one") if r["phase"] == "train"]
    assert [float(r["loss"]) for r in train] == pytest.approx(
        [float(r["loss"]) for r in single], rel=1e-5)

