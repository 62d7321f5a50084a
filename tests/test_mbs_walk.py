"""The ``mbs`` walk: ``compile()``'s MBS goes forward through the stages, never back.

From ``compile()`` to where it takes effect, the MBS (the user's value, the parsed
policy, the choices it leaves, the chosen value and the plan) passes through the
functions ``WALK`` names. A *hop* is a call into one of them from a walk function of
another file (calls between two files in a row count once); reading a field or a
property of a frozen result (``request.pbs``, ``plan.microbatch_slices``) is not a hop.
The test traces the hops of a real compile and checks:

1. every file is entered at most once, and the stage files once each, in the chain's
   order: request -> analysis -> selection -> lowering -> module (``docs/architecture.md``,
   "The mbs walk");
2. no file calls back into a file on its call path (no chooser callbacks, no analysis
   asking the request to work a number out again);
3. the walk is the table in ``docs/architecture.md``, hop for hop, so the count the docs
   give is the count of the code.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.nn as nn

import mbcompile

ROOT = Path(mbcompile.__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"

#: file -> the functions the MBS passes through there (qualified names)
WALK: dict[str, set[str]] = {
    "mbcompile/compiler.py": {"compile", "_compile_request", "_module"},
    "mbcompile/request.py": {"make_request"},
    "mbcompile/planning/mbs_policy.py": {"parse_mbs"},
    "mbcompile/planning/plan.py": {"per_system_batch_sizes", "check_policy", "plan_for",
                                   "num_microbatches", "closest_supported", "supported_mbs",
                                   "_requested_form"},
    "mbcompile/planning/microbatch_plan.py": {"MbsChoices.plan"},
    "mbcompile/captures.py": {"Captures.analysed"},
    "mbcompile/analysis.py": {"analyse", "find", "Analysed.for_plan"},
    "mbcompile/selection.py": {"select"},
    "mbcompile/planning/cost_analysis.py": {"analyse_cost"},
    "mbcompile/planning/search.py": {"select_sharded", "select_plan", "Selector.auto",
                                     "Selector.explore", "Selector.estimate"},
    "mbcompile/planning/cost.py": {"CostModel.estimate", "CostModel.estimate_split",
                                   "CostModel.pin", "CostModel.build_fit"},
    "mbcompile/plan_notes.py": {"final_plan"},
    "mbcompile/lowering.py": {"lower"},
    "passes/microbatch_rewrite.py": {"microbatch_rewrite"},
    "mbcompile/dynamic_shapes.py": {"checked_symbolic"},
    "mbcompile/compiled_module.py": {"CompiledModule.__init__"},
}
#: the chain's stage files, in order
STAGES = ("mbcompile/request.py", "mbcompile/analysis.py", "mbcompile/selection.py",
          "mbcompile/lowering.py", "mbcompile/compiled_module.py")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.layer(x) - y) ** 2).mean()


def _walk_function(frame: FrameType) -> str | None:
    """The walk file of ``frame`` when it runs a walk function, else None."""
    name = _relative(frame.f_code.co_filename)
    return name if name is not None and _qualname(frame) in WALK[name] else None


@functools.cache
def _relative(filename: str) -> str | None:
    """A walk file's path from the repository root (None: not a walk file)."""
    try:
        name = Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return name if name in WALK else None


def _qualname(frame: FrameType) -> str:
    """The function's qualified name (Python 3.10 has none on code: the method's class is
    then read off ``self``)."""
    code = frame.f_code
    if hasattr(code, "co_qualname"):
        return code.co_qualname
    owner = frame.f_locals.get("self")
    return f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name


@contextmanager
def _traced() -> Iterator[list[tuple[str, str, str]]]:
    """The hops made inside the block: (caller file, callee file, callee). A hop into a
    file already on the call path (a callback) is recorded with the caller ``"BACK"``."""
    hops: list[tuple[str, str, str]] = []

    def trace(frame: FrameType, event: str, arg: Any) -> None:  # new frames only
        callee = _walk_function(frame)
        if callee is None:
            return
        path, back = [], frame.f_back
        while back is not None:
            found = _walk_function(back)
            if found is not None:
                path.append(found)
            back = back.f_back
        if path and path[0] != callee:
            hops.append(("BACK" if callee in path else path[0], callee, _qualname(frame)))

    sys.settrace(trace)
    try:
        yield hops
    finally:
        sys.settrace(None)


def _runs(hops: list[tuple[str, str, str]]) -> list[tuple[str, str, tuple[str, ...]]]:
    """Hops between the same two files in a row, as one: (caller, callee, callees)."""
    out: list[tuple[str, str, tuple[str, ...]]] = []
    for caller, callee, name in hops:
        if out and out[-1][:2] == (caller, callee):
            if name not in out[-1][2]:
                out[-1] = (caller, callee, (*out[-1][2], name))
        else:
            out.append((caller, callee, (name,)))
    return out


@functools.cache
def _walk(mbs: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """The hops of a compile with ``mbs`` (traced once per value: the tests share it)."""
    torch.manual_seed(0)
    model, x, y = _Model(), torch.randn(10, 8), torch.randn(10, 8)
    mbcompile.compile(model, 10, 3, mbs, example_inputs=(x, y))  # warm: imports, lazy set-up
    with _traced() as hops:
        mbcompile.compile(model, 10, 3, mbs, example_inputs=(x, y))
    return _runs(hops)


def _documented() -> list[tuple[str, str]]:
    """The (from, to) columns of the walk table in docs/architecture.md."""
    text = DOC.read_text().split("## The mbs walk", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *\d+ *\| *`([^`]+)` *\| *`([^`]+)` *\|", text, re.M)
    return [(_full(a), _full(b)) for a, b in rows]


def _full(short: str) -> str:
    """``planning/plan.py`` as named in the table -> its path from the repository root."""
    return next(f for f in WALK if f.endswith("/" + short) or f == short)


@pytest.mark.parametrize("mbs", [2, "auto", "none"])
def test_each_file_is_entered_once_the_stages_in_order(mbs: Any) -> None:
    walk = _walk(mbs)
    entries = [callee for _, callee, _ in walk]
    assert len(entries) == len(set(entries)), walk  # no file is entered twice
    for stage in STAGES:
        assert entries.count(stage) == 1, (stage, walk)
    assert sorted(STAGES, key=entries.index) == list(STAGES)


@pytest.mark.parametrize("mbs", [2, "auto", "none"])
def test_no_file_calls_back_into_its_call_path(mbs: Any) -> None:
    walk = _walk(mbs)
    assert not [hop for hop in walk if hop[0] == "BACK"], walk


def test_the_docs_table_is_the_walk() -> None:
    walk = _walk(2)
    assert _documented() == [(a, b) for a, b, _ in walk], walk
    # "auto" makes the same hops; its search costs candidates before it makes the plan
    auto = _walk("auto")
    assert sorted((a, b) for a, b, _ in auto) == sorted((a, b) for a, b, _ in walk)
