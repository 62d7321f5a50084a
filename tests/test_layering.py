"""The package is layered: no import cycles, nothing imports back up, and
``import mbcompile`` is cheap.

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

Above the passes, the import graph of every module of ``mbcompile/`` and ``passes/``
(section 4; every import statement counts, also one inside a function or under
``TYPE_CHECKING``: a lazy import is still a dependency, it only hides a cycle from
Python) has no cycle, neither between modules nor between the package's parts
(``compiler``, ``reports/``, ``execution/``, ...), and no module but the root imports
the package root (``import mbcompile``, ``from mbcompile import x``): the root
re-exports, so importing it from inside is importing upward.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
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
    assert {"capture", "shape_prop", "batch_analysis", "rules", "microbatch_rewrite",
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
    """Every module pkgutil finds (in subpackages too, ``passes/rules/``) is a file checked."""
    names = set()
    for p in _package_files():
        parts = p.relative_to(PASSES_DIR).with_suffix("").parts
        names.add(".".join([PASSES, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    assert set(MODULES) <= names, set(MODULES) - names


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
          ("models", "make_mlp"), ("errors", "MixingError"), ("buckets", "bucket_cap")]

_LAZY_PROBE = """
import importlib, json, sys
import mbcompile
loaded = sorted(m for m in sys.modules if m == "mbcompile" or m.startswith("mbcompile."))
torch_loaded = "torch" in sys.modules
failed = {}
for name in mbcompile.__all__:
    try:
        getattr(mbcompile, name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
for module, name in DOTTED:  # imported first: `import mbcompile.distributed`, `from ...`
    try:
        imported = importlib.import_module(f"mbcompile.{module}")
        exec(f"from mbcompile.{module} import {name}")
        if getattr(mbcompile, module) is not imported:
            failed[f"import mbcompile.{module}"] = "another module than the attribute"
    except Exception as exc:
        failed[f"import mbcompile.{module}"] = f"{type(exc).__name__}: {exc}"
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


def test_compiling_a_plain_model_imports_no_transformers(tmp_path: Path) -> None:
    """transformers is an optional library that takes seconds to import: a compile of a
    model that is not one of its ``PreTrainedModel``s (so transformers is not imported
    yet) never imports it, e.g. to look for its output-capturing hooks."""
    got = _run_python(
        "import json, sys\nimport mbcompile\nfrom mbcompile.models import make_tiny_gpt\n"
        "model, (ids, labels) = make_tiny_gpt(4)\n"
        "mbcompile.compile(model, 4, 1, 2, example_inputs=(ids, labels))\n"
        "print(json.dumps({'transformers': 'transformers' in sys.modules}))", tmp_path)
    assert got == {"transformers": False}


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


def test_module_spellings_are_the_modules_themselves() -> None:
    """``import mbcompile.buckets`` is ``mbcompile.planning.buckets`` itself, not a copy
    of its names: a bucket size set through it is the one the plan and the run read."""
    import mbcompile.buckets
    import mbcompile.distributed
    from mbcompile.distributed import shard
    from mbcompile.execution import distributed
    from mbcompile.planning import buckets

    assert mbcompile.buckets is buckets and mbcompile.distributed is distributed
    assert shard is distributed.shard
    before = buckets.MIN_BUCKETS
    try:
        mbcompile.buckets.MIN_BUCKETS = before + 1
        assert buckets.MIN_BUCKETS == before + 1
    finally:
        mbcompile.buckets.MIN_BUCKETS = before


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        mbcompile.no_such_name  # noqa: B018
    assert not hasattr(mbcompile, "passes_not_a_name")


# --------------------------------------------------------------------------- #
# 4. The import graph of the whole package: no cycles, no import of the root
# --------------------------------------------------------------------------- #

ROOT = "mbcompile"
ROOT_DIR = Path(mbcompile.__file__).resolve().parent

#: Imports that still break the rules, each waiting for a change in its owner's file
#: (importer, imported) -> what ends it. The checks below ignore these edges, and an entry
#: whose import is gone fails ``test_the_allow_list_holds_only_live_imports``: delete it
#: then. Nothing may be added here without an owner and a plan to remove it.
ALLOWED: dict[tuple[str, str], str] = {
}


def _module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name: ``mbcompile/`` (without a ``passes/``
    inside it, where an installed wheel has one) and the passes, as installed."""
    found: dict[str, Path] = {}
    for base, top, skip in ((ROOT_DIR, [ROOT], PASSES_DIR), (PASSES_DIR, [ROOT, "passes"], None)):
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" in path.parts or (skip is not None and path.is_relative_to(skip)):
                continue
            parts = [*top, *path.relative_to(base).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULE_FILES = _module_files()


def import_edges(source: str, module: str, is_package: bool, modules: set[str] | frozenset[str],
                 filename: str = "<source>") -> list[tuple[str, int, str]]:
    """The ``mbcompile`` modules that ``source`` (module ``module``) imports, as
    ``(imported, line, statement)``: every ``import``/``from ... import`` wherever it sits
    (a function body, ``if TYPE_CHECKING:``), relative ones resolved, and
    ``importlib.import_module``/``__import__`` of a constant name.

    An import names the deepest module of ``modules`` it reaches: ``from mbcompile.passes
    import ops`` imports ``mbcompile.passes.ops``, ``from mbcompile import compile`` the
    root ``mbcompile`` (``compile`` is a name the root re-exports, not a module).
    """
    package = module.split(".") if is_package else module.split(".")[:-1]

    def deepest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: list[tuple[str, int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]
                            if node.level else [node.module or ""]).strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else (
                func.attr if isinstance(func, ast.Attribute) else None)
            arg = node.args[0]
            if (called in _IMPORT_CALLS and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)):
                names = [arg.value]
        targets = {deepest(n) for n in names if n == ROOT or n.startswith(ROOT + ".")}
        found += [(t, node.lineno, ast.unparse(node).split("\n")[0])
                  for t in sorted(targets - {None, module})]
    return found


def _graph() -> nx.DiGraph:
    """The import graph: an edge ``a -> b`` for each module ``a`` that imports ``b``, with
    the lines that do (``where``)."""
    g = nx.DiGraph()
    g.add_nodes_from(MODULE_FILES)
    modules = frozenset(MODULE_FILES)
    for module, path in MODULE_FILES.items():
        for target, line, code in import_edges(path.read_text(), module,
                                               path.name == "__init__.py", modules, str(path)):
            if not g.has_edge(module, target):
                g.add_edge(module, target, where=[])
            g[module][target]["where"].append(f"{path.name}:{line}: {code}")
    return g


@pytest.fixture(scope="module")
def graph() -> nx.DiGraph:
    return _graph()


@pytest.fixture(scope="module")
def checked(graph: nx.DiGraph) -> nx.DiGraph:
    """The graph without the allow-listed edges."""
    g = graph.copy()
    g.remove_edges_from(ALLOWED)
    return g


def _explain(g: nx.DiGraph, cycle: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b}: {'; '.join(g[a][b].get('where', []))}" for a, b in cycle)


def _cycles(g: nx.DiGraph) -> str:
    """Each cycle of ``g`` (up to 20), with the import lines that close it."""
    cycles = [list(zip(c, c[1:] + c[:1])) for c in nx.simple_cycles(g, length_bound=6)]
    return "\n".join(_explain(g, c) + "\n" for c in cycles[:20])


def test_the_graph_sees_every_module(graph: nx.DiGraph) -> None:
    assert set(MODULES) <= set(graph), set(MODULES) - set(graph)  # the passes, as installed
    assert {ROOT, "mbcompile.compiler", "mbcompile.execution.runtime",
            "mbcompile.execution.distributed", "mbcompile.reports.draw",
            "mbcompile.training.trainer", "mbcompile.planning.plan", PASSES} <= set(graph)
    # a top-level import, a lazy one (in a function) and a relative one are all edges
    assert graph.has_edge("mbcompile.lowering", "mbcompile.passes.capture")
    assert graph.has_edge("mbcompile.execution.runtime", "mbcompile.execution.distributed")
    assert graph.has_edge("mbcompile.passes.capture", "mbcompile.passes.forward_modes")


def test_the_compiled_module_never_reaches_the_compiler(graph: nx.DiGraph) -> None:
    """torch.compile's split (STYLE.md): the compiler makes an artifact, the wrapper only
    calls it; what the module compiles later goes through a chain it is handed."""
    assert graph.has_edge("mbcompile.compiler", "mbcompile.compiled_module")
    assert "mbcompile.compiler" not in nx.descendants(graph, "mbcompile.compiled_module")


def test_no_import_cycles(checked: nx.DiGraph) -> None:
    assert nx.is_directed_acyclic_graph(checked), (
        "import cycles (a -> b: a imports b, at these lines):\n" + _cycles(checked)
        + "Move what both need into a module below both, or pass it in.")


def _part(module: str) -> str:
    """The part of the package a module belongs to: ``mbcompile.reports.draw`` ->
    ``mbcompile.reports``; a top-level module (``mbcompile.compiler``) is its own part."""
    return ".".join(module.split(".")[:2])


def test_no_cycles_between_the_parts(checked: nx.DiGraph) -> None:
    """``compiler``, ``reports/``, ``execution/``, ``planning/``, ``training/``, the passes:
    if reports/ imports the compiler, the compiler must not import reports/."""
    parts = nx.DiGraph()
    for a, b, data in checked.edges(data=True):
        if ROOT not in (a, b) and _part(a) != _part(b):
            parts.add_edge(_part(a), _part(b))
            parts[_part(a)][_part(b)].setdefault("where", []).extend(
                f"{a} -> {b} ({w})" for w in data["where"])
    assert nx.is_directed_acyclic_graph(parts), (
        "cycles between the package's parts:\n" + _cycles(parts))


def test_no_module_imports_the_package_root(checked: nx.DiGraph) -> None:
    """The root re-exports everything (lazily): a module inside that imports it imports
    upward; it imports the module that defines the name instead (the version: from
    ``mbcompile.version``)."""
    found = {a: checked[a][ROOT]["where"] for a in checked.predecessors(ROOT)}
    assert not found, f"imports of the package root from inside it: {found}"


def test_the_passes_import_nothing_above_them(checked: nx.DiGraph) -> None:
    """The graph's form of section 2 (which also catches imports that climb above)."""
    inside = {m for m in checked if _inside_passes(m)}
    found = {f"{a} -> {b}": checked[a][b]["where"] for a in inside
             for b in checked.successors(a) if b not in inside}
    assert not found, found


def test_the_allow_list_holds_only_live_imports(graph: nx.DiGraph) -> None:
    """An allow-listed import that is gone leaves its entry behind: delete the entry."""
    stale = [edge for edge in ALLOWED if not graph.has_edge(*edge)]
    assert not stale, f"these imports are gone; delete their entries from ALLOWED: {stale}"


def test_the_version_is_one_number() -> None:
    """Read inside the package from ``mbcompile.version``; the root and the installed
    distribution (pyproject.toml's ``version``) say the same."""
    from importlib.metadata import version

    from mbcompile.version import __version__

    assert mbcompile.__version__ == __version__ == version("mbcompile")


# The graph's reader itself: what it must see.
_MODS = frozenset({ROOT, "mbcompile.compiler", "mbcompile.execution", "mbcompile.execution.runtime",
                   "mbcompile.execution.distributed", "mbcompile.passes", "mbcompile.passes.ops"})


@pytest.mark.parametrize(("source", "imported"), [
    ("import mbcompile", ROOT),
    ("from mbcompile import __version__", ROOT),
    ("from mbcompile import compile", ROOT),
    ("from mbcompile import passes", "mbcompile.passes"),
    ("from mbcompile.passes import ops", "mbcompile.passes.ops"),
    ("import mbcompile.execution.runtime as r", "mbcompile.execution.runtime"),
    ("from mbcompile.execution import StepChannels", "mbcompile.execution"),
    ("from . import runtime", "mbcompile.execution.runtime"),
    ("from .runtime import read_host", "mbcompile.execution.runtime"),
    ("from .. import compiler", "mbcompile.compiler"),
    ("from .. import compile", ROOT),
    ("def f():\n    from mbcompile.execution import runtime\n", "mbcompile.execution.runtime"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mbcompile import compiler\n",
     "mbcompile.compiler"),
    ("import importlib\nimportlib.import_module('mbcompile.compiler')", "mbcompile.compiler"),
    ("__import__('mbcompile.execution.runtime')", "mbcompile.execution.runtime"),
])
def test_the_graph_reader_sees_every_import(source: str, imported: str) -> None:
    edges = import_edges(source, "mbcompile.execution.distributed", False, _MODS)
    assert [e[0] for e in edges] == [imported], edges


@pytest.mark.parametrize("source", [
    "import torch\nfrom torch import fx",
    "msg = 'from mbcompile import compile'",
    "from mbcompile.execution.distributed import shard",  # the module itself
    "import importlib\nimportlib.import_module(name)",  # not a constant: not a static edge
])
def test_the_graph_reader_ignores_the_rest(source: str) -> None:
    assert import_edges(source, "mbcompile.execution.distributed", False, _MODS) == []


def test_a_package_resolves_relative_imports_from_itself() -> None:
    """In ``mbcompile/execution/__init__.py``, ``from . import runtime`` is its own child."""
    edges = import_edges("from . import runtime", "mbcompile.execution", True, _MODS)
    assert [e[0] for e in edges] == ["mbcompile.execution.runtime"]


def test_the_cycle_check_fails_on_a_cycle() -> None:
    """Today's cycles had this shape: runtime imports distributed in a function, and
    distributed imports runtime at the top."""
    g = nx.DiGraph()
    for module, source in (("mbcompile.execution.runtime",
                            "def f():\n    from mbcompile.execution import distributed\n"),
                           ("mbcompile.execution.distributed",
                            "from mbcompile.execution import runtime\n")):
        for target, line, code in import_edges(source, module, False, _MODS):
            g.add_edge(module, target, where=[f"{line}: {code}"])
    assert not nx.is_directed_acyclic_graph(g)
    assert "runtime -> mbcompile.execution.distributed" in _cycles(g)


def test_importing_the_cli_does_not_import_dynamo() -> None:
    """Every ``mbcompile`` command, forkserver and rank imports mbcompile: torch._dynamo
    costs about 1 s of that, and is imported only when something compiles with it."""
    probe = "import sys, mbcompile.training.cli.main; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_the_constant_mark_is_what_dynamo_sets() -> None:
    """passes/partials.py marks ``_layout`` as dynamo's ``assume_constant_result`` does, by
    the attribute it sets (importing dynamo to decorate costs every process 1 s)."""
    import torch._dynamo

    from mbcompile.passes import partials

    def f() -> None:
        pass

    before = set(vars(f))
    torch._dynamo.assume_constant_result(f)
    assert {k: v for k, v in vars(f).items() if k not in before} == \
        {"_dynamo_marked_constant": True}
    assert partials._layout._dynamo_marked_constant is True
