"""Located checks of YAML values: each failure names the file, the line and the key.

``Checks`` holds the checks every section of the schema (``schema``) is built
from: mappings with their allowed and required keys ("did you mean", from difflib),
ints, booleans, strings, choices, keyword arguments, import paths (imported now) and
keyword arguments checked against a user callable's signature. The callables it
inspects are the user's (a model class, a data factory, an optimizer), never mbcompile's.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from mbcompile.training.config.loader import ConfigError, Marks, Path_, dotted
from mbcompile.training.flags import suggest

__all__ = ["Checks", "import_object", "optimizer_classes", "signature_names", "suggest_from",
           "type_name"]


def suggest_from(word: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing."""
    return suggest(str(word), list(choices))


def type_name(value: Any) -> str:
    """A value's type as YAML calls it (mapping, list, string, boolean, null)."""
    return "null" if value is None else {dict: "mapping", list: "list", str: "string",
                                         bool: "boolean"}.get(type(value), type(value).__name__)


def import_object(spec: str) -> Any:
    """``package.module:attr.sub`` -> the object; ``ImportError``/``AttributeError`` if missing."""
    module_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def signature_names(fn: Any) -> tuple[str, ...]:
    """The named parameters of the user's callable ``fn`` (none if it has no signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """``torch.optim``'s optimizers by class name (what ``optimizer: {name: ...}`` takes)."""
    return {name: obj for name, obj in vars(torch.optim).items()
            if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
            and obj is not torch.optim.Optimizer}


def _add_import_dirs(file: str) -> None:
    # `python -m mbcompile` puts the current directory on sys.path, the console script
    # does not; make both find `package.module:Class` next to the user and the config.
    for folder in (os.getcwd(), os.path.dirname(os.path.abspath(file))):
        if folder not in sys.path:
            sys.path.insert(0, folder)



class Checks:
    """Located checks of the values of one YAML file (its lines in ``marks``)."""

    def __init__(self, marks: Marks) -> None:
        self.m = marks
        self.flag_paths: dict[str, list[Path_]] = {}  # short key -> where it is set

    def fail(self, path: Path_, message: str, *, key: bool = False,
             label: Path_ | None = None) -> ConfigError:
        return ConfigError(message, file=self.m.file, line=self.m.line(path, key=key),
                           key=dotted(path if label is None else label) or None)

    # --------------------------------------------------------------- scalars
    def mapping(self, path: Path_, value: Any, allowed: Mapping[str, str] | Sequence[str],
                required: Sequence[str] = (), what: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            where = "the file" if not path else "this section"
            raise self.fail(path, f"{where} must be a mapping{what}, got {type_name(value)} "
                            f"{value!r}")
        for k in value:
            if k not in allowed:
                raise self.fail(path + (k,), f"unknown key {k!r}{suggest_from(k, allowed)}; the "
                                f"allowed keys are {', '.join(allowed)}", key=True, label=path)
        for k in required:
            if k not in value:
                hint = f" ({allowed[k]})" if isinstance(allowed, Mapping) else ""
                raise self.fail(path, f"missing required key {k!r}{hint}", key=True)
        return value

    def integer(self, path: Path_, value: Any, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be an int, got {type_name(value)} {value!r}")
        if minimum is not None and value < minimum:
            raise self.fail(path, f"must be at least {minimum}, got {value}")
        return value

    def optional_integer(self, path: Path_, value: Any, minimum: int) -> int | None:
        return None if value is None else self.integer(path, value, minimum)

    def boolean(self, path: Path_, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(path, f"must be true or false, got {type_name(value)} {value!r}")
        return value

    def string(self, path: Path_, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(path, f"must be a non-empty string, got {type_name(value)} "
                            f"{value!r}")
        return value

    def choice(self, path: Path_, value: Any, choices: Sequence[str]) -> str:
        value = self.string(path, value)
        if value not in choices:
            raise self.fail(path, f"unknown value {value!r}{suggest_from(value, choices)}; choose "
                            f"one of {', '.join(choices)}")
        return value

    def kwargs(self, path: Path_, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping of keyword arguments, got "
                            f"{type_name(value)} {value!r}")
        for k in value:
            if not isinstance(k, str) or not k.isidentifier():
                raise self.fail(path + (k,), f"{k!r} is not a valid argument name", key=True)
        return dict(value)

    def importable(self, path: Path_, spec: str, what: str) -> Any:
        if not _IMPORT_PATH.match(spec):
            raise self.fail(path, f"{spec!r} is not an import path; write it as "
                            f"package.module:{what}")
        _add_import_dirs(self.m.file)
        try:
            return import_object(spec)
        except ImportError as exc:
            raise self.fail(path, f"cannot import {spec!r}: {type(exc).__name__}: {exc}; the "
                            "current directory and the config's directory are on the import "
                            "path, check the module name") from None
        except AttributeError:
            module, _, attr = spec.partition(":")
            raise self.fail(path, f"module {module!r} has no {attr!r}") from None

    def signature_kwargs(self, path: Path_, fn: Any, kwargs: Mapping[str, Any],
                         provided: Sequence[str] = ()) -> None:
        """Check ``kwargs`` against ``fn``'s parameters: unknown names and missing ones."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return
        names = [p.name for p in params.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for k in kwargs:
            if k in provided:
                raise self.fail(path + (k,), f"{k!r} is set by mbcompile itself; remove it",
                                key=True)
            if k not in names and not takes_any:
                listed = ", ".join(n for n in names if n not in provided) or "none"
                raise self.fail(path + (k,), f"{name} has no argument {k!r}"
                                f"{suggest_from(k, names)}; its arguments are: {listed}", key=True)
        missing = [p.name for p in params.values()
                   if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.default is p.empty and p.name not in kwargs and p.name not in provided]
        if missing:
            raise self.fail(path, f"{name} needs the argument(s) {', '.join(missing)}; add them "
                            f"under {dotted(path)}")
