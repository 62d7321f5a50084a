"""The progress bar the MBS search shows while it measures or probes candidates."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["PROGRESS_THRESHOLD", "progress_bar"]

#: Show a progress bar (on a terminal) when more than this many candidates need
#: real measurement or an exact probe each.
PROGRESS_THRESHOLD = 4


def progress_bar(total: int, show: bool | None) -> Any:
    """A rich progress bar on stderr, or a disabled one.

    ``show=None``: only for more than ``PROGRESS_THRESHOLD`` items and on a
    terminal (it then vanishes when done); ``True``: always, and it stays (logs).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    forced = show is True
    if show is None:
        show = total > PROGRESS_THRESHOLD and sys.stderr.isatty()
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True, force_terminal=forced or None),
                    transient=not forced, disable=not show)
