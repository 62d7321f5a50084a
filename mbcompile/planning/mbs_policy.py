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

__all__ = ["MbsPolicy", "check_int", "is_int", "parse_mbs", "tokens_mbs"]

_MODES = ("auto", "explore", "none")
_EXPLORE_FORM = "{'explore': {'min': a, 'max': b}} (both optional ints >= 1, a <= b)"
_TOKENS_FORM = "{'tokens': n} (an int n >= 1: tokens per microbatch)"
_DICT_FORMS = f"{_EXPLORE_FORM}, or {_TOKENS_FORM}"


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

    ``mode`` is ``"auto"``, ``"explore"``, ``"none"``, ``"int"`` or ``"tokens"``; ``value``
    is set for ``"int"``; ``explore_min`` / ``explore_max`` bound an explore range
    (``None`` means unbounded on that side); ``tokens`` is a token budget per microbatch
    (``{"tokens": n}``), which ``for_tokens`` turns into the int MBS of one length.

    >>> parse_mbs({"explore": {"min": 2}})
    MbsPolicy(mode='explore', value=None, explore_min=2, explore_max=None, tokens=None)
    >>> parse_mbs({"tokens": 8192}).for_tokens(512, pbs=64).value  # 16 rows of 512
    16
    """

    mode: str
    value: int | None = None
    explore_min: int | None = None
    explore_max: int | None = None
    #: tokens per microbatch (``{"tokens": n}``); kept beside the int MBS it gives at a length
    tokens: int | None = None
    #: what the user wrote, for messages (``mbs='explore'``); not part of the policy
    request: Any = field(default=None, compare=False, repr=False)

    def at_most(self, pbs: int) -> MbsPolicy:
        """The policy for a per-system batch of ``pbs``: an int MBS above it is capped
        at it (a smaller batch than compiled for runs whole microbatches); the modes
        choose among that batch's supported values anyway.

        >>> parse_mbs(8).at_most(5).value
        5
        """
        if self.tokens is not None and self.value is not None:  # within the budget still
            return replace(self, value=tokens_mbs(self.value, 1, pbs))
        if self.mode != "int" or (self.value or 0) <= pbs:
            return self
        return MbsPolicy("int", pbs, request=pbs)

    def for_tokens(self, tokens_per_sample: int, pbs: int) -> MbsPolicy:
        """A token budget's MBS at ``tokens_per_sample``: the most samples whose tokens fit
        the budget, at most ``pbs``, among the MBS values ``pbs`` supports (an int policy
        that keeps the budget); raises ``PlanError`` when one sample alone has more tokens.

        >>> parse_mbs({"tokens": 100}).for_tokens(30, pbs=8).value  # 3 x 30 <= 100
        3
        """
        if self.tokens is None:
            return self
        return replace(self, mode="int", value=tokens_mbs(self.tokens, tokens_per_sample, pbs))


def tokens_mbs(budget: int, tokens_per_sample: int, pbs: int) -> int:
    """The largest MBS that ``pbs`` supports (``ceil(pbs / k)``) whose microbatches of
    ``tokens_per_sample`` each hold at most ``budget`` tokens; ``PlanError`` where one
    sample alone holds more.

    >>> tokens_mbs(8192, 512, 64), tokens_mbs(8192, 600, 64), tokens_mbs(100, 30, 8)
    (16, 13, 3)
    """
    most = budget // tokens_per_sample
    if most < 1:
        raise PlanError(
            f"mbs={{'tokens': {budget}}} allows {budget} tokens per microbatch, but one sample "
            f"has {tokens_per_sample} tokens; give a budget of at least {tokens_per_sample} "
            "tokens, or cut the samples shorter")
    if most >= pbs:
        return pbs
    # the supported values are ceil(pbs / k); the largest <= most is at the smallest such k
    return -(-pbs // -(-pbs // most))


def parse_mbs(mbs: object) -> MbsPolicy:
    """Parse the user's ``mbs``: a positive int, ``"auto"``, ``"explore"``,
    ``"none"``, ``{"explore": {"min": a, "max": b}}`` or ``{"tokens": n}``.

    >>> parse_mbs(8)
    MbsPolicy(mode='int', value=8, explore_min=None, explore_max=None, tokens=None)
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
            f"{', '.join(repr(m) for m in _MODES)}, or pass a positive int, "
            f"{_DICT_FORMS}"
        )
    if isinstance(mbs, Mapping):
        if "tokens" in mbs:
            return _parse_tokens_mapping(mbs)
        return _parse_explore_mapping(mbs)
    raise ArgumentTypeError(
        f"mbs must be a positive int, 'auto', 'explore', 'none', "
        f"{_DICT_FORMS}; got {mbs!r} of type {type(mbs).__name__}"
    )


def _parse_tokens_mapping(mbs: Mapping[Any, Any]) -> MbsPolicy:
    def bad(what: str) -> PlanError:
        return PlanError(f"malformed mbs {mbs!r}: {what}; the valid form is {_TOKENS_FORM}, "
                         "for example mbs={'tokens': 8192}")

    if set(mbs) != {"tokens"}:
        raise bad(f"expected the single key 'tokens', got keys {sorted(map(repr, mbs))}")
    budget = mbs["tokens"]
    if not is_int(budget):
        raise bad(f"tokens must be an int, got {budget!r} of type {type(budget).__name__}")
    if budget < 1:
        raise bad(f"tokens must be at least 1, got {budget}")
    return MbsPolicy("tokens", tokens=int(budget))


def _parse_explore_mapping(mbs: Mapping[Any, Any]) -> MbsPolicy:
    def bad(what: str) -> PlanError:
        return PlanError(f"malformed mbs {mbs!r}: {what}; the valid form is {_EXPLORE_FORM}")

    if set(mbs) != {"explore"}:
        raise bad(f"expected the single key 'explore' (or 'tokens'), got keys "
                  f"{sorted(map(repr, mbs))}")
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
