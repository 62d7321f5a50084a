"""MkDocs hook: the code the pages name, and the README's links, must exist.

MkDocs checks the links between pages (``validation`` in mkdocs.yml). Three kinds of
reference are outside its reach, and all go stale when code moves:

- a page names a file or folder of the repository as inline code
  (`` `passes/capture.py` ``), not as a link, since the site holds only docs/;
- a page names a Python name as inline code (`` `mbcompile.distributed.shard` ``); it
  is looked up in the source text, without importing torch, so the build stays fast;
- README.md, which the site does not build, links into docs/ (``docs/api.md#mbs``)
  and names code as the pages do.

Each one that does not resolve is a warning, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(f"mkdocs.plugins.{__name__}")

# inline code that names a path under one of the repository's top-level folders
_PATH = re.compile(r"(?:passes|mbcompile|tests|benchmarks|examples|docs)(?:/[\w.-]+)*/?")
# a dotted name under mbcompile (not a string such as "mbcompile.fact"), and what a
# "from mbcompile.x import y" span imports
_NAME = re.compile(r"(?<![\"'\w.])(mbcompile(?:\.\w+)+)(?: import (\w+))?")
_IMPORT = re.compile(r"^from ([\w.]+) import (\([^)]*\)|[^\n]*)", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")

_anchors: dict[str, set[str]] = {}  # docs page (relative to docs/) -> its heading ids


def _root(config: Any) -> Path:
    return Path(config.config_file_path).parent


def _module_file(root: Path, module: str) -> Path | None:
    """The source file of ``module``; ``mbcompile.passes`` is the top-level passes/. A
    module that puts another in its own place (``sys.modules[__name__] = distributed``:
    ``mbcompile/distributed.py``) is that other module's file."""
    parts = module.split(".")
    if parts[:2] == ["mbcompile", "passes"]:
        parts = ["passes", *parts[2:]]
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            alias = _ALIAS.search(path.read_text())
            if alias:
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                name = alias.group(1)
                target = _defines(path.read_text(), package, name)  # from x import name
                if target:
                    return _module_file(root, f"{target}.{name}") or _module_file(root, target)
                return path
            return path
    return None


_ALIAS = re.compile(r"^sys\.modules\[__name__\]\s*=\s*(\w+)", re.M)


def _defines(source: str, package: str, name: str) -> str | None:
    """Where a module (its ``source``, in ``package``) defines ``name``: "" for its own
    def, class or assignment, the module it imports the name from or that a lazy
    ``__init__`` table maps it to, or None when it has no such name."""
    if re.search(rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*[:=]", source, re.M):
        return ""
    lazy = re.search(rf'"{name}": "([\w.]+)"', source)  # mbcompile/__init__.py's tables
    if lazy:
        return lazy.group(1)
    for target, names in re.findall(r'\{name: "([\w.]+)" for name in \(([^)]*)\)', source):
        if f'"{name}"' in names:
            return target
    for target, names in _IMPORT.findall(source):
        if name in re.findall(r"\w+", names.split("#")[0]):
            dots = len(target) - len(target.lstrip("."))
            if dots:  # relative: from this module's package, or one above it
                base = package.split(".")[: len(package.split(".")) - dots + 1]
                target = ".".join([*base, target.lstrip(".")]).rstrip(".")
            return target
    return None


def _resolves(root: Path, dotted: str) -> bool:
    """Whether ``mbcompile.a.b`` is a module, or a name that a module defines (what
    follows a defined name, an attribute of it, is not looked at)."""
    parts = dotted.split(".")
    module, i = parts[0], 1
    for _ in range(2 * len(parts)):  # a re-exported name is looked up again where it lives
        if i == len(parts):
            break
        name = parts[i]
        if _module_file(root, f"{module}.{name}"):
            module, i = f"{module}.{name}", i + 1
            continue
        file = _module_file(root, module)
        if file is None:
            return False
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        found = _defines(file.read_text(), package, name)
        if found is None:
            return False
        if not found:
            return True
        # a module alias (mbcompile.distributed), or the module that defines the name
        module, i = (found, i + 1) if found.rsplit(".", 1)[-1] == name else (found, i)
    return _module_file(root, module) is not None


def _check_code(text: str, where: str, root: Path) -> None:
    """Warn about each path or mbcompile name in ``text``'s inline code that is gone."""
    for span in _INLINE.findall(_FENCE.sub("", text)):
        if _PATH.fullmatch(span) and not (root / span).exists():
            log.warning(f"{where}: names `{span}`, which is not in the repository")
        for dotted, imported in _NAME.findall(span):
            name = f"{dotted}.{imported}" if imported else dotted
            if not _resolves(root, name):
                log.warning(f"{where}: names `{name}`, which mbcompile does not define")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    _check_code(markdown, page.file.src_uri, _root(config))
    return markdown


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    ids: set[str] = set()
    stack = list(page.toc)
    while stack:
        item = stack.pop()
        ids.add(item.id)
        stack.extend(item.children)
    _anchors[page.file.src_uri] = ids
    return html


def on_post_build(config: Any) -> None:
    root = _root(config)
    readme = (root / "README.md").read_text()
    _check_code(readme, "README.md", root)
    for target in _LINK.findall(readme):
        if "://" in target or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        if not (root / path).exists():
            log.warning(f"README.md links to {target}, which is not in the repository")
        elif anchor and path.startswith("docs/") and path.endswith(".md"):
            if anchor not in _anchors.get(path.removeprefix("docs/"), set()):
                log.warning(f"README.md links to {target}, but that page has no such heading")
