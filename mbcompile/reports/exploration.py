"""An MBS exploration shown: a fixed-width table and a plot of its candidates.

``table(cm.exploration)`` is what ``cm.report()`` prints under "candidates auto
evaluated"; ``plot(cm.exploration, "explore.png")`` is the ``explore.png`` that
``mbcompile compile`` writes.
"""

from __future__ import annotations

from pathlib import Path

from mbcompile.planning.estimates import format_bytes, format_seconds
from mbcompile.planning.exploration import Exploration

__all__ = ["plot", "table"]


def table(x: Exploration) -> str:
    """A fixed-width table: one row per evaluated MBS."""
    head = f"{'mbs':>6} " + (f"{'recompute':>9} " if x.joint else "") + \
        f"{'micro':>6} {'step (model)':>14} {'samples/s':>11} " \
        f"{'peak memory':>12} {'fits':>5} {'bound':>16}"
    if x.measured:
        head += f" {'loop (model)':>13} {'loop (measured)':>16} {'meas/model':>10}"
    lines = [head, "-" * len(head)]
    for c in x.candidates:
        mark = " *" if (c.mbs, c.recompute) == (x.best, x.best_recompute) else ""
        recompute = (f"{'yes' if c.recompute else 'no':>9} " if x.joint else "")
        row = (f"{c.mbs:>6} {recompute}{c.num_microbatches:>6} {format_seconds(c.step_s):>14} "
               f"{c.samples_per_s:>11.4g} {format_bytes(c.peak_bytes):>12} "
               f"{'yes' if c.fits else 'NO':>5} {c.bound:>16}")
        if x.measured:
            row += f" {format_seconds(c.loop_s):>13}"
            if c.measured_loop_s is None:
                row += f" {'-':>16} {'-':>10}"
            else:
                row += (f" {format_seconds(c.measured_loop_s):>16} "
                        f"{c.measured_loop_s / c.loop_s:>10.2f}")
        lines.append(row + mark)
    evaluated = (f"{len(x.candidates)} (MBS, recompute) pairs over {x.supported} "
                 "supported values evaluated" if x.joint else
                 f"{len(x.candidates)} of {x.supported} supported values evaluated")
    lines.append(f"(* = {'chosen' if x.mode == 'auto' else 'best'}; {evaluated} "
                 f"in {x.seconds:.2f} s; memory capacity {format_bytes(x.capacity)})")
    return "\n".join(lines)

def plot(x: Exploration, path: str | Path, title: str | None = None) -> Path:
    """Save a PNG of modelled step time and peak memory against the MBS."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    plain = [c for c in x.candidates if not c.recompute]
    ticked = [c for c in x.candidates if c.recompute]
    xs = [c.mbs for c in plain]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(xs, [c.step_s for c in plain], "o-", color="tab:blue",
            label="step time (model)")
    if ticked:
        ax.plot([c.mbs for c in ticked], [c.step_s for c in ticked], "o--",
                color="tab:purple", label="step time, recompute (model)")
    if x.measured:
        pts = [(c.mbs, c.measured_loop_s, c.loop_s) for c in x.candidates
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
    ax2.axhline(x.capacity / 1e9, color="tab:red", ls=":", label="memory capacity")
    ax2.set_ylabel("peak memory (GB)", color="tab:red")
    if x.best is not None:
        ax.axvline(x.best, color="tab:green", ls="--", label=f"best: mbs {x.best}")
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper center",
              fontsize=8)
    ax.set_title(title or f"MBS exploration: gbs {x.gbs} over {x.num_csx} x "
                 f"{x.system}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
