"""Flags, and the callbacks that set them: GlobalFlags, ScopedTrainFlags, ScopedValidateFlags.

Cerebras' Trainer configures microbatching through these three callbacks, with flag
keys that are paths such as ``csx.performance.micro_batch_size``; mbcompile takes
the same callbacks and keys, and the short key ``micro_batch_size`` too:

>>> GlobalFlags(micro_batch_size="auto").flags
{'micro_batch_size': 'auto'}
>>> ScopedTrainFlags(**{"csx.performance.micro_batch_size": 4}).flags
{'micro_batch_size': 4}

How a value is found, walked through one ``Trainer.fit`` with validation inside it
(``GlobalFlags(micro_batch_size=2)``, ``ScopedTrainFlags(micro_batch_size=4)``,
``ScopedValidateFlags(micro_batch_size=8)``):

1. construction: the global layer holds ``2``; outside any phase MBS is 2;
2. ``fit`` opens the train scope (a fresh layer on a stack): MBS is 4;
3. validation inside ``fit`` opens its own scope on top: MBS is 8. A scope does not
   inherit from the scope below it, so train-only flags never leak into validation;
4. each scope is popped in a ``finally``: back to 4, then to 2, also when the
   phase raises.

The state lives in a ``Flags`` object owned by the trainer, never in a module global,
so two trainers in one process do not see each other's flags.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mbcompile.errors import MbcompileError
from mbcompile.planning.plan import parse_mbs

__all__ = [
    "FLAGS",
    "Callback",
    "FlagError",
    "FlagSpec",
    "Flags",
    "GlobalFlags",
    "ScopedTrainFlags",
    "ScopedValidateFlags",
    "normalize_flags",
    "resolve_key",
    "suggest",
]


class FlagError(MbcompileError, ValueError):
    """An unknown flag key, or a flag value of the wrong kind."""


def _check_mbs(value: Any) -> Any:
    parse_mbs(value)  # raises PlanError / ArgumentTypeError with the accepted forms
    return value


@dataclass(frozen=True)
class FlagSpec:
    """One flag: its short key, its Cerebras-style path, default, checker and meaning."""

    key: str
    path: str
    default: Any
    check: Callable[[Any], Any]
    help: str


#: Every flag, by short key. Add a row here to add a flag; both spellings follow.
FLAGS: dict[str, FlagSpec] = {
    spec.key: spec for spec in (
        FlagSpec("micro_batch_size", "csx.performance.micro_batch_size", "auto", _check_mbs,
                 "the MBS: an int, 'auto', 'explore', 'none', {'explore': {'min', 'max'}} "
                 "or {'tokens': n}"),
    )
}
_BY_PATH = {spec.path: spec.key for spec in FLAGS.values()}


def _flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    # YAML users may nest the path (csx: {performance: {micro_batch_size: 4}}).
    for key, value in values.items():
        if not isinstance(key, str):
            raise FlagError(f"flag keys must be strings, got {key!r}")
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and full not in FLAGS and full not in _BY_PATH \
                and any(p.startswith(full + ".") for p in _BY_PATH):
            yield from _flatten(value, full + ".")
        else:
            yield full, value


def suggest(word: str, choices: list[str] | tuple[str, ...] | set[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    by_case = [c for c in choices if c.lower() == word.lower()]  # Adamw -> AdamW
    close = by_case or difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def resolve_key(key: str) -> str:
    """The short key of a flag given by short key or path; ``FlagError`` if unknown."""
    if key in FLAGS:
        return key
    if key in _BY_PATH:
        return _BY_PATH[key]
    known = sorted(FLAGS) + sorted(_BY_PATH)
    raise FlagError(f"unknown flag {key!r}{suggest(key, known)}; known flags: "
                    + ", ".join(f"{s.key} (or {s.path})" for s in FLAGS.values()))


def normalize_flags(values: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``values`` and key them by short key.

    >>> normalize_flags({"csx.performance.micro_batch_size": 4})
    {'micro_batch_size': 4}
    """
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in _flatten(values):
        short = resolve_key(key)
        if short in out and out[short] != value:
            raise FlagError(f"flag {short!r} is given twice with different values: "
                            f"{spelled[short]}={out[short]!r} and {key}={value!r}; keep one")
        try:
            FLAGS[short].check(value)
        except MbcompileError as exc:
            raise FlagError(f"flag {key}: {exc}") from None
        out[short], spelled[short] = value, key
    return out


class Flags:
    """The flag values a trainer sees: defaults < global layer < the current scope.

    >>> flags = Flags()
    >>> flags.set_global({"micro_batch_size": 2})
    >>> with flags.scope({"micro_batch_size": 4}):
    ...     flags["micro_batch_size"]
    4
    >>> flags["micro_batch_size"]
    2
    """

    def __init__(self) -> None:
        self._global: dict[str, Any] = {}
        self._scopes: list[dict[str, Any]] = []

    def __getitem__(self, key: str) -> Any:
        short = resolve_key(key)
        if self._scopes and short in self._scopes[-1]:
            return self._scopes[-1][short]
        return self._global.get(short, FLAGS[short].default)

    @property
    def micro_batch_size(self) -> Any:
        return self["micro_batch_size"]

    def snapshot(self) -> dict[str, Any]:
        """Every flag's current value, by short key."""
        return {key: self[key] for key in FLAGS}

    def set_global(self, values: Mapping[str, Any]) -> None:
        self._global.update(normalize_flags(values))

    def update_scope(self, values: Mapping[str, Any]) -> None:
        """Set ``values`` in the innermost open scope (they vanish when it closes)."""
        if not self._scopes:
            raise FlagError("scoped flags need an open phase (train or validate); "
                            "use GlobalFlags for flags that hold everywhere")
        self._scopes[-1].update(normalize_flags(values))

    @contextmanager
    def scope(self, values: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        """Open a scope that starts from the global layer; closed also on an exception."""
        self._scopes.append(normalize_flags(values or {}))
        depth = len(self._scopes)
        try:
            yield self._scopes[-1]
        finally:
            del self._scopes[depth - 1:]  # also drops scopes a failing callback left open

    @property
    def depth(self) -> int:
        """How many scopes are open (0 outside every phase)."""
        return len(self._scopes)

    def __repr__(self) -> str:
        return f"Flags({self.snapshot()!r}, scopes={len(self._scopes)})"


# --------------------------------------------------------------------------- #
# Callbacks
# --------------------------------------------------------------------------- #


class Callback:
    """Base class of trainer callbacks; every hook does nothing by default.

    The trainer calls ``setup`` once when it is built, ``on_*_start`` when a phase
    begins (inside its flag scope) and ``on_*_end`` when it ends, also when it
    raises; ``on_*_step_end`` after each step with the logged row.
    """

    def setup(self, trainer: Any) -> None: ...
    def on_fit_start(self, trainer: Any) -> None: ...
    def on_fit_end(self, trainer: Any) -> None: ...
    def on_train_start(self, trainer: Any) -> None: ...
    def on_train_end(self, trainer: Any) -> None: ...
    def on_validate_start(self, trainer: Any) -> None: ...
    def on_validate_end(self, trainer: Any) -> None: ...
    def on_train_step_end(self, trainer: Any, row: Mapping[str, Any]) -> None: ...
    def on_validate_step_end(self, trainer: Any, row: Mapping[str, Any]) -> None: ...


class _FlagsCallback(Callback):
    def __init__(self, flags: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        values = dict(flags or {})
        values.update(kwargs)
        self.flags: dict[str, Any] = normalize_flags(values)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.flags.items())
        return f"{type(self).__name__}({args})"


class GlobalFlags(_FlagsCallback):
    """Flags for every phase: ``GlobalFlags(micro_batch_size=4)``."""

    def setup(self, trainer: Any) -> None:
        trainer.flags.set_global(self.flags)


class ScopedTrainFlags(_FlagsCallback):
    """Flags only while training; the values before are back when training ends."""

    def on_train_start(self, trainer: Any) -> None:
        trainer.flags.update_scope(self.flags)


class ScopedValidateFlags(_FlagsCallback):
    """Flags only while validating; the values before are back when validation ends."""

    def on_validate_start(self, trainer: Any) -> None:
        trainer.flags.update_scope(self.flags)
