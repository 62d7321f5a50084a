"""The passes depend only downward, and ``import mbcompile`` is cheap.

``mbcompile.passes`` is the bottom layer: the compiler, the planners, the backends
and the trainer build on it, never the other way round (STYLE.md: "Don't import
upward"). Two checks hold that line:

1. at run time, importing every module of the installed ``mbcompile.passes``
   package in a fresh interpreter leaves no ``mbcompile.*`` module outside the
   package in ``sys.modules`` (the bare ``mbcompile`` package itself excepted, which
   Python imports as the parent);
2. statically, no ``.py`` file of the package names an outside module: not with
   ``import``/``from ... import`` (in a function body too, where the run-time check
   cannot see it), not with a relative import that climbs above the package, not
   with ``__import__("mbcompile...")`` or ``importlib.import_module("mbcompile...")``.

And ``import mbcompile`` alone loads none of its submodules (PEP 562 ``__getattr__``
loads each public name on first use), while every public name still resolves.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import mbcompile
import mbcompile.passes

PASSES = "mbcompile.passes"
PASSES_DIR = Path(mbcompile.passes.__file__).resolve().parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(mbcompile.passes.__path__, PASSES + "."))


def _inside_passes(name: str) -> bool:
    return name == PASSES or name.startswith(PASSES + ".")


def _outside(name: str) -> bool:
    """An ``mbcompile`` module the passes must not load (the bare parent package is fine)."""
    return (name == "mbcompile" or name.startswith("mbcompile.")) and not _inside_passes(name)


def _run_python(code: str, cwd: Path) -> dict:
    """Run ``code`` in a fresh interpreter (from ``cwd``, away from the checkout); return the
    JSON it prints last."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=cwd, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, f"the probe failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- #
# 1. Run time: importing the passes loads nothing above them
# --------------------------------------------------------------------------- #

# argv[1:]: the modules to import, in order. After each import, the mbcompile modules
# outside the passes that appeared are charged to it (the first import that pulls a
# module in is the one whose import chain reaches upward).
_PASSES_PROBE = """
import importlib, json, sys
def outside():  # the bare parent package ``mbcompile`` is allowed
    return {m for m in sys.modules if m.startswith("mbcompile.")
            and m != "mbcompile.passes" and not m.startswith("mbcompile.passes.")}
before = outside()
blame = {}
for name in sys.argv[1:]:
    seen = outside()
    importlib.import_module(name)
    new = sorted(outside() - seen)
    if new:
        blame[name] = new
loaded = sorted(m for m in sys.modules if m == "mbcompile" or m.startswith("mbcompile."))
print(json.dumps({"before": sorted(before), "blame": blame, "after": sorted(outside()),
                  "loaded": loaded}))
"""


def test_the_passes_package_has_the_expected_modules() -> None:
    """pkgutil sees the installed package (not a stray bare ``passes``), with every pass."""
    assert PASSES_DIR.name == "passes", PASSES_DIR
    short = {m.rsplit(".", 1)[1] for m in MODULES}
    assert {"capture", "shape_prop", "batch_analysis", "batch_rules", "microbatch_rewrite",
            "ops", "facts", "errors"} <= short, MODULES


def test_importing_every_pass_loads_nothing_outside_the_passes(tmp_path: Path) -> None:
    code = f"import sys; sys.argv[1:] = {MODULES!r}\n" + _PASSES_PROBE
    got = _run_python(code, tmp_path)
    assert got["before"] == [], got
    assert got["blame"] == {}, (
        "importing these passes loaded mbcompile modules outside mbcompile.passes "
        f"(pass -> modules it pulled in): {got['blame']}. A pass must not import upward: "
        "move the type or op it needs into mbcompile.passes")
    # Not the compiler, planning, execution (the simulated and torch.distributed backends)
    # or training (trainer, cli, config): nothing but the passes and their bare parent.
    assert got["after"] == [], got["after"]
    assert got["loaded"] == sorted(["mbcompile", PASSES, *MODULES]), got["loaded"]


# --------------------------------------------------------------------------- #
# 2. Static: no file of the package names a module above it
# --------------------------------------------------------------------------- #

_IMPORT_CALLS = {"__import__", "import_module"}  # __import__(...), importlib.import_module(...)


def _package_of(path: Path) -> list[str]:
    """``mbcompile.passes[.sub]`` as parts: the package a file's relative imports start from."""
    rel = path.relative_to(PASSES_DIR).parent.parts
    return ["mbcompile", "passes", *rel]


def upward_imports(source: str, package: list[str], filename: str = "<source>") -> list[str]:
    """Every place in ``source`` that names an mbcompile module outside the passes.

    ``package`` is the dotted package (as parts) the file sits in, to resolve relative
    imports. Returns ``"line N: what"`` strings; empty when the file keeps to the layer.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if _outside(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = ", ".join(a.name for a in node.names)
            dots = "." * node.level
            if node.level:
                base = package[:max(len(package) - (node.level - 1), 0)]
                if base[:2] != ["mbcompile", "passes"]:  # even ``from .. import passes``
                    found.append(f"line {node.lineno}: from {dots}{node.module or ''} import "
                                 f"{names} (climbs above mbcompile.passes)")
                    continue
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # ``from mbcompile import passes`` / ``from mbcompile.passes import x`` stay inside
            targets = ([f"{target}.{a.name}" for a in node.names] if target == "mbcompile"
                       else [target])
            if any(_outside(t) for t in targets):
                found.append(f"line {node.lineno}: from {dots}{node.module or ''} import {names}"
                             f" (resolves to {target})")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else None)
            if called in _IMPORT_CALLS and node.args:
                arg = node.args[0]
                if (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                        and _outside(arg.value)):
                    found.append(f"line {node.lineno}: {called}({arg.value!r})")
    return found


def _package_files() -> list[Path]:
    return sorted(p for p in PASSES_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_static_check_sees_every_file() -> None:
    names = {p.stem for p in _package_files()}
    assert {m.rsplit(".", 1)[1] for m in MODULES} <= names | {"__init__"}


@pytest.mark.parametrize("path", _package_files(), ids=lambda p: p.relative_to(PASSES_DIR)
                         .as_posix())
def test_no_pass_names_a_module_above_it(path: Path) -> None:
    found = upward_imports(path.read_text(), _package_of(path), str(path))
    assert not found, (f"{path.name} imports outside mbcompile.passes: {found}. A pass must "
                       "not import upward: move the type or op it needs into mbcompile.passes")


# The checker itself: what it must catch, and what it must let through.
_PKG = ["mbcompile", "passes"]


@pytest.mark.parametrize("source", [
    "import mbcompile.compiler",
    "import mbcompile",
    "import mbcompile.training.trainer as t",
    "from mbcompile.planning.cost import CostModel",
    "from mbcompile import compile",
    "from mbcompile.execution import runtime",
    "from .. import compiler",
    "from ..planning import plan",
    "from ...x import y",
    "from .. import passes",
    "def f():\n    from mbcompile.compiler import compile\n",
    "__import__('mbcompile.execution.distributed')",
    "import importlib\nimportlib.import_module('mbcompile.training.cli')",
    "from importlib import import_module\nimport_module('mbcompile.planning')",
])
def test_the_checker_catches_upward_imports(source: str) -> None:
    assert upward_imports(source, _PKG), source


@pytest.mark.parametrize("source", [
    "from . import ops",
    "from .facts import FACT",
    "from mbcompile.passes import ops",
    "from mbcompile.passes.facts import FACT",
    "import mbcompile.passes.ops",
    "from mbcompile import passes",
    "import torch\nimport importlib\nimportlib.import_module('torch.fx')",
    "msg = 'call mbcompile.compile(model, gbs)'",
])
def test_the_checker_lets_the_layer_through(source: str) -> None:
    assert upward_imports(source, _PKG) == []


def test_relative_imports_resolve_from_a_subpackage() -> None:
    """In ``passes/sub/x.py``, ``from .. import ops`` is still inside the passes."""
    assert upward_imports("from .. import ops", [*_PKG, "sub"]) == []
    assert upward_imports("from ... import compiler", [*_PKG, "sub"])


# --------------------------------------------------------------------------- #
# 3. ``import mbcompile`` is cheap, and every public name resolves
# --------------------------------------------------------------------------- #

#: reached as ``mbcompile.<module>.<name>``: the lazily loaded modules users spell out
DOTTED = [("distributed", "shard"), ("systems", "SystemSpec"), ("check", "compare_to_eager"),
          ("models", "make_mlp"), ("errors", "MixingError")]

_LAZY_PROBE = """
import json, sys
import mbcompile
loaded = sorted(m for m in sys.modules if m == "mbcompile" or m.startswith("mbcompile."))
torch_loaded = "torch" in sys.modules
failed = {}
for name in mbcompile.__all__:
    try:
        getattr(mbcompile, name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
for module, name in DOTTED:
    try:
        getattr(getattr(mbcompile, module), name)
    except Exception as exc:
        failed[f"{module}.{name}"] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"loaded": loaded, "torch": torch_loaded, "failed": failed}))
"""


@pytest.fixture(scope="module")
def lazy_probe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``import mbcompile``, then every public name, in one fresh interpreter (so no
    earlier import in this test session hides a circular import or a missing module)."""
    return _run_python(f"DOTTED = {DOTTED!r}\n" + _LAZY_PROBE, tmp_path_factory.mktemp("lazy"))


def test_import_mbcompile_loads_no_submodule(lazy_probe: dict) -> None:
    assert lazy_probe["loaded"] == ["mbcompile"], (
        f"import mbcompile loaded {lazy_probe['loaded']}; names must load on first use "
        "(PEP 562 __getattr__ in mbcompile/__init__.py)")
    assert not lazy_probe["torch"], "import mbcompile imported torch"


def test_every_public_name_resolves_in_a_fresh_interpreter(lazy_probe: dict) -> None:
    assert lazy_probe["failed"] == {}, lazy_probe["failed"]


@pytest.mark.parametrize("name", mbcompile.__all__)
def test_public_name_resolves(name: str) -> None:
    assert getattr(mbcompile, name) is not None
    assert name in dir(mbcompile)


@pytest.mark.parametrize(("module", "name"), DOTTED, ids=[f"{m}.{n}" for m, n in DOTTED])
def test_dotted_names_resolve(module: str, name: str) -> None:
    assert callable(getattr(getattr(mbcompile, module), name))
    assert module in dir(mbcompile)


def test_public_names_are_the_defining_objects() -> None:
    """The lazy names are the objects themselves, not copies or wrappers."""
    from mbcompile.passes import errors

    assert mbcompile.MixingError is errors.MixingError is mbcompile.errors.MixingError
    assert mbcompile.SystemSpec is mbcompile.systems.SystemSpec


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        mbcompile.no_such_name  # noqa: B018
    assert not hasattr(mbcompile, "passes_not_a_name")
