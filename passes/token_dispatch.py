"""Moved: token dispatch is part of the rule table, ``passes/rules`` (``tokens``,
``token_rules``, ``token_moves``, ``grouped_matmuls``), entered through each op's own line.

Only what the batch analysis still imports from here is left; import it from
``mbcompile.passes.rules``. This file goes when nothing imports it any more.
"""

from __future__ import annotations

from .rules import NoRule, is_dispatch_fact, output_reason
from .rules.context import Rule, RuleContext

__all__ = ["NoRule", "dispatch_fact", "is_dispatch_fact", "output_reason"]


def dispatch_fact(ctx: RuleContext, rule: Rule | None, where: object = None) -> None:
    """Nothing to ask before the table any more: its rules enter token dispatch themselves
    (``apply_rule``), so this always answers None and the analysis applies ``rule``."""
    return None
