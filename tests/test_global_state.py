"""Python state outside the model, exact or refused (issue 35): globals, other modules,
closures, module-level objects; and the calls no step can replay (files, Python's and
numpy's random numbers, the clock, seeding through a name the code holds).

The exact cases are the fuzzer's constructs (``tests/fuzz/globalstate.py``: each model has
module globals of its own), here over three steps on an uneven plan (7 over 2 systems,
MBS 2) in float64 against eager: loss, outputs, every ``.grad``, parameters after SGD,
buffers, generators, the RNG states and the module globals; the Python state each reads is
changed between the second and the third step. A refusal is the project's own error,
naming the call and the fix, with the model, its module's globals and every random
generator as they were.
"""

from __future__ import annotations

import datetime
import io
import random
import time
import warnings
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fuzz import Spec, build, make_inputs, step_errors
from fuzz.oracle import _sgd, state_changes, state_of
from models import assert_close_errors, plan_free

import mbcompile
from mbcompile import CaptureError, RecompileWarning

GBS, SYSTEMS, MBS = 7, 2, 2
EXACT = ["helper_global", "helper_swapped", "global_dict", "closure_factor", "global_counter",
         "class_attribute", "global_schedule", "held_schedule",
         "global_log", "helper_writes", "global_generator"]

pytestmark = pytest.mark.filterwarnings("ignore")


def _compile(model: nn.Module, inputs: tuple[Any, ...], **kw: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mbcompile.compile(model, GBS, SYSTEMS, MBS, example_inputs=inputs,
                                 **plan_free(MBS, **kw))


@pytest.mark.parametrize("coupled", [False, True], ids=["split", "two_phase"])
@pytest.mark.parametrize("name", EXACT)
def test_module_state_is_exact_over_three_steps(name: str, coupled: bool) -> None:
    _three_steps(Spec((name,), coupled=coupled))


@pytest.mark.parametrize("coupled", [False, True], ids=["split", "two_phase"])
def test_a_private_counter_moves_once_per_step_under_export(coupled: bool) -> None:
    """A hook on the model itself sends the capture to torch.export, which puts back the
    attributes forward assigned before mbcompile's snapshot sees them: ``self._step += 1``
    stayed at 0 (found by the fuzzer, F8)."""
    _three_steps(Spec(("private_counter", "root_forward_hook"), coupled=coupled))


def _three_steps(spec: Spec) -> None:
    model, ref = build(spec), build(spec)
    inputs = make_inputs(spec)
    cm = _compile(model, inputs)
    for step in (1, 2, 3):
        if step == 3:  # the state each construct reads changes after compile
            model.blocks[0].mutate(model)
            ref.blocks[0].mutate(ref)
        model.zero_grad(set_to_none=True)
        errors = step_errors(model, cm, ref, inputs, seed=step)
        assert_close_errors(errors, 1e-10)
        _sgd(model)
        _sgd(ref)


def test_a_global_changed_after_compile_compiles_again_naming_it() -> None:
    spec = Spec(("helper_global",))
    model = build(spec)
    inputs = make_inputs(spec)
    cm = _compile(model, inputs)
    model.blocks[0].mutate(model)
    with pytest.warns(RecompileWarning, match=r"the global global_helpers\.SCALE|SCALE was 0.5"):
        cm(*inputs)


# --------------------------------------------------------------------------- refused


LOG_FILE = io.StringIO()
ARRAY = np.ones(3)
COUNTER = 0
ENCODER = nn.Linear(4, 4).double()


class Refused(nn.Module):
    """One call that no step can replay, by ``how``."""

    def __init__(self, how: str, path: Path | None = None) -> None:
        super().__init__()
        self.how, self.path, self.lin = how, path, nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        global COUNTER
        COUNTER += 1  # written before the refused call: put back by the refusal
        h = self.lin(x)
        if self.how == "file":
            with open(self.path, "w") as f:
                f.write("step")
        elif self.how == "file_caught":
            try:
                open(self.path, "w").close()
            except Exception:  # the refusal is raised in forward; forward swallows it
                pass
        elif self.how == "python_random":
            h = h * random.uniform(0.5, 1.5)
        elif self.how == "numpy_random":
            h = h * float(np.random.normal())
        elif self.how == "clock":
            h = h * (1 + 0 * time.time())
        elif self.how == "clock_imported":
            h = h * (1 + 0 * perf_counter())
        elif self.how == "datetime_now":  # a class method, bound anew at each access
            h = h * (1 + 0 * datetime.datetime.now().microsecond)
        elif self.how == "date_today":
            h = h * (1 + 0 * datetime.date.today().day)
        elif self.how == "thread_time":
            h = h * (1 + 0 * time.thread_time())
        return F.mse_loss(h, y)


def _clock_in_a_closure(how: str, path: Path | None = None) -> nn.Module:
    """A model class defined in a function that imports the clock: forward reaches it
    through a closure variable, not a global (it compiled, the time frozen at compile)."""
    import datetime as clock_module
    import time as clock

    class ClosureClock(Refused):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            global COUNTER
            COUNTER += 1
            stamp = clock.time() if how == "closure_time" else \
                clock_module.datetime.now().timestamp()
            return F.mse_loss(self.lin(x) * (1 + 0 * stamp), y)

    return ClosureClock(how, path)


class ReadsFile(nn.Module):
    """Prints into a file object held in a global."""

    def __init__(self, how: str, path: Path | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        print("step", file=LOG_FILE)
        return F.mse_loss(self.lin(x), y)


class ReadsModule(ReadsFile):
    """Calls a layer held in a global, not a submodule: its weights would be constants."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(ENCODER(x)), y)


class ReadsArray(ReadsFile):
    """Scales by a numpy array's sum, the array a global."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.lin(x) * float(ARRAY.sum()), y)


REFUSALS = {
    "file": "opens a file",
    "file_caught": "opens a file",
    "python_random": "draws from Python's random module",
    "numpy_random": "draws from numpy's random generator",
    "clock": "reads the clock",
    "clock_imported": "reads the clock",
    "datetime_now": r"reads the clock \(datetime.now\)",
    "date_today": r"reads the clock \(date.today\)",
    "thread_time": "reads the clock",
    "closure_time": "reads the clock",
    "closure_datetime": r"reads the clock \(datetime.now\)",
    "file_object": "the global LOG_FILE, a StringIO",
    "array": "the global ARRAY, a ndarray",
    "module": "the global ENCODER, a Linear",
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_a_call_no_step_can_replay_is_refused_with_nothing_changed(how: str, tmp_path: Path
                                                                   ) -> None:
    torch.manual_seed(0)
    path = tmp_path / "written.txt"
    kind = {"file_object": ReadsFile, "array": ReadsArray, "module": ReadsModule,
            "closure_time": _clock_in_a_closure, "closure_datetime": _clock_in_a_closure,
            }.get(how, Refused)
    model = kind(how, path).double()
    x, y = torch.randn(GBS, 4, dtype=torch.float64), torch.randn(GBS, 3, dtype=torch.float64)
    before = state_of(model)
    rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    with pytest.raises(CaptureError, match=REFUSALS[how]) as info:
        _compile(model, (x, y))
    assert "Fix:" in str(info.value)
    assert not state_changes(before, state_of(model))
    assert COUNTER == 0 and not path.exists() and LOG_FILE.getvalue() == ""
    assert torch.equal(torch.get_rng_state(), rngs[0]) and random.getstate() == rngs[1]
    assert np.array_equal(np.random.get_state()[1], rngs[2])


@pytest.mark.parametrize("name", ["global_generator_seed", "seed_imported", "fork_rng_imported",
                                  "rng_state_read", "file_write", "python_random",
                                  "numpy_random", "local_generator"])
def test_seeding_and_io_by_any_name_are_refused(name: str) -> None:
    spec = Spec((name,))
    model = build(spec)
    before = state_of(model)
    with pytest.raises(CaptureError, match="Fix:"):
        _compile(model, make_inputs(spec))
    assert not state_changes(before, state_of(model))
