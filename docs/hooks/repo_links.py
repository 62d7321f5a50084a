"""MkDocs hook: the code paths the pages name, and the README's links, must exist.

MkDocs checks the links between pages (``validation`` in mkdocs.yml). Two kinds of
reference are outside its reach, and both go stale when code moves:

- a page names a file or folder of the repository as inline code
  (`` `passes/capture.py` ``), not as a link, since the site holds only docs/;
- README.md, which the site does not build, links into docs/ (``docs/api.md#mbs``).

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
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")

_anchors: dict[str, set[str]] = {}  # docs page (relative to docs/) -> its heading ids


def _root(config: Any) -> Path:
    return Path(config.config_file_path).parent


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    root = _root(config)
    for span in _INLINE.findall(_FENCE.sub("", markdown)):
        if _PATH.fullmatch(span) and not (root / span).exists():
            log.warning(f"{page.file.src_uri}: names `{span}`, which is not in the repository")
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
    readme = root / "README.md"
    for target in _LINK.findall(readme.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        if not (root / path).exists():
            log.warning(f"README.md links to {target}, which is not in the repository")
        elif anchor and path.startswith("docs/") and path.endswith(".md"):
            if anchor not in _anchors.get(path.removeprefix("docs/"), set()):
                log.warning(f"README.md links to {target}, but that page has no such heading")
