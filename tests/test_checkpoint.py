"""Checkpoints and exact resume: a fit survives SIGKILL, SIGINT, SIGTERM, a rank dying
and a damaged checkpoint, and continues as if nothing had happened.

The model and data (``checkpoint_workers``) draw from the torch, Python and numpy RNGs
and shuffle with the global RNG once per pass, so an exact resume needs every part
of the checkpoint. Runs that must be killed go through the installed ``mbcompile``
command on one CPU thread; the rest use the Trainer in process.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from mbcompile.training.checkpoint import (
    CheckpointError,
    CheckpointStore,
    TrainingInterrupted,
    latest_checkpoint,
    read_checkpoint,
    read_dcp_metadata,
)
from mbcompile.training.cli.main import main
from mbcompile.training.config import ConfigError, load_config
from mbcompile.training.flags import Callback, GlobalFlags
from mbcompile.training.monitors import NoiseScaleMonitor
from mbcompile.training.trainer import Trainer, TrainerError

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from checkpoint_workers import DropoutMLP, shuffled  # noqa: E402

GBS, NUM_CSX = 8, 2  # pbs 4, mbs 2: two microbatches per system
KEYS = ("phase", "step", "global_step", "loss", "lr")  # what must match; times need not
MAX_STEPS = 12  # 40 samples / gbs 8: passes of 5 batches, so the run is in its third pass
CONFIG = f"""
    model: {{name: checkpoint_workers:DropoutMLP, kwargs: {{hidden: 16}}}}
    data: {{source: checkpoint_workers:shuffled, kwargs: {{samples: 40}}}}
    batch_size: {GBS}
    num_csx: {NUM_CSX}
    optimizer: {{name: AdamW, lr: 1.0e-2}}
    callbacks:
      - GlobalFlags: {{micro_batch_size: 2}}
    lr_scaling: {{reference_batch_size: 4, warmup_steps: 4}}
    fit: {{max_steps: {MAX_STEPS}, val_steps: 1, val_every: 5, checkpoint_every: 3}}
"""
# The steps where runs are killed or signalled: "random", but the same every time.
_DRAW = random.Random(17)
KILL_AT = _DRAW.randint(5, 8)  # SIGKILL while the run waits for this step's batch
STOP_AT = _DRAW.randint(KILL_AT + 1, MAX_STEPS - 2)  # SIGTERM during this step


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def environment(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def mbcompile_command() -> str:
    import shutil

    found = shutil.which("mbcompile", path=str(Path(sys.executable).parent)) or \
        shutil.which("mbcompile")
    assert found, "the mbcompile console script is not installed (pip install -e .)"
    return found


def start(cwd: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """``mbcompile ARGS`` in its own session (so that a test can kill all of its ranks),
    with SIGINT at its default (a CI runner may start jobs with it ignored)."""
    out = open(cwd / f"out-{time.monotonic_ns()}.txt", "w+")
    err = open(cwd / f"err-{time.monotonic_ns()}.txt", "w+")
    proc = subprocess.Popen([mbcompile_command(), *args], cwd=cwd, env=environment(**env),
                            stdout=out, stderr=err, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.out_file, proc.err_file = out, err  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen[str], timeout: float = 240) -> tuple[int, str, str]:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    texts = []
    for f in (proc.out_file, proc.err_file):  # type: ignore[attr-defined]
        f.seek(0)
        texts.append(f.read())
        f.close()
    return code, texts[0], texts[1]


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            code, out, err = finish(proc)
            pytest.fail(f"the run ended ({code}) before {path.name}:\n{out[-2000:]}\n{err}")
        assert time.monotonic() < deadline, f"no {path.name} after {timeout} s"
        time.sleep(0.02)


def rows(folder: Path) -> list[tuple]:
    """The logged rows, from both files, which must agree."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    from_json = [tuple(json.loads(line)[k] for k in KEYS) for line in lines]
    with open(folder / "metrics.csv", newline="") as f:
        from_csv = [tuple(r[k] for k in KEYS) for r in csv.DictReader(f)]
    assert [tuple("" if v is None else str(v) for v in r) for r in from_json] == from_csv
    return from_json


def assert_one_row_per_step(table: list[tuple], steps: int) -> None:
    train = [r[1] for r in table if r[0] == "train"]
    assert train == list(range(1, steps + 1)), "duplicated or missing training rows"
    assert [r[2] for r in table if r[0] == "train"] == train


def final_model(out: Path) -> dict[str, torch.Tensor]:
    last = latest_checkpoint(out / "checkpoints")
    assert last is not None and last.name == f"step-{MAX_STEPS:08d}"
    return dict(read_checkpoint(last).state["model"])


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def config_file(tmp_path: Path, text: str = CONFIG, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def steps_of(out: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in sorted((out / "checkpoints").glob("step-*"))]


# --------------------------------------------------------------------------- #
# Kill, stop and resume through the command line
# --------------------------------------------------------------------------- #


@pytest.fixture
def here(tmp_path, monkeypatch, capfd):
    """``here(*args)``: ``mbcompile ARGS`` in this process (from ``tmp_path``, one thread,
    ranks spawned with one thread too); returns (exit code, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    for key, value in environment().items():
        if key in ("OMP_NUM_THREADS", "PYTHONPATH"):
            monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()

    def call(*args: str) -> tuple[int, str, str]:
        capfd.readouterr()
        torch.set_num_threads(1)
        try:
            code = main(list(args))
        finally:
            torch.set_num_threads(threads)
        out, err = capfd.readouterr()
        return code, out, err

    return call


def kill_stop_resume(tmp_path: Path, here, ranks: bool) -> None:
    """Reference run; a run killed at KILL_AT; its resume stopped by SIGTERM at STOP_AT;
    the resume of that to the end. Losses and final parameters equal the reference's.
    Runs that are killed or signalled are processes of their own; the others run here."""
    config_file(tmp_path)
    nproc = ["--nproc", "2"] if ranks else []
    code, out, err = here("fit", "run.yaml", "--out", "ref", *nproc)
    assert code == 0, err
    reference = rows(tmp_path / "ref")

    # 1. killed: the process (simulated) by the test, or rank 1 by itself in mid-step
    if ranks:
        began = time.monotonic()
        os.environ.update(MBC_KILL_AT=str(KILL_AT), MBC_FORWARDS_PER_STEP="2")
        try:
            code, out, err = here("fit", "run.yaml", "--out", "run", *nproc)
        finally:
            del os.environ["MBC_KILL_AT"], os.environ["MBC_FORWARDS_PER_STEP"]
        assert time.monotonic() - began < 120
        # every rank ended, with an error that names the dead rank and the last checkpoint
        assert code == 1 and "process 1 terminated with signal SIGKILL" in err, err
        assert "the last checkpoint is run/checkpoints/step-" in err and "--resume" in err, err
    else:
        proc = start(tmp_path, "fit", "run.yaml", "--out", "run", MBC_PAUSE_AT=str(KILL_AT),
                     MBC_PAUSE_DIR=str(tmp_path))
        wait_for(tmp_path / f"paused-{KILL_AT}", proc)
        os.killpg(proc.pid, signal.SIGKILL)
        code, _, _ = finish(proc)
        assert code == -signal.SIGKILL
    last_good = (KILL_AT - 1) // 3 * 3
    assert steps_of(tmp_path / "run")[-1] == last_good  # intact, and nothing newer
    read_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"))
    logged = [r for r in rows(tmp_path / "run") if r[0] == "train"]
    assert len(logged) >= last_good  # rows after the checkpoint: to be dropped, not repeated

    # 2. resumed, then stopped by SIGTERM while waiting for step STOP_AT's batch
    proc = start(tmp_path, "fit", "run.yaml", "--out", "run", *nproc, "--resume",
                 MBC_PAUSE_AT=str(STOP_AT), MBC_PAUSE_DIR=str(tmp_path))
    wait_for(tmp_path / f"paused-{STOP_AT}", proc)
    proc.send_signal(signal.SIGTERM)  # to the command only: it passes it on to its ranks
    time.sleep(0.2)
    (tmp_path / f"release-{STOP_AT}").write_text("")
    code, out, err = finish(proc)
    stopped = STOP_AT + 1 if ranks else STOP_AT  # ranks agree on it one step later
    assert code == 143, err
    assert f"resumed from run/checkpoints/step-{last_good:08d}" in out
    assert err.startswith("interrupted by SIGTERM\n"), err
    assert f"checkpoint of step {stopped}: run/checkpoints/step-{stopped:08d}" in err
    assert f"resume with: mbcompile fit run.yaml --out run {' '.join(nproc)}".strip() in err
    assert steps_of(tmp_path / "run")[-1] == stopped
    assert_one_row_per_step(rows(tmp_path / "run"), stopped)

    # 3. resumed to the end: the same run as the reference
    code, out, err = here("fit", "run.yaml", "--out", "run", *nproc, "--resume")
    assert code == 0, err
    resumed = rows(tmp_path / "run")
    assert_one_row_per_step(resumed, MAX_STEPS)
    assert resumed == reference  # every loss and learning rate, bit for bit
    assert_same_model(final_model(tmp_path / "run"), final_model(tmp_path / "ref"))
    written = {stopped, MAX_STEPS} | {s for s in range(3, MAX_STEPS, 3) if s > stopped}
    assert steps_of(tmp_path / "run") == sorted(written)[-2:]  # keep_checkpoints: 2
    if ranks:
        dcp_files = {p.name for p in (latest_checkpoint(tmp_path / "run" / "checkpoints")
                                      / "dcp").iterdir()}
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= dcp_files
        assert not (tmp_path / "run" / "rank1").exists()  # rank 0 alone writes the metrics


@pytest.mark.slow
def test_a_killed_then_stopped_run_resumes_exactly(tmp_path, here):
    kill_stop_resume(tmp_path, here, ranks=False)


@pytest.mark.slow
def test_a_dead_rank_ends_the_run_and_two_ranks_resume_exactly(tmp_path, here):
    kill_stop_resume(tmp_path, here, ranks=True)


def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_exits_130(tmp_path, capsys,
                                                                     monkeypatch):
    # in process: the data sends this process SIGINT while it fetches step 4's batch
    config_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MBC_SIGNAL_AT", "4")
    monkeypatch.setenv("MBC_SIGNAL", "SIGINT")
    previous = signal.getsignal(signal.SIGINT)
    assert main(["fit", "run.yaml", "--out", "out"]) == 130
    assert signal.getsignal(signal.SIGINT) is previous  # the handler is put back
    err = capsys.readouterr().err
    assert err.startswith("interrupted\n  the metrics of the 4 finished training steps are in "
                          "out/metrics.csv; checkpoint of step 4: out/checkpoints/step-00000004; "
                          "resume with: mbcompile fit run.yaml --out out --resume"), err
    assert steps_of(tmp_path / "out") == [3, 4]
    assert_one_row_per_step(rows(tmp_path / "out"), 4)
    monkeypatch.delenv("MBC_SIGNAL_AT")
    assert main(["fit", "run.yaml", "--out", "out", "--resume", "--max-steps", "6"]) == 0
    assert_one_row_per_step(rows(tmp_path / "out"), 6)


# --------------------------------------------------------------------------- #
# The Trainer in process
# --------------------------------------------------------------------------- #


def fresh(seed: int = 0, **kwargs) -> tuple[Trainer, object]:
    """A trainer and data as a new process would build them."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = DropoutMLP().double()
    data = shuffled(GBS, samples=24)
    data.loader.dataset.x = data.loader.dataset.x.double()
    data.loader.dataset.y = data.loader.dataset.y.double()
    kwargs.setdefault("callbacks", [GlobalFlags(micro_batch_size=2)])
    kwargs.setdefault("console", Console(file=io.StringIO()))
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), gbs=GBS,
                      num_csx=NUM_CSX, **kwargs)
    return trainer, data


class CrashAt(Callback):
    """Ends the process's run abruptly after step ``step`` (a crash, as far as the trainer
    can tell: nothing is written after it)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer, row):
        if row["step"] == self.step:
            raise RuntimeError("crash")


def test_a_truncated_or_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    reference, data = fresh(log_dir=tmp_path / "ref", checkpoint_every=2)
    reference.fit(data, max_steps=8)
    trainer, data = fresh(log_dir=tmp_path / "run", checkpoint_every=2, keep_checkpoints=3)
    trainer.fit(data, max_steps=6)
    folder = tmp_path / "run" / "checkpoints"
    assert steps_of(tmp_path / "run") == [2, 4, 6]
    state = folder / "step-00000006" / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    trainer_json = folder / "step-00000004" / "trainer.json"
    text = trainer_json.read_text()
    trainer_json.write_text(text.replace('"step": 4', '"step": 5'))  # same size, corrupt
    resumed, data = fresh(log_dir=tmp_path / "run", checkpoint_every=2, keep_checkpoints=3)
    resumed.fit(data, max_steps=8, resume=True)
    err = capsys.readouterr().err
    assert f"checkpoint {folder / 'step-00000006'} is damaged: state.pt has " in err
    assert "(truncated?)" in err
    assert f"checkpoint {folder / 'step-00000004'} is damaged: trainer.json does not match " \
           "its SHA-256" in err
    assert (folder / "step-00000006.damaged").is_dir()  # set aside, kept for a look
    assert [tuple(r[k] for k in KEYS) for r in resumed.history] == rows(tmp_path / "ref")
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")
    assert_same_model(dict(resumed.model.state_dict()), dict(reference.model.state_dict()))


def test_keep_checkpoints_prunes_the_oldest(tmp_path):
    trainer, data = fresh(log_dir=tmp_path / "run", checkpoint_every=1)
    trainer.fit(data, max_steps=5)
    assert steps_of(tmp_path / "run") == [4, 5]  # the default keeps two
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()
            if p.name.startswith(".")] == []  # no temporary folders left
    trainer, data = fresh(checkpoint_dir=tmp_path / "one", checkpoint_every=2,
                          keep_checkpoints=1)
    trainer.fit(data, max_steps=5)  # every 2 steps, and the end
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["step-00000005"]


def test_a_new_run_moves_the_earlier_runs_checkpoints_aside(tmp_path, capsys):
    # otherwise the earlier run's higher steps would outrank (and prune) the new run's
    trainer, data = fresh(checkpoint_dir=tmp_path, checkpoint_every=2)
    trainer.fit(data, max_steps=6)
    trainer, data = fresh(checkpoint_dir=tmp_path, checkpoint_every=2)
    trainer.fit(data, max_steps=3)
    (earlier,) = tmp_path.glob("earlier-*")
    assert sorted(p.name for p in earlier.iterdir()) == ["step-00000004", "step-00000006"]
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert f"were moved to {earlier}" in capsys.readouterr().err


def test_a_crash_resumes_with_lr_warmup_noise_scale_and_metrics_exact(tmp_path):
    def make(**kwargs):
        return fresh(log_dir=tmp_path / kwargs.pop("name"), checkpoint_every=3,
                     reference_batch_size=4, warmup_steps=5,
                     callbacks=[GlobalFlags(micro_batch_size=2), NoiseScaleMonitor(),
                                *kwargs.pop("extra", ())], **kwargs)

    reference, data = make(name="ref")
    reference.fit(data, max_steps=8)
    crashed, data = make(name="run", extra=[CrashAt(5)])
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(data, max_steps=8)
    assert len(rows(tmp_path / "run")) == 5  # step 5 was logged, after the checkpoint at 3
    resumed, data = make(name="run")
    out = resumed.fit(data, max_steps=8, resume=True)
    assert [r["step"] for r in out] == list(range(1, 9))  # the whole fit's rows
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")
    for a, b in zip(resumed.history[3:], reference.history[3:]):  # the steps run again
        assert a["b_simple"] == b["b_simple"] and a["lr"] == b["lr"]
    noise_a = resumed.compile_options["measure_noise_scale"]
    noise_b = reference.compile_options["measure_noise_scale"]
    assert noise_a.state_dict() == noise_b.state_dict() and noise_a.steps == 8
    assert resumed.lr_scaling == reference.lr_scaling
    assert_same_model(dict(resumed.model.state_dict()), dict(reference.model.state_dict()))
    for p, q in zip(resumed.optimizer.state.values(), reference.optimizer.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)


class NoisyMLP(DropoutMLP):
    """Draws its noise from a generator of its own, made again from its seed by __init__."""

    def __init__(self) -> None:
        super().__init__(p=0.0)
        self.g = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = h + 0.1 * torch.randn(h.shape, generator=self.g, dtype=h.dtype)
        return torch.nn.functional.mse_loss(self.l2(torch.tanh(h)), y)


def test_a_resume_draws_on_from_the_models_own_generator(tmp_path):
    """The checkpoint kept torch's, Python's and numpy's RNGs but not a generator the model
    holds: the resumed run drew from its seed again (losses 1.2119 against 1.3380)."""
    def make(name: str, crash: int | None = None) -> tuple[Trainer, object]:
        torch.manual_seed(0)
        model = NoisyMLP().double()
        data = shuffled(GBS, samples=24)
        data.loader.dataset.x = data.loader.dataset.x.double()
        data.loader.dataset.y = data.loader.dataset.y.double()
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), gbs=GBS,
                       num_csx=NUM_CSX, log_dir=tmp_path / name, checkpoint_every=2,
                       callbacks=[GlobalFlags(micro_batch_size=2),
                                  *([CrashAt(crash)] if crash else [])],
                       console=Console(file=io.StringIO())), data

    reference, data = make("ref")
    reference.fit(data, max_steps=5)
    crashed, data = make("run", crash=3)
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(data, max_steps=5)
    resumed, data = make("run")
    resumed.fit(data, max_steps=5, resume=True)
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")
    assert_same_model(dict(resumed.model.state_dict()), dict(reference.model.state_dict()))
    assert torch.equal(resumed.model.g.get_state(), reference.model.g.get_state())


def test_b_simple_is_logged_with_its_row_and_restored_on_resume(tmp_path):
    """The noise-scale monitor's b_simple is in each training row as it is written to
    metrics.jsonl and metrics.csv, so the rows a resumed run reads back from the log (the
    steps before its checkpoint) carry it too, equal to an uninterrupted run's."""

    def make(name, *extra):
        return fresh(log_dir=tmp_path / name, checkpoint_every=3,
                     callbacks=[GlobalFlags(micro_batch_size=2), NoiseScaleMonitor(), *extra])

    reference, data = make("ref")
    reference.fit(data, max_steps=5)
    crashed, data = make("run", CrashAt(4))
    with pytest.raises(RuntimeError, match="crash"):
        crashed.fit(data, max_steps=5)
    resumed, data = make("run")
    resumed.fit(data, max_steps=5, resume=True)
    want = [r["b_simple"] for r in reference.history]
    assert all(isinstance(v, float) for v in want)  # measured from the first step on
    assert [r.get("b_simple") for r in resumed.history] == want  # rows 1-3 came from the log
    for folder in (tmp_path / "ref", tmp_path / "run"):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line).get("b_simple") for line in lines] == want
        with open(folder / "metrics.csv", newline="") as f:
            logged = [r.get("b_simple") for r in csv.DictReader(f)]
        assert logged == ["" if v is None else str(v) for v in want]


def test_sigterm_in_process_stops_after_the_step(tmp_path):
    class Term(Callback):
        def on_train_step_end(self, trainer, row):
            if row["step"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer, data = fresh(checkpoint_dir=tmp_path / "run" / "checkpoints", callbacks=[Term()])
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit(data, max_steps=6)
    exc = info.value
    assert (exc.signum, exc.step, exc.exit_code) == (signal.SIGTERM, 2, 143)
    assert exc.checkpoint == tmp_path / "run" / "checkpoints" / "step-00000002"
    assert "resume with fit(..., resume=True)" in str(exc)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # without a checkpoint folder the stop is the same, only without a checkpoint
    trainer, data = fresh(callbacks=[Term()])
    with pytest.raises(TrainingInterrupted, match="no checkpoint folder"):
        trainer.fit(data, max_steps=6)
    assert trainer.global_step == 2


def test_resume_without_a_checkpoint_starts_at_step_0_and_a_changed_run_is_refused(tmp_path):
    trainer, data = fresh(log_dir=tmp_path / "run", checkpoint_every=2)
    assert len(trainer.fit(data, max_steps=2, resume=True)) == 2  # nothing to resume: a start
    torch.manual_seed(0)
    model = DropoutMLP().double()
    other = Trainer(model, torch.optim.AdamW(model.parameters()), gbs=12, num_csx=2,
                    checkpoint_dir=tmp_path / "run" / "checkpoints", progress=False)
    with pytest.raises(CheckpointError, match="written with gbs 8 \\(now 12\\)"):
        other.fit(shuffled(12, samples=24), max_steps=2, resume=True)


def test_bad_checkpoint_arguments():
    trainer, data = fresh()
    with pytest.raises(TrainerError, match="resume=True needs the checkpoints' folder"):
        trainer.fit(data, max_steps=1, resume=True)
    with pytest.raises(TrainerError, match="checkpoint_every needs a folder"):
        fresh(checkpoint_every=2)
    with pytest.raises(TrainerError, match="keep_checkpoints must be at least 1"):
        fresh(checkpoint_dir="x", keep_checkpoints=0)


# --------------------------------------------------------------------------- #
# Loading is safe
# --------------------------------------------------------------------------- #


class Payload:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_only_plain_data_is_ever_unpickled(tmp_path, capsys):
    store = CheckpointStore(tmp_path, keep=3)
    model = torch.nn.Linear(2, 2)
    for step in (1, 2):
        store.save(step, {"model": model.state_dict(), "optimizer": {}}, {"step": step,
                   "global_step": step}, {"rng": {}})
    # a file that torch.save wrote with an object in it, manifest and all consistent
    bad = tmp_path / "step-00000002" / "state.pt"
    torch.save({"model": Payload()}, bad)
    manifest = json.loads((tmp_path / "step-00000002" / "MANIFEST.json").read_text())
    from mbcompile.training.checkpoint import _digest

    manifest["files"]["state.pt"] = _digest(bad)
    (tmp_path / "step-00000002" / "MANIFEST.json").write_text(json.dumps(manifest))
    # refused by weights_only: named, and left in place (its files are as written, so it
    # is not damaged; it was set aside, and the next resume then started from step 0)
    with pytest.raises(CheckpointError, match="step-00000002 is as it was written, but holds "
                       "a value torch.load\(weights_only=True\) refuses"):
        store.load_newest()
    assert (tmp_path / "step-00000002" / "state.pt").is_file()
    # what save() is given is checked before anything is written: numpy's scalars become
    # Python's, any other object is refused by its place
    store.save(3, {"model": {}, "optimizer": {"param_groups": [{"lr": np.float64(0.1)}]}},
               {"step": 3, "global_step": 3}, {"rng": {}})
    lr = read_checkpoint(tmp_path / "step-00000003").state["optimizer"]["param_groups"][0]["lr"]
    assert type(lr) is float and lr == 0.1
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['_extra_state'\] is a "
                       r"test_checkpoint.Payload.*nothing was written"):
        store.save(4, {"model": {"_extra_state": Payload()}, "optimizer": {}},
                   {"step": 4, "global_step": 4}, {"rng": {}})
    assert not [p for p in tmp_path.iterdir() if "00000004" in p.name]
    # DCP's metadata pickle admits its own classes only
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed in a checkpoint's metadata"):
        read_dcp_metadata(tmp_path / "dcp")


# --------------------------------------------------------------------------- #
# Configuration
# --------------------------------------------------------------------------- #


def test_yaml_checkpoint_keys(tmp_path):
    cfg = load_config(config_file(tmp_path))
    assert (cfg.checkpoint_every, cfg.keep_checkpoints) == (3, 2)
    plain = config_file(tmp_path, "model: mlp\nbatch_size: 8\n", "plain.yaml")
    assert (load_config(plain).checkpoint_every, load_config(plain).keep_checkpoints) == (None, 2)
    bad = config_file(tmp_path, "model: mlp\nbatch_size: 8\nfit:\n  keep_checkpoints: 0\n",
                      "bad.yaml")
    with pytest.raises(ConfigError, match="bad.yaml:4: fit.keep_checkpoints: must be at least 1"):
        load_config(bad)
    typo = config_file(tmp_path, "model: mlp\nbatch_size: 8\nfit: {checkpoint_evry: 2}\n",
                       "typo.yaml")
    with pytest.raises(ConfigError, match="did you mean 'checkpoint_every'"):
        load_config(typo)
