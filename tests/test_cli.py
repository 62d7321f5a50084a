"""The ``mbcompile`` command: the demo, every example YAML through a real subprocess,
exit codes 0 / 1 / 2 / 130, one-paragraph errors before any warning, tracebacks only
with --debug.

Subprocesses run the installed ``mbcompile`` console script (one runs ``python -m
mbcompile``). They cost ~2 s each (importing torch), so they are kept to what needs a
real process: the demo, a 2-step fit per example (and compile for one), failing runs,
Ctrl-C.
The rest calls ``mbcompile.training.cli.main`` in process, which is what the console script runs.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from models import tiered

from mbcompile.training.cli.main import main, mbs_argument

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def console_script() -> str:
    """The ``mbcompile`` command that ``pip install`` put beside this Python (or on PATH)."""
    found = shutil.which("mbcompile", path=str(Path(sys.executable).parent)) or \
        shutil.which("mbcompile")
    if found is None:
        pytest.fail(f"the mbcompile console script is not installed: it is neither beside "
                    f"{sys.executable} nor on PATH; run pip install -e . in this environment")
    return found


def command(*args: str, module: bool = False) -> list[str]:
    return [sys.executable, "-m", "mbcompile", *args] if module else [console_script(), *args]


def environment(**extra: str) -> dict[str, str]:
    # One thread: these models are tiny, and on a busy 2-core machine OpenMP's spinning
    # threads make each op ten times slower.
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def run(*args: str, cwd: Path, timeout: float = 120, module: bool = False,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(*args, module=module), cwd=cwd, env=env or environment(),
                          capture_output=True, text=True, timeout=timeout)


def svg_lines(path: Path) -> set[str]:
    """The lines of text in an SVG file, which must parse as XML."""
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    return {"".join(el.itertext()).strip() for el in root.iter()
            if el.tag.rsplit("}", 1)[-1] in ("text", "tspan")}


def test_demo_runs_with_no_files(tmp_path):
    result = run("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "over 4 simulated systems, mbs=auto" in out
    assert "MicrobatchPlan" in out  # the plan, printed
    # the demo says its systems are too small for a whole per-system batch: both its
    # compile and the Trainer's must then split it (issue 27, item 7)
    assert "so mbs=auto has to split it" in out
    assert int(re.search(r"microbatches per system: (\d+)", out)[1]) >= 2
    assert re.search(r"=> each system's 4 samples run as \d+ microbatches", out)
    assert int(re.search(r"train: compiled .* (\d+) microbatches per system", out)[1]) >= 2
    assert "microbatch_loop" in out  # the rewritten graph
    assert "equal to a full-batch step" in out
    assert "train step 5/5: loss" in out
    assert re.search(r"^done: loss \d", out, re.M)
    assert list(tmp_path.iterdir()) == []  # no files written
    # the closing hint needs no checkout: the config it prints trains, here (no examples/)
    printed = out.split("save these lines as run.yaml")[1].split(":\n", 1)[1]
    (tmp_path / "run.yaml").write_text(textwrap.dedent(printed))
    fit = run("fit", "run.yaml", "--max-steps", "1", "--out", "next", cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr
    # ... and plans what the demo's Trainer ran: its small systems, not the host's
    ran = re.search(r"train: compiled .* mbs (\d+) \(requested auto\), (\d+) microbatches", out)
    with open(tmp_path / "next" / "metrics.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["mbs"], row["num_microbatches"]) == ran.groups()
    assert ran[0].split(": ", 1)[1].split(":", 1)[1] in fit.stdout  # gbs, mbs, microbatches


@pytest.mark.parametrize("example", tiered(EXAMPLE_FILES, fast=("tiny_gpt",)))
def test_compile_writes_the_artifacts(tmp_path, example, monkeypatch, capsys):
    args = ("compile", str(example), "--compile-only", "--out", "art")
    if example.stem == "tiny_gpt":  # through the console script, a real process
        result = run(*args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        out, err = result.stdout, result.stderr
    else:  # in this process, as the console script runs it (each one's fit is a process)
        monkeypatch.chdir(tmp_path)
        code = main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, err
    art = tmp_path / "art"
    assert "MicrobatchPlan" in (art / "plan.txt").read_text()
    plan = json.loads((art / "plan.json").read_text())
    assert plan["plan"]["gbs"] > 0 and plan["config"]["model"] == example.stem
    assert "microbatch_loop" in (art / "graph.py").read_text()
    assert (art / "original_graph.py").exists()
    assert (art / "graph.dot").read_text().startswith("digraph")
    assert {"microbatches", "loop"} <= svg_lines(art / "graph.svg")  # split, loop; no Graphviz
    assert "artifacts in" in out and "Graphviz" not in err


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory
         ) -> Callable[[Path], tuple[subprocess.CompletedProcess[str], Path]]:
    """``mbcompile fit EXAMPLE --max-steps 2``, run once per example in this module (a
    subprocess is seconds): what it printed and its run folder. test_fit_two_steps checks
    them; the ranks test compares its ranks with mlp's one process (conftest.py's
    SHARED_FIXTURES keeps these tests on one xdist worker)."""
    done: dict[Path, tuple[subprocess.CompletedProcess[str], Path]] = {}

    def fit(example: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
        if example not in done:
            cwd = tmp_path_factory.mktemp(f"fit_{example.stem}")
            done[example] = (run("fit", str(example), "--max-steps", "2", "--out", "run",
                                 cwd=cwd), cwd / "run")
        return done[example]

    return fit


@pytest.mark.parametrize("example", tiered(EXAMPLE_FILES, fast=("tiny_gpt",)))
def test_fit_two_steps(fits, example):
    result, out = fits(example)
    assert result.returncode == 0, result.stderr
    assert "trained 2 steps" in result.stdout
    assert "Traceback" not in result.stderr
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows if r["phase"] == "train"] == ["1", "2"]
    assert any(r["phase"] == "validate" for r in rows)
    assert (out / "metrics.jsonl").exists()
    # the summary's validation loss is the last validation's mean, as its own line says
    validated = [r for r in rows if r["phase"] == "validate"]
    last = validated[max(i for i, r in enumerate(validated) if r["step"] == "1"):]
    mean = sum(float(r["loss"]) for r in last) / len(last)
    said = re.search(r"last validation: mean loss (\d+\.\d+) over (\d+) steps?$",
                     result.stdout, re.M)
    assert (float(said[1]), int(said[2])) == (pytest.approx(mean, abs=5e-5), len(last))
    assert f"validate: mean loss {said[1]} over {len(last)} steps" in result.stdout


@pytest.mark.slow
def test_fit_on_cpu_ranks_matches_one_process(tmp_path, fits, monkeypatch, capsys):
    # mlp.yaml: gbs 20 over 3 systems (7, 7, 6); three gloo ranks must train the same model
    # as one process does (test_fit_two_steps[mlp]'s run)
    one, _ = fits(EXAMPLES / "mlp.yaml")
    ranks = run("fit", str(EXAMPLES / "mlp.yaml"), "--max-steps", "2", "--nproc", "3",
                "--out", "ranks", cwd=tmp_path, timeout=240)
    assert one.returncode == 0 and ranks.returncode == 0, ranks.stderr
    def losses(out: str) -> list[float]:  # "trained 2 steps: loss a -> b; last validation:
        # mean loss c over 2 steps"
        line = next(line for line in out.splitlines() if line.startswith("trained"))
        return [float(x) for x in re.findall(r"\d+\.\d+", line)]

    # float32 sums in another order: equal to rounding, not always to the 4th printed digit
    assert losses(ranks.stdout) == pytest.approx(losses(one.stdout), rel=1e-3)
    assert (tmp_path / "ranks" / "metrics.csv").exists()
    assert not list((tmp_path / "ranks").glob("rank*"))  # rank 0 alone writes the metrics
    monkeypatch.chdir(tmp_path)  # refused before it starts ranks: in this process
    assert main(["fit", str(EXAMPLES / "mlp.yaml"), "--nproc", "2"]) == 1
    assert "num_csx 3" in capsys.readouterr().err


def test_validate_only(tmp_path, capsys):
    code = main(["compile", str(EXAMPLES / "mlp.yaml"), "--validate-only", "--out",
                 str(tmp_path / "art")])  # in process: what the console script runs
    assert code == 0, capsys.readouterr().err


def test_a_bad_config_fails_in_one_paragraph_and_debug_shows_the_traceback(tmp_path):
    (tmp_path / "bad.yaml").write_text("model: mlp\nbatch_size: 8\nnum_cxs: 2\n")
    result = run("fit", "bad.yaml", cwd=tmp_path, module=True)  # python -m mbcompile
    assert result.returncode == 1
    assert result.stderr.startswith("error: bad.yaml:3: unknown key 'num_cxs' (did you mean "
                                    "'num_csx'?)")
    assert "\n\n" not in result.stderr.strip() and "Traceback" not in result.stderr
    assert main(["fit", str(tmp_path / "bad.yaml"), "--debug"]) == 1  # in process: cheaper


def test_debug_prints_the_traceback(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("model: mlp\nbatch_size: 8\nnum_cxs: 2\n")
    assert main(["compile", str(tmp_path / "bad.yaml"), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConfigError" in err
    assert err.rstrip().splitlines()[-1].startswith("error: ")


@pytest.mark.parametrize("command", [[], ["demo"], ["fit"], ["validate"], ["compile"]])
def test_help_on_every_command(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "usage: mbcompile" in capsys.readouterr().out


def test_help_says_where_the_outputs_go(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for text in ("metrics.csv", "mbcompile-artifacts/<config", "checkpoints/step-", "plan.txt",
                 "writes no files"):
        assert text in out, out


def test_parsed_arguments_travel_to_the_ranks():
    """``fit --nproc`` pickles the parsed arguments to its ranks: the command they run,
    imported lazily, must survive the trip and still name its function."""
    import pickle

    from mbcompile.training.cli.main import build_parser

    args = build_parser().parse_args(["fit", "run.yaml", "--nproc", "2"])
    back = pickle.loads(pickle.dumps(args))
    assert (back.run.module, back.run.name, back.nproc) == ("fit", "run_fit", 2)


# The console script's entry and `python -m mbcompile`: parse, answer --help or a usage
# error, and say whether torch was imported (torch and the compiler cost seconds).
HELP_PROBES = {
    "entry": "from mbcompile.training.cli.main import main\ncode = main(ARGV)",
    "python -m": "import runpy\nsys.argv = ['mbcompile', *ARGV]\ntry:\n"
                 "    runpy.run_module('mbcompile', run_name='__main__')\n"
                 "except SystemExit as exc:\n    code = exc.code",
}


@pytest.mark.parametrize("argv", [["--help"], ["fit", "--help"], ["fit"], ["frobnicate"]])
@pytest.mark.parametrize("how", sorted(HELP_PROBES))
def test_help_and_usage_errors_import_no_torch(how, argv):
    probe = ("import sys\n" + HELP_PROBES[how].replace("ARGV", repr(argv))
             + "\nprint('torch' in sys.modules, 'mbcompile.compiler' in sys.modules, code)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=environment(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["False", "False", "0" if "--help" in argv else "2"]


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["compile"],
    ["compile", "x.yaml", "--mbs", "abc"],
    ["compile", "x.yaml", "--compile-only", "--validate-only"],
    ["fit", "x.yaml", "--max-steps", "0"],
    ["demo", "--gbs", "-3"],
])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_mbs_argument_forms():
    assert mbs_argument("4") == 4
    assert mbs_argument("auto") == "auto"
    assert mbs_argument("explore:2:8") == {"explore": {"min": 2, "max": 8}}
    assert mbs_argument("explore::8") == {"explore": {"max": 8}}


def test_failures_exit_1(tmp_path, capsys):
    assert main(["fit", str(tmp_path / "missing.yaml")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "big.yaml").write_text("model: mlp\nbatch_size: 8\n")
    assert main(["compile", str(tmp_path / "big.yaml"), "--mbs", "9", "--out",
                 str(tmp_path / "a")]) == 1
    assert "must be at most the per-system batch size 8" in capsys.readouterr().err


# Normed (BatchNorm in training) runs as a two-phase step; Baked bakes the batch size into
# a shape, which no split can run: the CLI's rejection.
REJECTED = '''
import torch
import torch.nn as nn


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.l(x)).pow(2).mean()


class Baked(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x).view(8, 2, 2).pow(2).mean()


def data(batch_size):
    return [(torch.randn(batch_size, 4),)]
'''


def _cli_model_config(tmp_path, monkeypatch, name):
    (tmp_path / "cli_rejected_model.py").write_text(REJECTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cli_rejected_model", raising=False)
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        model: cli_rejected_model:{name}
        data: cli_rejected_model:data
        batch_size: 8
        num_csx: 2
    """))
    return str(path)


def test_a_rejected_model_is_drawn_and_explained(tmp_path, capsys, monkeypatch):
    config = _cli_model_config(tmp_path, monkeypatch, "Baked")
    assert main(["compile", config, "--out", str(tmp_path / "art")]) == 1
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("error: ") and "Tensor.view" in first and "node 'view'" in first
    assert "x -> l -> view" in err  # the path from the batched input
    assert "the graph with the mixing op highlighted" in err
    dot = (tmp_path / "art" / "rejected.dot").read_text()
    assert '"o_view" [' in dot and "#f87171" in dot
    assert {"x", "l", "view"} <= svg_lines(tmp_path / "art" / "rejected.svg")


def test_batch_norm_in_training_compiles_as_a_two_phase_step(tmp_path, capsys, monkeypatch):
    config = _cli_model_config(tmp_path, monkeypatch, "Normed")
    assert main(["compile", config, "--mbs", "2", "--out", str(tmp_path / "art")]) == 0
    out = capsys.readouterr().out
    assert "two-phase step (a loss that couples samples)" in out
    assert not (tmp_path / "art" / "rejected.dot").exists()


def test_compile_plans_the_step_fit_runs_for_a_transformers_model(tmp_path, capsys):
    """``examples/hf/llama.yaml``: a Llama from its class and config mapping, compiled with
    the config's ``outputs`` (the loss, as ``fit`` trains it): no logits are kept."""
    pytest.importorskip("transformers")
    art = tmp_path / "art"
    code = main(["compile", str(EXAMPLES / "hf" / "llama.yaml"), "--compile-only", "--out",
                 str(art)])
    assert code == 0, capsys.readouterr().err
    config = json.loads((art / "plan.json").read_text())["config"]
    assert config["outputs"] == "loss" and config["model_config"]["hidden_size"] == 32
    graph = (art / "graph.py").read_text()
    assert "accumulate_sum" in graph and "accumulate_cat" not in graph


def test_validate_command(tmp_path, capsys):
    code = main(["validate", str(EXAMPLES / "mlp.yaml"), "--steps", "1", "--out",
                 str(tmp_path / "v")])
    assert code == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "validated 1 steps: mean loss" in said and "no checkpoint in" in said


def test_validate_after_fit_validates_its_weights_and_keeps_its_metrics(tmp_path, capsys):
    """It wrote the fit's metrics.csv over with its one row, and validated the model as the
    config builds it, untrained (found by a hunt)."""
    out = tmp_path / "run"
    assert main(["fit", str(EXAMPLES / "mlp.yaml"), "--max-steps", "2", "--out",
                 str(out)]) == 0
    before = (out / "metrics.csv").read_text()
    fitted = [r for r in csv.DictReader(before.splitlines()) if r["phase"] == "validate"]
    capsys.readouterr()
    assert main(["validate", str(EXAMPLES / "mlp.yaml"), "--out", str(out)]) == 0
    assert "validating the weights of" in capsys.readouterr().out
    assert (out / "metrics.csv").read_text() == before
    rows = list(csv.DictReader((out / "validate" / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["global_step"], r["loss"]) for r in rows] == \
        [(r["step"], r["global_step"], r["loss"]) for r in fitted]


def test_artifacts_take_the_report_and_the_exploration_plot(tmp_path):
    """The contract with the cost model: ``cm.report()`` gives text (``str``) and data
    (``to_dict``); its ``exploration.plot(path)`` draws the explore plot."""
    import mbcompile
    from mbcompile.models import make_mlp
    from mbcompile.training.cli.compile import write_artifacts

    class Exploration:
        def plot(self, path):
            Path(path).write_bytes(b"\x89PNG")
            return Path(path)

    class Report:
        exploration = Exploration()

        def __str__(self):
            return "modelled step time 1 ms"

        def to_dict(self):
            return {"best_mbs": 2}

    model, batch = make_mlp(8)
    cm = mbcompile.compile(model, 8, 2, 2, example_inputs=batch)
    object.__setattr__(cm, "report", Report)
    files = {p.name for p in write_artifacts(cm, tmp_path, mbs={"explore": {"max": 4}})}
    assert files == {"plan.txt", "plan.json", "graph.py", "original_graph.py", "graph.dot",
                     "graph.svg", "explore.png"}
    assert "modelled step time 1 ms" in (tmp_path / "plan.txt").read_text()
    assert json.loads((tmp_path / "plan.json").read_text())["report"] == {"best_mbs": 2}


INF_AT_STEP_3 = """
    model: {name: mlp, kwargs: {features: 4, hidden: 8, out: 2}}
    data: {source: cli_models:inf_at_step, kwargs: {step: 3}}
    batch_size: 8
    num_csx: 2
    callbacks:
      - GlobalFlags: {micro_batch_size: 3}   # not supported for pbs 4: 2, with a warning
    fit: {max_steps: 5}
"""


@pytest.mark.slow
def test_a_failure_in_the_middle_of_fit_keeps_the_metrics(tmp_path):
    # Step 3's last sample is infinite: system 1's second microbatch has a NaN loss.
    (tmp_path / "inf.yaml").write_text(textwrap.dedent(INF_AT_STEP_3))
    result = run("fit", "inf.yaml", "--out", "run", cwd=tmp_path,
                 env=environment(PYTHONPATH=str(TESTS)))
    assert result.returncode == 1
    err = result.stderr
    first = err.splitlines()[0]
    assert first.startswith("error: ") and "system 1, microbatch 1" in first, err
    assert "the metrics of the 2 finished training steps are in run/metrics.csv" in err
    assert "Traceback" not in err
    # the warning from compiling step 1 comes after the error, not before it
    warning = err.index("warning: mbs=3 is not supported")
    assert warning > err.index("error:") and err.count("warning: mbs=3") == 1
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["1", "2"]
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_warnings_show_without_an_error(tmp_path, capsys):
    # mlp.yaml asks for mbs 5, which becomes 4 with a warning
    assert main(["compile", str(EXAMPLES / "mlp.yaml"), "--out", str(tmp_path / "art")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: mbs=5 is not supported") and "error" not in err


def test_ctrl_c_exits_130_with_a_short_message(tmp_path):
    # A reset SIGINT: a shell without job control starts background jobs (a CI runner's
    # pytest, say) with SIGINT ignored, and then Python would never raise KeyboardInterrupt.
    proc = subprocess.Popen(
        command("fit", str(EXAMPLES / "mlp.yaml"), "--max-steps", "100000", "--out", "run"),
        cwd=tmp_path, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        for line in proc.stdout:  # training has started once a step is logged
            if line.startswith("train step"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate()
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 130, err
    assert err.startswith("interrupted\n  the metrics of the ") and "Traceback" not in err
    assert len(err.splitlines()) <= 3  # the message, what was kept, the mbs warning
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) >= 5


def test_explore_plans_only_in_the_cli(tmp_path, capsys):
    """``--mbs explore`` compares MBS values and pins none: ``compile`` implies
    --compile-only; ``fit`` and ``validate`` refuse it, before building anything, with the
    command that explores (not the Python API's ``compile_only=True``)."""
    path = tmp_path / "run.yaml"
    path.write_text("model: mlp\nbatch_size: 8\nnum_csx: 2\n"
                    "callbacks: [{ScopedValidateFlags: {micro_batch_size: explore}}]\n")
    art = tmp_path / "art"
    assert main(["compile", str(path), "--mbs", "explore", "--out", str(art)]) == 0
    out = capsys.readouterr().out
    assert "compiling with --compile-only" in out and "compile-only: mlp" in out
    assert (art / "plan.txt").exists()
    assert main(["fit", str(path), "--mbs", "explore:1:2", "--out", str(tmp_path / "f")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --mbs is explore:1:2: ")
    assert f"`mbcompile compile {path} --mbs explore:1:2 --compile-only`" in err
    assert "compile_only=True" not in err
    # the config's validate flag explores: fit (which validates) and validate refuse it
    for command in ("fit", "validate"):
        assert main([command, str(path), "--out", str(tmp_path / "f")]) == 1
        err = capsys.readouterr().err
        assert f"{path}'s validate micro_batch_size is explore" in err
        assert "--mbs explore --compile-only --phase validate`" in err
    assert not (tmp_path / "f").exists()  # refused before anything ran
