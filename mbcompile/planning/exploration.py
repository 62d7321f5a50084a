"""What one MBS search evaluated and chose: its candidates, the plan, the estimate.

``mbcompile.reports.exploration`` shows the candidates (a table, a plot); the search
itself is ``search.py``'s (``"auto"``, ``"explore"``), and ``mbcompile/selection.py``
turns its ``Choice`` into compile()'s ``Selection``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from mbcompile.planning.cost import CostModel
from mbcompile.planning.estimates import Estimate
from mbcompile.planning.plan import MicrobatchPlan

__all__ = ["Candidate", "Choice", "Exploration"]


@dataclass(frozen=True)
class Candidate:
    """One MBS as the model (and, with ``measure=True``, the clock) sees it."""

    mbs: int
    num_microbatches: int
    step_s: float
    peak_bytes: float
    fits: bool
    bound: str
    samples_per_s: float
    loop_s: float  # the modelled microbatch loop: step minus all-reduce and optimizer
    measured_loop_s: float | None = None  # the same loop, timed on this host
    recompute: bool = False  # with activation checkpointing per block

    def to_dict(self) -> dict[str, Any]:
        return {"mbs": self.mbs, "num_microbatches": self.num_microbatches,
                "step_s": self.step_s, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "bound": self.bound, "samples_per_s": self.samples_per_s,
                "loop_s": self.loop_s, "measured_loop_s": self.measured_loop_s,
                "recompute": self.recompute}


@dataclass(frozen=True)
class Exploration:
    """The candidates one selection evaluated, and its answer."""

    mode: str  # "auto", "explore", "int", "none"
    system: str
    gbs: int
    num_csx: int
    pbs: int
    candidates: tuple[Candidate, ...]  # sorted by mbs
    supported: int  # how many supported values there were to choose from
    best: int | None  # the chosen / recommended MBS
    seconds: float  # wall time of the selection (probes included)
    capacity: float
    fit_note: str = ""
    measured: bool = False
    best_recompute: bool = False  # the best runs with activation checkpointing

    def candidate(self, mbs: int, recompute: bool = False) -> Candidate:
        for c in self.candidates:
            if c.mbs == mbs and c.recompute == recompute:
                return c
        raise KeyError(mbs)

    @property
    def joint(self) -> bool:
        """Whether candidates with activation checkpointing were evaluated too."""
        return any(c.recompute for c in self.candidates)

    @property
    def measured_best(self) -> int | None:
        timed = [c for c in self.candidates if c.fits and c.measured_loop_s is not None]
        return min(timed, key=lambda c: (c.measured_loop_s, c.mbs)).mbs if timed else None

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "system": self.system, "gbs": self.gbs,
                "num_csx": self.num_csx, "pbs": self.pbs, "supported": self.supported,
                "best": self.best, "measured_best": self.measured_best,
                "seconds": self.seconds, "capacity": self.capacity,
                "fit_note": self.fit_note, "measured": self.measured,
                "best_recompute": self.best_recompute,
                "candidates": [c.to_dict() for c in self.candidates]}


@dataclass(frozen=True)
class Choice:
    """What the MBS search (``search.py``'s ``select_plan``) chose: the plan, its estimate,
    what it evaluated.

    ``plan`` is the arithmetic's answer (``plan_for``, with the knobs the selection
    turned: ``recompute``, ``reshard_after_forward``); what the later steps of the
    selection say of it (a two-phase step's memory, FSDP2 sharding, checkpointing) is
    kept beside it, in ``notes`` and ``warnings``, and joined once into the plan of
    compile()'s ``Selection`` (``mbcompile/selection.py``).
    """

    plan: MicrobatchPlan
    estimate: Estimate | None
    exploration: Exploration | None
    cost: CostModel | None = field(repr=False, default=None)
    cost_error: str | None = None
    notes: tuple[str, ...] = ()  # why, beyond the MBS: each later step's word, in order
    warnings: tuple[str, ...] = ()  # what the user should know of the plan (also warned)

    def noted(self, note: str, warning: str | None = None) -> Choice:
        """This selection with one more note (and warning) beside its plan."""
        return replace(self, notes=(*self.notes, note),
                       warnings=self.warnings if warning is None else (*self.warnings, warning))

    @property
    def reason(self) -> str:
        """Why this plan: the MBS choice, then every note, in the order they were made."""
        return "; ".join((self.plan.reason, *self.notes))
