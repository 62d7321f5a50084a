"""The one plan of a selection: the search's choice, with what compile() adds beside it.

>>> plan = final_plan(request, choice)
>>> plan.warnings   # the selection's, the unwrapped wrappers', eval mode, BatchNorm
('compiled in eval mode (as from_pretrained leaves a model): ...',)

Made once per compile, by ``select`` (a variant for another batch size or keywords makes
its own), so that ``cm.plan`` says everything compile() decided or noticed in one place.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.nn as nn

from mbcompile.errors import PerMicrobatchStatisticsWarning
from mbcompile.inputs import tokens_per_sample
from mbcompile.passes import rules
from mbcompile.passes.sources import user_stacklevel
from mbcompile.planning.exploration import Choice
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.request import Request

__all__ = ["EVAL_MODE_NOTE", "PER_MICROBATCH_NOTE", "final_plan", "tokens_reason"]

EVAL_MODE_NOTE = (
    "compiled in eval mode (as from_pretrained leaves a model): the first call in training "
    "mode (after {name}.train(), which Trainer.train() calls) captures and compiles the "
    "training graph once, with this plan; calls in either mode reuse their graph after that")

PER_MICROBATCH_NOTE = (
    "batch_norm='per_microbatch': BatchNorm in training normalises with each microbatch's "
    "statistics and updates its running statistics once per microbatch, as a hand-written "
    "loop does; this is not the full-batch result")


def final_plan(request: Request, choice: Choice) -> MicrobatchPlan:
    """The compiled module's plan, made once: the search's plan with its reasons and
    warnings joined in, and what the request adds (tokens per sample, the notes of
    unwrapping the model, of a model compiled in eval mode and of per-microbatch
    BatchNorm statistics)."""
    plan = choice.plan
    notes = plan.warnings + choice.warnings + request.notes
    if not request.inner.training:
        notes = (*notes, EVAL_MODE_NOTE.format(name=request.name))
    if (request.options.batch_norm == "per_microbatch" and plan.num_nonempty_microbatches > 1
            and _has_batch_norm(request.model)):
        warnings.warn(PER_MICROBATCH_NOTE, PerMicrobatchStatisticsWarning,
                      stacklevel=user_stacklevel())
        notes = (*notes, PER_MICROBATCH_NOTE)
    tokens = tokens_per_sample(request.inputs, request.example)
    reason = choice.reason
    if request.policy.tokens is not None and tokens is not None:
        reason = tokens_reason(request.policy.tokens, plan.mbs, tokens)
    return dataclasses.replace(plan, reason=reason, warnings=notes,
                               # what the probes ran in; nothing was probed without them
                               precision=request.precision.name if choice.estimate else None,
                               tokens_per_sample=tokens)


def tokens_reason(budget: int, mbs: int, tokens: int) -> str:
    """Why a token budget's plan runs ``mbs`` samples of ``tokens`` tokens each."""
    return (f"mbs={{'tokens': {budget}}}: {mbs} sample{'s' if mbs != 1 else ''} of {tokens} "
            f"tokens ({mbs * tokens} tokens) per microbatch, the most the budget holds")


def _has_batch_norm(model: nn.Module) -> bool:
    """Whether a BatchNorm module of ``model`` is in training mode (uses batch statistics)."""
    kinds = tuple(op for op in rules.BATCH_NORMS if isinstance(op, type))
    return any(isinstance(m, kinds) and m.training for m in model.modules())
