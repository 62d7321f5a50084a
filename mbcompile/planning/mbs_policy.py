"""The MBS policy: the user's ``mbs`` argument, parsed once into an ``MbsPolicy``.

>>> parse_mbs(8)
MbsPolicy(mode='int', value=8, explore_min=None, explore_max=None)
>>> parse_mbs("auto").at_most(4).mode
'auto'

Pure Python, like the plan arithmetic (``plan.py``) that reads it: ``make_request``
parses ``mbs`` once and every later stage is handed the policy, never the raw value.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mbcompile.passes.errors import ArgumentTypeError, PlanError

__all__ = ["MbsPolicy", "check_int", "is_int", "parse_mbs"]

_MODES = ("auto", "explore", "none")
_EXPLORE_FORM = "{'explore': {'min': a, 'max': b}} (both optional ints >= 1, a <= b)"


def is_int(value: object) -> bool:
    # bool is an int subclass, but ``gbs=True`` is always a mistake; numbers.Integral
    # lets numpy integers through, which configs loaded by numpy-aware code produce.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None) -> int:
    if not is_int(value):
        raise ArgumentTypeError(
            f"{name} must be an int, got {value!r} of type {type(value).__name__}"
        )
    value = int(value)  # type: ignore[call-overload]
    if minimum is not None and value < minimum:
        raise PlanError(f"{name} must be at least {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class MbsPolicy:
    """A parsed ``mbs`` argument.

    ``mode`` is ``"auto"``, ``"explore"``, ``"none"`` or ``"int"``; ``value`` is set
    for ``"int"``; ``explore_min`` / ``explore_max`` bound an explore range (``None``
    means unbounded on that side).

    >>> parse_mbs({"explore": {"min": 2}})
    MbsPolicy(mode='explore', value=None, explore_min=2, explore_max=None)
    """

    mode: str
    value: int | None = None
    explore_min: int | None = None
    explore_max: int | None = None
    #: what the user wrote, for messages (``mbs='explore'``); not part of the policy
    request: Any = field(default=None, compare=False, repr=False)

    def at_most(self, pbs: int) -> MbsPolicy:
        """The policy for a per-system batch of ``pbs``: an int MBS above it is capped
        at it (a smaller batch than compiled for runs whole microbatches); the modes
        choose among that batch's supported values anyway.

        >>> parse_mbs(8).at_most(5).value
        5
        """
        if self.mode != "int" or (self.value or 0) <= pbs:
            return self
        return MbsPolicy("int", pbs, request=pbs)


def parse_mbs(mbs: object) -> MbsPolicy:
    """Parse the user's ``mbs``: a positive int, ``"auto"``, ``"explore"``,
    ``"none"``, or ``{"explore": {"min": a, "max": b}}``.

    >>> parse_mbs(8)
    MbsPolicy(mode='int', value=8, explore_min=None, explore_max=None)
    >>> parse_mbs("none").mode
    'none'

    ``make_request`` parses once and hands the policy on: it is never parsed again.
    """
    return replace(_parse(mbs), request=mbs)


def _parse(mbs: object) -> MbsPolicy:
    if is_int(mbs):
        value = int(mbs)  # type: ignore[call-overload]
        if value < 1:
            raise PlanError(
                f"mbs must be a positive int, got {value}; use an int >= 1, "
                f"or one of {', '.join(repr(m) for m in _MODES)}"
            )
        return MbsPolicy("int", value)
    if isinstance(mbs, str):
        if mbs in _MODES:
            return MbsPolicy(mbs)
        hint = f" (did you mean {mbs.lower()!r}?)" if mbs.lower() in _MODES else ""
        raise PlanError(
            f"unknown mbs {mbs!r}{hint}; valid strings are "
            f"{', '.join(repr(m) for m in _MODES)}, or pass a positive int or "
            f"{_EXPLORE_FORM}"
        )
    if isinstance(mbs, Mapping):
        return _parse_explore_mapping(mbs)
    raise ArgumentTypeError(
        f"mbs must be a positive int, 'auto', 'explore', 'none' or "
        f"{_EXPLORE_FORM}; got {mbs!r} of type {type(mbs).__name__}"
    )


def _parse_explore_mapping(mbs: Mapping[Any, Any]) -> MbsPolicy:
    def bad(what: str) -> PlanError:
        return PlanError(f"malformed mbs {mbs!r}: {what}; the valid form is {_EXPLORE_FORM}")

    if set(mbs) != {"explore"}:
        raise bad(f"expected the single key 'explore', got keys {sorted(map(repr, mbs))}")
    bounds = mbs["explore"]
    if not isinstance(bounds, Mapping):
        raise bad(f"mbs['explore'] must be a mapping, got {type(bounds).__name__}")
    unknown = set(bounds) - {"min", "max"}
    if unknown:
        raise bad(f"unknown key(s) {sorted(map(repr, unknown))} in mbs['explore']")
    parsed: dict[str, int | None] = {}
    for key in ("min", "max"):
        value = bounds.get(key)
        if value is None:
            parsed[key] = None
        elif not is_int(value):
            raise bad(f"{key} must be an int, got {value!r} of type {type(value).__name__}")
        elif value < 1:
            raise bad(f"{key} must be at least 1, got {value}")
        else:
            parsed[key] = int(value)
    lo, hi = parsed["min"], parsed["max"]
    if lo is not None and hi is not None and lo > hi:
        raise bad(f"min {lo} is larger than max {hi}")
    return MbsPolicy("explore", explore_min=lo, explore_max=hi)
