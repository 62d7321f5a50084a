"""How a ``MicrobatchPlan`` prints: ``str(plan)``, the FSDP2 settings in words.

>>> print(make_plan(10, 3, 2))   # doctest: +ELLIPSIS
MicrobatchPlan: gbs 10 over 3 systems
  per-system batch sizes: 4, 3, 3 (pbs 4)
...

Reads a plan's fields only (no import of ``plan.py``, which calls it), so the plan
arithmetic stays one file of rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["PRECISION_TEXT", "describe_fsdp", "describe_precision", "format_plan"]

T = TypeVar("T")


def format_plan(plan: Any) -> str:
    """The text of ``str(plan)`` for a ``MicrobatchPlan``."""
    sizes = _format_sizes(plan.per_system_batch_sizes)
    systems = "system" if plan.num_csx == 1 else "systems"
    lines = [
        f"MicrobatchPlan: gbs {plan.gbs} over {plan.num_csx} {systems}",
        f"  per-system batch sizes: {sizes} (pbs {plan.pbs})",
        f"  mbs: requested {plan.requested_mbs}, effective {plan.mbs}",
        f"  microbatches per system: {plan.num_microbatches}",
    ]
    # systems with the same schedule share a line: a 64-system plan has two or three
    for first, last, mb in _same_runs(plan.microbatch_sizes):
        empty = mb.count(0)
        note = f" ({empty} empty, skipped)" if empty else ""
        which = f"system {first}" if first == last else f"systems {first}-{last}"
        lines.append(f"    {which}: {_format_sizes(mb)}{note}")
    if plan.tokens_per_sample is not None:
        t = plan.tokens_per_sample
        per_system = _format_sizes(tuple(n * t for n in plan.per_system_batch_sizes))
        lines.append(f"  tokens ({t} per sample): global {plan.gbs * t}, per system "
                     f"{per_system}, per microbatch at most {plan.max_microbatch_size * t}")
    if plan.precision is not None:
        lines.append(f"  precision: {describe_precision(plan.precision)}")
    if plan.recompute:
        lines.append("  recompute: activation checkpointing per block")
    if plan.reshard_after_forward is not None:
        lines.append(f"  fsdp: {describe_fsdp(plan)}")
    lines.append(f"  reason: {plan.reason}")
    if plan.warnings:
        lines.append("  warnings:")
        lines.extend(f"    - {w}" for w in plan.warnings)
    else:
        lines.append("  warnings: none")
    return "\n".join(lines)


#: what each precision name (``precision.py``) means for the activations a plan sizes
PRECISION_TEXT = {"32": "no autocast: activations in the dtype of the model",
                  "bf16-mixed": "autocast to bfloat16", "fp16-mixed": "autocast to float16"}


def describe_precision(name: str) -> str:
    """``"bf16-mixed (autocast to bfloat16)"``: a plan's precision, said in words."""
    return f"{name} ({PRECISION_TEXT[name]})"


def describe_fsdp(plan: Any) -> str:
    """What the plan's FSDP2 settings (``reshard_after_forward``, ``gradient_sync``) mean
    for a sharded step."""
    if plan.reshard_after_forward:
        text = ("reshard_after_forward=True (each unit resharded after its forward and "
                "gathered again for its backward: one unit gathered at a time)")
    else:
        text = ("reshard_after_forward=False (each unit kept gathered from its forward to its "
                "backward: half the all-gathers, every unit gathered at the peak)")
    if plan.gradient_sync == "microbatch":
        text += ("; gradient_sync='microbatch' (gradients reduce-scattered in every "
                 "microbatch's backward: they accumulate as shards)")
    elif plan.gradient_sync == "step":
        text += ("; gradient_sync='step' (gradients reduce-scattered once, in the step's "
                 "last backward: held unsharded until then)")
    return text


def _format_sizes(sizes: tuple[int, ...], limit: int = 8) -> str:
    # A plan can have a million microbatches (or systems); run-length form keeps the
    # printout one line.  Sizes within a system (or across systems) take at most two values.
    if len(sizes) <= limit:
        return ", ".join(map(str, sizes))
    return " + ".join(f"{last - first + 1} x {size}" for first, last, size in _same_runs(sizes))


def _same_runs(values: Sequence[T]) -> list[tuple[int, int, T]]:
    """``(first, last, value)`` for each run of equal consecutive ``values``."""
    runs: list[tuple[int, int, T]] = []
    for i, v in enumerate(values):
        if runs and runs[-1][2] == v:
            runs[-1] = (runs[-1][0], i, v)
        else:
            runs.append((i, i, v))
    return runs
