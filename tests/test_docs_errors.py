"""docs/errors.md says what the code does: each sample message in it is what running the
case it describes prints, and its tables name every error and warning with its bases.

A sample is compared after normalising only line wrapping (runs of whitespace) and the
path of the user's file (``/home/me`` in the doc): a change to an error's text fails
here until the doc shows the new text.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mbcompile

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
HOME = "/home/me"  # where the doc's samples put the user's file

#: docs/errors.md's "A MixingError" sample: this file is the user's model.py, line 12 the
#: softmax over the batch.
SOFTMAX_MODEL = '''import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l(x)
        return torch.softmax(h, dim=0)
'''


def _user_model(tmp_path: Path, source: str) -> type:
    """``Net`` from ``source`` written to ``tmp_path/model.py`` (its frames name that file)."""
    path = tmp_path / "model.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("docs_errors_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net


def _softmax_over_the_batch(tmp_path: Path) -> str:
    net = _user_model(tmp_path, SOFTMAX_MODEL)()
    with pytest.raises(mbcompile.MixingError) as info:
        mbcompile.compile(net, 8, 1, 2, example_inputs=(torch.randn(8, 4),),
                          coupling="reject")
    return str(info.value)


#: the heading each sample sits under -> the case that prints it
SAMPLES: dict[str, Callable[[Path], str]] = {
    "## A `MixingError`": _softmax_over_the_batch,
}


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """``(the heading above it, its text)`` for each fenced block of ``text``."""
    blocks, heading = [], ""
    for match in re.finditer(r"^(#+ [^\n]*)$|^```\w*\n(.*?)^```$", text, re.M | re.S):
        if match.group(1):
            heading = match.group(1)
        else:
            blocks.append((heading, match.group(2)))
    return blocks


def _normalised(text: str, tmp_path: Path | None = None) -> str:
    if tmp_path is not None:
        text = text.replace(str(tmp_path), HOME)
    return " ".join(text.split())


def test_every_sample_in_the_doc_has_a_case_that_prints_it() -> None:
    assert [h for h, _ in _code_blocks(DOC.read_text())] == list(SAMPLES)


@pytest.mark.parametrize("heading", SAMPLES)
def test_the_sample_is_what_the_code_prints(heading: str, tmp_path: Path) -> None:
    (sample,) = [text for h, text in _code_blocks(DOC.read_text()) if h == heading]
    printed = SAMPLES[heading](tmp_path)
    assert str(tmp_path) in printed  # the user's own file is named, and normalised below
    assert _normalised(printed, tmp_path) == _normalised(sample), printed


def _rows(section: str) -> dict[str, tuple[str | None, list[str]]]:
    """The table of ``section``: class name -> (its module when named, the 'also a' names)."""
    text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in text.splitlines() if line.startswith("|"))
    with_bases = "| also a |" in header  # the warnings' table has no such column
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| `(\w+)`(?: \(`([\w.]+)`\))? \|([^|]*)\|", line)
        if match:
            also = re.findall(r"`([\w.]+)`", match.group(3)) if with_bases else []
            rows[match.group(1)] = (match.group(2), also)
    return rows


def _resolve(name: str, module: str | None = None) -> type:
    if module is not None:
        return getattr(importlib.import_module(module), name)
    if "." in name:  # torch.OutOfMemoryError
        owner, attr = name.rsplit(".", 1)
        return getattr(importlib.import_module(owner), attr)
    return getattr(mbcompile, name, None) or getattr(builtins, name)


def _defined(base: type) -> set[type]:
    """Every subclass of ``base`` that mbcompile defines (all its modules imported)."""
    for info in pkgutil.walk_packages(mbcompile.__path__, "mbcompile."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    found, todo = set(), [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("mbcompile."):
                found.add(sub)
    return found


@pytest.mark.parametrize("section,base", [("Errors", "MbcompileError"),
                                          ("Warnings", "MbcompileWarning")])
def test_the_tables_name_every_class_with_its_bases(section: str, base: str) -> None:
    root = getattr(mbcompile, base)
    rows = _rows(section)
    for name, (module, also) in rows.items():
        cls = _resolve(name, module)
        assert inspect.isclass(cls) and issubclass(cls, root), name
        for other in also:
            assert issubclass(cls, _resolve(other)), (name, other)
    assert {c.__name__ for c in _defined(root)} == set(rows)
