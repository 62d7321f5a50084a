"""Forward's own autocast regions, and the outer autocast a compiled step cannot keep them under.

A forward may set its own precision for part of its work: the loss in float32 (``with
torch.autocast("cpu", enabled=False):``, or a method decorated with it), a block in
float16. Both captures record what such a region computes at compile time, where no
autocast is on: torch.export as explicit casts, torch.fx as the ops themselves (a region
that changes nothing while tracing leaves no mark on the graph). Called under an outer
``torch.autocast``, eager's region still runs in its own precision, but the compiled
step's ops are all cast by the outer autocast: a float32 loss region in bfloat16 (loss
1.538868 against eager's 1.538704, float32 logits returned as bfloat16). So every entry
of an autocast region is recorded while forward is traced, whether it changes the state
then or not (``autocast_entered``), and a call under an outer autocast is refused before
anything runs (``refuse_outer_autocast``), naming the region and the fix: the outer
autocast inside forward too (a wrapper module compiled in the model's place), which both
captures keep as explicit casts.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator, Sequence

import torch

from .errors import CaptureError
from .forward_modes import autocast_state
from .sources import user_frame

__all__ = ["autocast_entered", "refuse_outer_autocast"]


@contextlib.contextmanager
def autocast_entered() -> Iterator[list[str]]:
    """While the block traces forward: where it enters a ``torch.autocast`` region (the
    user's line, each once), filled as it runs."""
    entered: list[str] = []
    enter = torch.amp.autocast_mode.autocast.__enter__

    def recording(self: torch.amp.autocast_mode.autocast) -> torch.amp.autocast_mode.autocast:
        where = user_frame(traceback.extract_stack()[:-1])
        if where not in entered:
            entered.append(where)
        return enter(self)

    torch.amp.autocast_mode.autocast.__enter__ = recording  # type: ignore[method-assign]
    try:
        yield entered
    finally:
        torch.amp.autocast_mode.autocast.__enter__ = enter  # type: ignore[method-assign]


def refuse_outer_autocast(name: str, regions: Sequence[str]) -> None:
    """Raise for a call made under an autocast to a step whose forward has autocast regions
    of its own (``regions``: where it enters them)."""
    if not regions:
        return
    outer = autocast_state()
    if not outer:
        return
    device, dtype = outer[0]
    raise CaptureError(
        f"this call runs under torch.autocast({device!r}, dtype={dtype}), and "
        f"{name}.forward enters autocast regions of its own ({regions[0]}"
        f"{f', and {len(regions) - 1} more' if len(regions) > 1 else ''}): eager runs them "
        "in their own precision under the outer autocast, the compiled step would cast their "
        "ops too. Fix: put the outer autocast inside forward as well (compile a wrapper "
        "module whose forward runs `with torch.autocast(...): return model(...)` in the "
        "model's place, and call it without autocast), or call without autocast. Nothing "
        "ran")
