"""Run the model zoo (``tests/zoo.py``) and print, or write into docs/zoo.md, its table.

    python benchmarks/zoo_table.py                  # run every model, print the table
    python benchmarks/zoo_table.py --write-readme   # and replace the table in docs/zoo.md
    python benchmarks/zoo_table.py llama t5         # only these models (never written)

Each model runs the case ``tests/test_zoo.py`` runs (one training step, GBS 7 over
2 systems, MBS 2, against the eager full batch), in this one process, one model
after the other. The table groups the models of a family by what they gave today:
a match and its tolerance class (and whether it ran as a two-phase step), the
expected rejection, or today's refusal (its first error line). Below it: the
number of models of each outcome, the slowest compile and the total time. Any
outcome that differs from the registry's entry is listed after the table and makes
the exit status 1: update ``tests/zoo.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from zoo import FAMILIES, MBS, NUM_CSX, ZOO, Outcome, run_case  # noqa: E402

README = ROOT / "docs" / "zoo.md"
START, END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"


def result_text(o: Outcome) -> str:
    """The table's words for an outcome; models with the same words share a row."""
    if o.result == "match":
        tol = o.entry.tolerance
        assert tol is not None
        how = " as a two-phase step" if o.two_phase else ""
        if tol.name == "float64":
            return f"matches eager{how} (float64, ≤ 1e-10)"
        return f"matches eager{how} to float32 rounding ({tol.name})"
    if o.result == "rejected" and o.as_expected:
        return f"rejected as expected: {o.entry.expected.removeprefix('reject:')}"
    if o.result == "mismatch":
        return f"**differs from eager** ({o.detail})"
    # Node names change from model to model: group refusals by op and kind.
    return "refused today: " + re.sub(r" at node '[^']*'", "", o.detail)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| family | models | result |", "|---|---|---|"]
    for family in FAMILIES:
        groups: dict[str, list[str]] = {}
        for o in outcomes:
            if o.entry.family == family:
                groups.setdefault(result_text(o), []).append(o.entry.name)
        for text, names in groups.items():
            rows.append(f"| {family} | {', '.join(names)} | {text.replace('|', '/')} |")
    return "\n".join(rows)


def summary(outcomes: list[Outcome], total_s: float, cpu_s: float) -> str:
    counts = Counter(
        "two-phase match" if o.result == "match" and o.two_phase
        else "match" if o.result == "match"
        else "expected rejection" if o.result == "rejected" and o.as_expected
        else "known failure" if o.entry.known_failure is not None and not o.as_expected
        else "unexpected" for o in outcomes)
    slowest = max(outcomes, key=lambda o: o.compile_cpu_s)
    failures = Counter(re.sub(r" at node '[^']*'", "", o.detail).split(": ")[0]
                       + ": " + _op(o.detail) for o in outcomes
                       if o.result != "match" and not o.as_expected)
    lines = [
        f"{len(outcomes)} models: {counts['match'] + counts['two-phase match']} match eager "
        f"({counts['two-phase match']} of them as two-phase steps), "
        f"{counts['expected rejection']} rejected as expected, "
        f"{counts['known failure']} refused today (known failures)"
        + (f", **{counts['unexpected']} unexpected**" if counts["unexpected"] else "") + ".",
        f"Slowest compile: {slowest.entry.name}, {slowest.compile_s:.1f} s "
        f"({slowest.compile_cpu_s:.1f} s CPU). "
        f"The whole zoo: {total_s:.0f} s wall, {cpu_s:.0f} s CPU "
        f"({os.cpu_count()} cores, torch {torch.__version__}, one intra-op thread, "
        f"gbs 7 over {NUM_CSX} systems, mbs {MBS}).",
    ]
    if failures:
        lines.append("Refusals by cause: " + "; ".join(
            f"{cause} ({n})" for cause, n in failures.most_common()) + ".")
    return "\n\n".join(lines)


def _op(detail: str) -> str:
    found = re.search(r"torch\.ops\.aten\.\w+|torch\.export|forward takes \*args", detail)
    return found.group(0) if found else detail[:60]


def surprises(outcomes: list[Outcome]) -> list[str]:
    """Outcomes the registry does not expect: a refused entry now passes, or worse."""
    out = []
    for o in outcomes:
        e = o.entry
        if e.known_failure is not None and o.result == "match":
            out.append(f"{e.name}: now matches eager: drop its known_failure")
        elif e.known_failure is None and not o.as_expected:
            got = f"{o.result} (two-phase step)" if o.two_phase else o.result
            out.append(f"{e.name}: expected {e.expected}, got {got}: {o.detail}")
    return out


def write_readme(text: str) -> None:
    readme = README.read_text()
    if START not in readme or END not in readme:
        raise SystemExit(f"{README} has no {START} ... {END} markers")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="only these models (default: all)")
    parser.add_argument("--write-readme", action="store_true",
                        help="replace the table between docs/zoo.md's zoo markers")
    args = parser.parse_args()
    unknown = set(args.names) - {e.name for e in ZOO}
    if unknown:
        parser.error(f"not in the zoo: {sorted(unknown)}")
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny models: see tests/models.one_intra_op_thread
    entries = [e for e in ZOO if not args.names or e.name in args.names]
    outcomes = []
    wall, cpu = time.perf_counter(), time.process_time()
    for e in entries:
        o = run_case(e)
        outcomes.append(o)
        print(f"{e.name:22s} {o.result:9s} compile {o.compile_s:5.1f} s "
              f"({o.compile_cpu_s:4.1f} s CPU)  total {o.total_s:5.1f} s  {o.detail}", flush=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    text = f"{table(outcomes)}\n\n{summary(outcomes, wall, cpu)}"
    print(f"\n{text}\n")
    odd = surprises(outcomes)
    for line in odd:
        print(f"!! {line}")
    print(f"python {platform.python_version()}, {platform.machine()}")
    if args.write_readme:
        if args.names:
            parser.error("--write-readme needs the whole zoo")
        write_readme(text)
        print(f"wrote the table into {README}")
    return 1 if odd else 0


if __name__ == "__main__":
    sys.exit(main())
