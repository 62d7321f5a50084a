"""What one MBS selection evaluated and decided: its candidates, the plan, the estimate.

``Exploration.table()`` and ``Exploration.plot()`` show the candidates; the selection
itself is ``explore.py``'s (``"auto"``, ``"explore"``) and ``mbcompile/selection.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mbcompile.planning.cost import CostModel
from mbcompile.planning.estimates import Estimate, format_bytes, format_seconds
from mbcompile.planning.plan import MicrobatchPlan
from mbcompile.planning.systems import SystemSpec

__all__ = ["Candidate", "Exploration", "Selection"]


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

    def table(self) -> str:
        """A fixed-width table: one row per evaluated MBS."""
        head = f"{'mbs':>6} " + (f"{'recompute':>9} " if self.joint else "") + \
            f"{'micro':>6} {'step (model)':>14} {'samples/s':>11} " \
            f"{'peak memory':>12} {'fits':>5} {'bound':>16}"
        if self.measured:
            head += f" {'loop (model)':>13} {'loop (measured)':>16} {'meas/model':>10}"
        lines = [head, "-" * len(head)]
        for c in self.candidates:
            mark = " *" if (c.mbs, c.recompute) == (self.best, self.best_recompute) else ""
            recompute = (f"{'yes' if c.recompute else 'no':>9} " if self.joint else "")
            row = (f"{c.mbs:>6} {recompute}{c.num_microbatches:>6} {format_seconds(c.step_s):>14} "
                   f"{c.samples_per_s:>11.4g} {format_bytes(c.peak_bytes):>12} "
                   f"{'yes' if c.fits else 'NO':>5} {c.bound:>16}")
            if self.measured:
                row += f" {format_seconds(c.loop_s):>13}"
                if c.measured_loop_s is None:
                    row += f" {'-':>16} {'-':>10}"
                else:
                    row += (f" {format_seconds(c.measured_loop_s):>16} "
                            f"{c.measured_loop_s / c.loop_s:>10.2f}")
            lines.append(row + mark)
        evaluated = (f"{len(self.candidates)} (MBS, recompute) pairs over {self.supported} "
                     "supported values evaluated" if self.joint else
                     f"{len(self.candidates)} of {self.supported} supported values evaluated")
        lines.append(f"(* = {'chosen' if self.mode == 'auto' else 'best'}; {evaluated} "
                     f"in {self.seconds:.2f} s; memory capacity {format_bytes(self.capacity)})")
        return "\n".join(lines)

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Save a PNG of modelled step time and peak memory against the MBS."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        path = Path(path)
        plain = [c for c in self.candidates if not c.recompute]
        ticked = [c for c in self.candidates if c.recompute]
        xs = [c.mbs for c in plain]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.plot(xs, [c.step_s for c in plain], "o-", color="tab:blue",
                label="step time (model)")
        if ticked:
            ax.plot([c.mbs for c in ticked], [c.step_s for c in ticked], "o--",
                    color="tab:purple", label="step time, recompute (model)")
        if self.measured:
            pts = [(c.mbs, c.measured_loop_s, c.loop_s) for c in self.candidates
                   if c.measured_loop_s is not None]
            if pts:
                xs_m, measured, loop = zip(*pts)
                ax.plot(xs_m, loop, "x:", color="tab:blue", label="microbatch loop (model)")
                ax.plot(xs_m, measured, "s--", color="tab:cyan",
                        label="microbatch loop (measured)")
        ax.set_xlabel("micro batch size (MBS)")
        ax.set_ylabel("step time (s)", color="tab:blue")
        ax.set_xscale("log", base=2)
        ax2 = ax.twinx()
        ax2.plot(xs, [c.peak_bytes / 1e9 for c in plain], "^-", color="tab:red",
                 label="peak memory (model)")
        if ticked:
            ax2.plot([c.mbs for c in ticked], [c.peak_bytes / 1e9 for c in ticked], "^--",
                     color="tab:orange", label="peak memory, recompute (model)")
        ax2.axhline(self.capacity / 1e9, color="tab:red", ls=":", label="memory capacity")
        ax2.set_ylabel("peak memory (GB)", color="tab:red")
        if self.best is not None:
            ax.axvline(self.best, color="tab:green", ls="--", label=f"best: mbs {self.best}")
        handles = ax.get_legend_handles_labels()
        handles2 = ax2.get_legend_handles_labels()
        ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper center",
                  fontsize=8)
        ax.set_title(title or f"MBS exploration: gbs {self.gbs} over {self.num_csx} x "
                     f"{self.system}")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "system": self.system, "gbs": self.gbs,
                "num_csx": self.num_csx, "pbs": self.pbs, "supported": self.supported,
                "best": self.best, "measured_best": self.measured_best,
                "seconds": self.seconds, "capacity": self.capacity,
                "fit_note": self.fit_note, "measured": self.measured,
                "best_recompute": self.best_recompute,
                "candidates": [c.to_dict() for c in self.candidates]}


@dataclass(frozen=True)
class Selection:
    """What :func:`select_plan` decided: the plan, its estimate, what it evaluated.

    ``plan`` is the arithmetic's answer (``make_plan``, with the knobs the selection
    turned: ``recompute``, ``reshard_after_forward``); what the later steps of the
    selection say of it (a two-phase step's memory, FSDP2 sharding, checkpointing) is
    kept beside it, in ``notes`` and ``warnings``, and joined once into the compiled
    module's plan (``reason``).
    """

    plan: MicrobatchPlan
    system: SystemSpec
    estimate: Estimate | None
    exploration: Exploration | None
    cost: CostModel | None = field(repr=False, default=None)
    cost_error: str | None = None
    notes: tuple[str, ...] = ()  # why, beyond the MBS: each later step's word, in order
    warnings: tuple[str, ...] = ()  # what the user should know of the plan (also warned)

    def noted(self, note: str, warning: str | None = None) -> Selection:
        """This selection with one more note (and warning) beside its plan."""
        return replace(self, notes=(*self.notes, note),
                       warnings=self.warnings if warning is None else (*self.warnings, warning))

    @property
    def reason(self) -> str:
        """Why this plan: the MBS choice, then every note, in the order they were made."""
        return "; ".join((self.plan.reason, *self.notes))
