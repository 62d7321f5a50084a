"""README.md's worked example (also docs/index.md's, which includes it) runs, and prints
what the README shows: the plan line for line, the rewritten forward line for line, and
the lines of the body it shows, in order. The README leaves out the source-line comments
and the ``;  x = None`` clean-ups ``print_readable`` prints, and most of the body."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> tuple[str, list[str]]:
    """The worked example's code and the lines the README says it prints."""
    text = README.read_text()
    example = text.split("<!-- --8<-- [start:example] -->")[1].split("<!-- --8<-- [end")[0]
    code = re.search(r"```python\n(.*?)```", example, re.S)[1]
    printed = re.search(r"prints .*?:\n\n```\n(.*?)```", example, re.S)[1]
    return code, printed.splitlines()


def _readable(lines: list[str]) -> list[str]:
    """``print_readable``'s lines as the README writes them: no comments, no blank lines,
    no ``;  x = None`` clean-ups."""
    out = []
    for line in lines:
        line = re.sub(r";  [\w =]+ = None$", "", line.rstrip())
        if line.strip() and not line.strip().startswith("#"):
            out.append(line)
    return out


def _parts(lines: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(the plan, the top-level class up to its body, the body class)."""
    start = next(i for i, line in enumerate(lines) if line.startswith("class "))
    body = next(i for i, line in enumerate(lines) if line.strip() == "class body(torch.nn.Module):")
    return lines[:start], lines[start:body], lines[body:]


def test_the_worked_example_prints_what_the_readme_shows(capsys) -> None:
    code, shown = _example()
    exec(compile(code, str(README), "exec"), {})
    printed = _readable(capsys.readouterr().out.splitlines())
    plan, forward, body = _parts(printed)
    want_plan, want_forward, want_body = _parts(_readable(shown))
    assert plan == want_plan  # line for line: nothing in this plan varies between machines
    assert forward == want_forward
    shown_body = [line for line in want_body if line.strip() != "..."]
    lines = iter(body)  # the README's body lines, in the order they are printed
    assert all(any(line == got for got in lines) for line in shown_body), \
        "\n".join(body)
