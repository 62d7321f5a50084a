"""Moved: the rule table is the package ``passes/rules`` (``mbcompile.passes.rules``).

Only the names modules outside the package still import from here are left; import them
from ``mbcompile.passes.rules``. This file goes when nothing imports it any more.
"""

from .rules import (
    BATCH_NORMS,
    BATCH_RULES,
    MBS_NONE,
    TABLE,
    TRUSTED_MODULES,
    RuleContext,
    apply_rule,
    is_aten,
    lookup_rule,
    node_name,
    register_batch_rule,
    rule_key,
    scoped,
    trust_module,
)
from .rules import Rejected as _Rejected

__all__ = [
    "BATCH_NORMS",
    "BATCH_RULES",
    "MBS_NONE",
    "TABLE",
    "TRUSTED_MODULES",
    "RuleContext",
    "_Rejected",
    "apply_rule",
    "is_aten",
    "lookup_rule",
    "node_name",
    "register_batch_rule",
    "rule_key",
    "scoped",
    "trust_module",
]
