"""Reading a YAML config with the line of every key and value, for located errors.

``load_yaml(text, file)`` composes the YAML into nodes (yaml's ``compose`` keeps each
node's line), builds the Python values from them, and records the line of every key
and value by its path (``("model", "kwargs", "width")``) in a ``Marks``; a problem is
a ``ConfigError("tiny_gpt.yaml:7: model.kwargs: ...")``. ``1e-3`` is a float here
(YAML 1.2), not the string YAML 1.1 makes of it; a key written twice is an error.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from mbcompile.errors import MbcompileError

__all__ = ["ConfigError", "Marks", "Path_", "dotted", "load_yaml"]

Path_ = tuple[Any, ...]  # a key path into the document: ("callbacks", 0, "GlobalFlags")


class ConfigError(MbcompileError, ValueError):
    """A configuration problem, located: ``file:line: key: what is wrong and how to fix it``."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        where = f"{file}:{line}: " if file and line else f"{file}: " if file else ""
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{message}")
        self.file, self.line, self.key = file, line, key



class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-3`` as a float, as YAML 1.2 does (1.1 makes it a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass(frozen=True)
class Marks:
    """Where each key and value of one YAML file is (1-based lines)."""

    file: str
    keys: Mapping[Path_, int]
    values: Mapping[Path_, int]

    def line(self, path: Path_, *, key: bool = False) -> int:
        table = (self.keys, self.values) if key else (self.values, self.keys)
        p = tuple(path)
        while True:
            for t in table:
                if p in t:
                    return t[p]
            if not p:
                return 1
            p = p[:-1]

    def error(self, path: Path_, message: str, *, key: bool = False) -> ConfigError:
        return ConfigError(message, file=self.file, line=self.line(path, key=key),
                           key=dotted(path) or None)


def _construct(node: Node, path: Path_, ctor: SafeConstructor, keys: dict[Path_, int],
               values: dict[Path_, int], file: str) -> Any:
    values.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, MappingNode):
        merged = any(k.tag == "tag:yaml.org,2002:merge" for k, _ in node.value)
        ctor.flatten_mapping(node)  # resolves merge keys (<<: *anchor); later keys override
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode):
                raise ConfigError("mapping keys must be plain scalars", file=file,
                                  line=key_node.start_mark.line + 1, key=dotted(path) or None)
            key = ctor.construct_object(key_node, deep=True)
            if key in out and not merged:
                raise ConfigError(
                    f"key {key!r} appears twice (first at line {keys[path + (key,)]}); "
                    "YAML would silently keep the last one: remove one of them",
                    file=file, line=key_node.start_mark.line + 1, key=dotted(path) or None)
            keys[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _construct(value_node, path + (key,), ctor, keys, values, file)
        return out
    if isinstance(node, SequenceNode):
        return [_construct(item, path + (i,), ctor, keys, values, file)
                for i, item in enumerate(node.value)]
    return ctor.construct_object(node, deep=True)


def load_yaml(text: str, file: str) -> tuple[Any, Marks]:
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(f"not valid YAML: {exc.problem or exc.context}", file=file,
                          line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=file) from None
    finally:
        loader.dispose()
    if node is None:
        raise ConfigError("the file is empty; it needs at least 'model' and 'batch_size'",
                          file=file, line=1)
    keys: dict[Path_, int] = {}
    values: dict[Path_, int] = {}
    try:
        data = _construct(node, (), SafeConstructor(), keys, values, file)
    except ConstructorError as exc:
        mark = exc.problem_mark
        raise ConfigError(f"cannot read this value: {exc.problem}", file=file,
                          line=mark.line + 1 if mark else None) from None
    return data, Marks(file, keys, values)
