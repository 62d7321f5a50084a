"""The built wheel ships the top-level ``passes/`` folder as ``mbcompile.passes``, never bare.

``pyproject.toml`` maps the folder with ``package-dir = {"mbcompile.passes" = "passes"}`` and lists
every package by hand, so a forgotten subpackage or a stray top-level ``passes`` would only show up
in an installed wheel. These tests build one and import from it in a clean interpreter:

1. copy the build inputs to a temp dir (setuptools writes ``build/`` and ``*.egg-info`` next to
   the sources, and a stale ``build/lib`` can smuggle deleted modules into the wheel);
2. ``python -m build --wheel --no-isolation`` (no network: the backend comes from the test extra);
3. read the wheel's file list;
4. ``pip install --no-deps --no-index --target`` it, then import it with ``python -I -S`` from an
   empty directory, so neither the checkout nor the editable install's finder is on the path.
"""

from __future__ import annotations

import ast
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# What the build reads. Package folders first; optional metadata files are copied when present.
_SOURCE_DIRS = ("mbcompile", "passes")
_SOURCE_FILES = ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in", "README.md", "LICENSE")

# Run inside the clean interpreter: argv = [target, *site_dirs].
_IMPORT_PROBE = """
import sys
target, *site_dirs = sys.argv[1:]
sys.path[:0] = [target]
sys.path.extend(site_dirs)
import mbcompile.passes
print("mbcompile", mbcompile.__file__)
print("mbcompile.passes", mbcompile.passes.__file__)
try:
    import passes
except ModuleNotFoundError:
    print("passes", "-")
else:
    print("passes", passes.__file__)
"""


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; on failure, fail the test with its whole output."""
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the project's wheel from a clean copy of its sources; return its path."""
    src = tmp_path_factory.mktemp("src")
    for name in _SOURCE_DIRS:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in _SOURCE_FILES:
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)]
    _run([*build, str(src)])
    (whl,) = out.glob("mbcompile-*.whl")
    return whl


def _sources(folder: str) -> set[str]:
    """Every .py file under ``REPO/folder``, relative to it, in wheel (``/``) spelling."""
    root = REPO / folder
    paths = (p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return {p.relative_to(root).as_posix() for p in paths}


def test_wheel_maps_passes_under_mbcompile(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert zf.read(top_level).decode().split() == ["mbcompile"]
    files = set(names)

    assert "mbcompile/passes/__init__.py" in files
    assert not [n for n in names if n.startswith("passes/")], "a bare top-level passes/ shipped"
    strays = [n for n in names if not n.startswith("mbcompile/") and ".dist-info/" not in n]
    assert not strays, f"files outside mbcompile/ in the wheel: {strays}"

    # Every source module ships; a miss means a subpackage is missing from
    # [tool.setuptools] packages in pyproject.toml (they are listed by hand).
    missing = {f"mbcompile/passes/{f}" for f in _sources("passes")} - files
    missing |= {f"mbcompile/{f}" for f in _sources("mbcompile")} - files
    assert not missing, (
        f"not in the wheel (list the subpackage in pyproject.toml): {sorted(missing)}"
    )


def test_installed_wheel_imports_as_mbcompile_passes(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "target"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet"]
    _run([*pip, "--target", str(target), str(wheel)])

    # -I: no cwd, no PYTHONPATH, no user site; -S: no site-packages and so no .pth files, which
    # is where an editable install of this checkout hooks in. The site dirs are appended by hand
    # after the target so torch and friends still import.
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    probe = [sys.executable, "-I", "-S", "-c", _IMPORT_PROBE, str(target)]
    proc = _run([*probe, *site.getsitepackages()], cwd=cwd)
    found = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)

    assert found["mbcompile"] != "None", "mbcompile/__init__.py is missing (namespace package)"
    assert Path(found["mbcompile"]).is_relative_to(target), found
    assert Path(found["mbcompile.passes"]) == target / "mbcompile" / "passes" / "__init__.py", found
    assert found["passes"] == "-", f"`import passes` must fail outside the checkout: {found}"


def test_dev_checkout_imports_mbcompile_passes_from_repo() -> None:
    """From the repo root (pytest's cwd) ``./mbcompile`` wins on sys.path; ``passes/`` must follow.

    The editable install's finder (``pip install -e .``) maps ``mbcompile.passes`` to ``passes/``
    and answers for it after the normal path finder misses ``mbcompile/passes``.
    """
    import mbcompile
    import mbcompile.passes

    for module in (mbcompile, mbcompile.passes):  # a folder without __init__.py has no __file__
        assert module.__file__, f"{module.__name__} is a namespace package: add its __init__.py"
    if Path(mbcompile.__file__).resolve().parent != REPO / "mbcompile":
        pytest.skip(f"mbcompile imported from {mbcompile.__file__}, not this checkout")
    assert Path(mbcompile.passes.__file__).resolve() == REPO / "passes" / "__init__.py", (
        "mbcompile.passes is not the checkout's passes/: run `pip install -e .`"
    )


def test_no_bare_passes_imports() -> None:
    """Code says ``mbcompile.passes``; a bare ``import passes`` works only from the repo root and
    would load a second copy of every pass module (two rule tables, two sets of classes)."""
    offenders = []
    for folder in ("mbcompile", "passes", "tests", "examples", "benchmarks"):
        paths = (REPO / folder).rglob("*.py") if (REPO / folder).is_dir() else ()
        for path in sorted(paths):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                if any(m == "passes" or m.startswith("passes.") for m in modules):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, f"import mbcompile.passes instead of bare passes: {offenders}"
