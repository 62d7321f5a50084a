"""Learning-rate scaling when the global batch size changes.

Goyal et al. (2017, "Accurate, Large Minibatch SGD") scale SGD's learning rate
linearly with the batch size and ramp up to it over a warmup; adaptive optimizers
(Adam and its family) follow the square root more closely (e.g. Malladi et al.
2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"). A run
states its reference batch size, the one its learning rate was tuned at:

    lr(gbs) = lr_ref * (gbs / ref)          linear
    lr(gbs) = lr_ref * sqrt(gbs / ref)      sqrt
    lr(gbs) = lr_ref                        none

and with ``warmup_steps`` the rate goes linearly from ``lr_ref`` to ``lr(gbs)``
over the first steps. The default rule is ``sqrt`` for Adam-family optimizers
and ``linear`` for SGD (and other optimizers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mbcompile.errors import ArgumentTypeError, PlanError

__all__ = ["RULES", "LRScaling", "default_rule", "scale_factor"]

RULES = ("linear", "sqrt", "none")
_ADAPTIVE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
             torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop)


def default_rule(optimizer: torch.optim.Optimizer) -> str:
    """``sqrt`` for the Adam family (adaptive optimizers), ``linear`` otherwise (SGD)."""
    return "sqrt" if isinstance(optimizer, _ADAPTIVE) else "linear"


def scale_factor(rule: str, gbs: int, reference_batch_size: int) -> float:
    """How much the learning rate grows from the reference batch size to ``gbs``."""
    ratio = gbs / reference_batch_size
    return {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


@dataclass
class LRScaling:
    """The scaling of one run: the rule, the batch sizes and each group's rates."""

    rule: str
    reference_batch_size: int
    gbs: int
    warmup_steps: int
    base_lrs: tuple[float, ...]
    default: bool  # the rule was chosen from the optimizer, not given

    @classmethod
    def apply(cls, optimizer: torch.optim.Optimizer, gbs: int, reference_batch_size: int,
              rule: str | None = None, warmup_steps: int = 0) -> LRScaling:
        """Scale ``optimizer``'s learning rates for ``gbs`` (before the first step)."""
        if rule is not None and rule not in RULES:
            raise PlanError(f"lr_scaling must be one of {RULES} (or omitted for the "
                            f"optimizer's default), got {rule!r}")
        for name, value in (("reference_batch_size", reference_batch_size),
                            ("warmup_steps", warmup_steps)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
        if reference_batch_size < 1 or warmup_steps < 0:
            raise PlanError("reference_batch_size must be >= 1 and warmup_steps >= 0")
        scaling = cls(rule or default_rule(optimizer), reference_batch_size, gbs, warmup_steps,
                      tuple(float(g["lr"]) for g in optimizer.param_groups), rule is None)
        scaling.set_step(optimizer, 0)
        return scaling

    @property
    def factor(self) -> float:
        return scale_factor(self.rule, self.gbs, self.reference_batch_size)

    def lr_at(self, step: int, base: float) -> float:
        """The rate for optimizer step ``step`` (0-based) of a group whose reference is ``base``."""
        target = base * self.factor
        if self.warmup_steps and step < self.warmup_steps:
            return base + (target - base) * (step + 1) / self.warmup_steps
        return target

    def set_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["lr"] = self.lr_at(step, base)

    def describe(self, optimizer: torch.optim.Optimizer) -> str:
        why = (f"the default for {type(optimizer).__name__}" if self.default
               else "as configured")
        old = ", ".join(f"{b:.3g}" for b in self.base_lrs)
        new = ", ".join(f"{b * self.factor:.3g}" for b in self.base_lrs)
        warm = f", warmup over {self.warmup_steps} steps" if self.warmup_steps else ""
        return (f"lr scaling: {self.rule} ({why}): gbs {self.gbs} vs reference batch size "
                f"{self.reference_batch_size}, x{self.factor:.4g}: lr {old} -> {new}{warm}")
