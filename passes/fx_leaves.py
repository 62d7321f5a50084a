"""Which torch layers torch.fx traces through rather than keeps as one node.

fx keeps a torch layer (``torch.nn``, ``torch.ao.nn``) as one call, judged by its class's
batch rule and run once per microbatch. A layer whose call does more than that rule says
is traced instead, so that the extra work is seen, and run once per step where it must be.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from .legacy_weights import WEIGHT_HOOKS

__all__ = ["traced_through"]


def traced_through(m: torch.nn.Module) -> bool:
    """Whether fx traces through ``m``: it recomputes its weight, or runs another forward
    than the layer whose rule it inherits."""
    return _runs_more_than_forward(m) or _overrides_its_rule(m)


def _overrides_its_rule(m: torch.nn.Module) -> bool:
    """Whether ``m``'s class inherits a batch rule from a base class whose ``forward`` it
    replaces (``rules.RuleTable.layer_class``: the QAT layers of ``torch.ao.nn.qat``)."""
    from .rules import TABLE  # the rules read this module

    return any(cls in TABLE.rules for cls in type(m).__mro__) and TABLE.layer_class(m) is None


def _runs_more_than_forward(m: torch.nn.Module) -> bool:
    """A layer whose call recomputes its weight: a parametrization (spectral norm's power
    iteration also updates buffers), or the pre-hook of legacy ``spectral_norm`` /
    ``weight_norm`` or of ``prune``. Kept as one node, that work would run once per
    microbatch instead of once per step, so it is traced. (Other hooks of a layer run at
    its call, once per microbatch: a hook of the user's that keeps state belongs on a
    module of their own, whose hooks are traced.)"""
    return (parametrize.is_parametrized(m)
            or type(m).__module__.startswith("torch.nn.utils.parametriz")
            or any(isinstance(h, WEIGHT_HOOKS) for h in m._forward_pre_hooks.values()))
