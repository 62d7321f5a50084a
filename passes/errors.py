"""The project's exception and warning types.

Every error mbcompile raises on purpose is an ``MbcompileError``; the ones that
Python convention says are value or type errors also subclass ``ValueError`` or
``TypeError``, so ``except ValueError`` in a user's code keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ArgumentTypeError",
    "BatchSizeWarning",
    "CaptureError",
    "InputError",
    "JointStepWarning",
    "MbcompileError",
    "MbcompileWarning",
    "MbsAdjustedWarning",
    "RecompileWarning",
    "MicrobatchError",
    "MicrobatchOutOfMemoryError",  # noqa: F822  (module __getattr__: defined with torch)
    "MixingError",
    "PerMicrobatchStatisticsWarning",
    "PlanError",
    "RetainedActivationsWarning",
    "UnsupportedOpError",
]


class MbcompileError(Exception):
    """Base class of every error mbcompile raises on purpose."""


class PlanError(MbcompileError, ValueError):
    """A (gbs, num_csx, mbs) configuration that cannot be planned."""


class ArgumentTypeError(MbcompileError, TypeError):
    """An argument of the wrong type (a float or bool where an int belongs, ...)."""


class InputError(MbcompileError, ValueError):
    """Inputs of a call that do not match what the module was compiled for."""


class CaptureError(MbcompileError):
    """The model could not be captured as an fx graph."""


class MixingError(MbcompileError):
    """An op couples samples of the batch, so splitting it would change the result."""


class UnsupportedOpError(MixingError):
    """An op without a batch rule: rejected, never guessed."""


class MicrobatchError(MbcompileError, RuntimeError):
    """A microbatch raised or produced a non-finite loss; the step was rolled back.

    A ``RuntimeError``, as the error it wraps usually is, so ``except RuntimeError``
    handlers keep catching failures inside the loop.
    """


class MbcompileWarning(UserWarning):
    """Base class of mbcompile's warnings."""


class PerMicrobatchStatisticsWarning(MbcompileWarning):
    """``batch_norm="per_microbatch"``: BatchNorm normalises with each microbatch's statistics,
    so the step is what a hand-written loop computes, not the full-batch result."""


class MbsAdjustedWarning(MbcompileWarning):
    """The requested MBS is not supported and was replaced by the closest supported one."""


class RetainedActivationsWarning(MbcompileWarning):
    """Training without a loss inside the model keeps every microbatch's activations alive."""


class RecompileWarning(MbcompileWarning):
    """Python state the graph was built from changed since compile (an attribute forward
    reads, a hook, a parameter's ``requires_grad``), or a call passes other keywords
    through forward's ``**kwargs`` than the example did: the module compiles again for it."""


class BatchSizeWarning(MbcompileWarning):
    """A call brought a batch of another size than ``gbs``: the module planned and compiled
    it once for that size (``compile(..., batch_sizes="fixed")`` makes it an error)."""


class JointStepWarning(MbcompileWarning):
    """``torch_compile``: the joint forward-backward graph failed; the step runs the compiled
    forward and autograd's backward per microbatch instead (exact, a little slower)."""


def _out_of_memory_error() -> type:
    import torch  # here, not at the top: plan arithmetic imports these errors without torch

    class MicrobatchOutOfMemoryError(MicrobatchError, torch.OutOfMemoryError):
        """A microbatch ran out of memory; the step was rolled back.

        Also a ``torch.OutOfMemoryError`` whose message keeps the allocator's text, so
        OOM handlers (Accelerate's ``find_executable_batch_size``, Lightning's
        ``BatchSizeFinder``, ``except torch.OutOfMemoryError``) still see an OOM.
        """

    MicrobatchOutOfMemoryError.__module__ = __name__
    return MicrobatchOutOfMemoryError


def __getattr__(name: str) -> Any:
    if name == "MicrobatchOutOfMemoryError":  # defined on first use (PEP 562), then kept
        globals()[name] = _out_of_memory_error()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
