"""The project's exception and warning types, in one place for users to import from.

The passes' own (``MixingError``, ``CaptureError``, ...) are defined in
``mbcompile.passes.errors``, so that the passes depend only downward, and re-exported
here; the ones raised above the passes (the cost model's, the MBS search's, the
compiled module's) are defined here.

>>> from mbcompile.errors import DoesNotFitError, MixingError
"""

from __future__ import annotations

from typing import Any

from mbcompile.passes.errors import *  # noqa: F403
from mbcompile.passes.errors import CaptureError, MbcompileError, MbcompileWarning, PlanError
from mbcompile.passes.errors import __all__ as _passes_all

__all__ = [*_passes_all, "CompileOnlyError", "CostModelError", "CostModelWarning",
           "DoesNotFitError", "TwoPhaseWarning", "UncheckedHookError"]


class CostModelError(MbcompileError):
    """The graph could not be run on fake tensors to measure its cost."""


class DoesNotFitError(PlanError):
    """The chosen (or smallest possible) microbatch does not fit the system's memory.

    ``needed`` and ``available`` are bytes; ``mbs`` the size that was checked (0: static
    memory alone, before any MBS); ``fixes`` what would fit, each worked out
    (``planning/fixes.py``), also in the message.
    """

    def __init__(self, message: str, *, mbs: int, needed: float, available: float,
                 fixes: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.mbs, self.needed, self.available = mbs, needed, available
        self.fixes = fixes


class CompileOnlyError(MbcompileError, RuntimeError):
    """A module compiled with ``compile_only=True`` (or ``mbs="explore"``) was called."""

    @classmethod
    def of(cls, mbs: int, exploration: Any, shapes_only: bool = False) -> CompileOnlyError:
        """The error a compile-only module of MBS ``mbs`` raises when called (``exploration``:
        what its selection evaluated; ``shapes_only``: its parameters hold no data, so
        compiling again is not enough)."""
        pin = exploration.best if exploration is not None and exploration.mode == "explore" \
            else mbs
        weights = ("; its parameters hold no data (the meta device or a FakeTensorMode): "
                   "build it with real weights first (transformers: from_pretrained; "
                   "model.to_empty(device=...) unties tied weights: call model.tie_weights() "
                   "after it, then load the weights)") if shapes_only else ""
        return cls(
            "this module was compiled with compile_only=True: it was traced, analysed, planned "
            f"and estimated (mbs={mbs}), and does not run. Read cm.report() for the plan "
            f"and the estimates; to train, compile again without compile_only, e.g. with "
            f"mbs={pin}{weights}")


class CostModelWarning(MbcompileWarning):
    """The cost model could not run; the plan was made without it."""


class TwoPhaseWarning(MbcompileWarning):
    """A two-phase step whose coupled part holds most of the memory: little is saved."""


class UncheckedHookError(CaptureError):
    """A forward hook of a live layer wrote Python state inside a step, or, registered after
    compile, changed what the layer computes."""
