"""How fast ``mbcompile --help`` answers, side by side with ``python -c pass``.

    python benchmarks/bench_cli.py [--rounds 15] [--before DIR]

Each round starts every contender once, in turn, as a fresh process (so a burst of
load from another process hits them alike): ``python -c pass`` (the interpreter
alone), the console script ``mbcompile --help``, ``python -m mbcompile --help``, and
``python -c "import torch"`` (what every command paid before the parser imported its
commands lazily). ``--before DIR`` adds ``python -m mbcompile --help`` run from the
``mbcompile`` package of another checkout (``git archive REV mbcompile | tar -x -C
DIR``), put first on ``PYTHONPATH``. Printed: the median wall time of each in seconds,
and the median of the per-round ratios to ``python -c pass``. Issue 36's target:
``mbcompile --help`` within 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "mbcompile --help": [shutil.which("mbcompile", path=str(Path(sys.executable).parent))
                         or "mbcompile", "--help"],
    "python -m mbcompile --help": [sys.executable, "-m", "mbcompile", "--help"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
}
BASE = "python -c pass"
EMPTY = tempfile.mkdtemp(prefix="bench_cli_")
TARGET_S = 0.5


def once(command: list[str], path: str | None = None) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    # from an empty folder: `python -m` puts the current folder first on sys.path, which
    # in a checkout would shadow the --before package
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env, cwd=EMPTY)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", metavar="DIR", default=None,
                        help="a folder holding another checkout's mbcompile package")
    args = parser.parse_args(argv)
    contenders = {name: (command, None) for name, command in CONTENDERS.items()}
    if args.before:
        contenders[f"python -m mbcompile --help ({args.before})"] = (
            [sys.executable, "-m", "mbcompile", "--help"], args.before)
    for command, path in contenders.values():  # warm the file cache: first starts read disk
        once(command, path)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, (command, path) in contenders.items():
            times[name].append(once(command, path))
    print(f"{args.rounds} rounds, the contenders in turn, fresh processes; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"| command | median s | min s | / {BASE} (median of per-round ratios) |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        ratio = statistics.median(v / b for v, b in zip(values, times[BASE]))
        print(f"| `{name}` | {statistics.median(values):.3f} | {min(values):.3f} | "
              f"{ratio:.2f} |")
    help_s = statistics.median(times["mbcompile --help"])
    print(f"target: mbcompile --help <= {TARGET_S} s: {help_s:.3f} s "
          f"({'holds' if help_s <= TARGET_S else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
