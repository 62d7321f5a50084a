"""Forward's own autocast regions, and the outer autocast a compiled step cannot keep them under.

A forward may set its own precision for part of its work: the loss in float32 (``with
torch.autocast("cpu", enabled=False):``, or a method decorated with it), a block in
float16, or a region entered only when an autocast is on (transformers' ``maybe_autocast``
asks ``torch.is_autocast_enabled()`` first). Both captures record what forward computes at
compile time, where no autocast is on: torch.export a region as explicit casts, torch.fx
as the ops themselves (a region that changes nothing while tracing leaves no mark on the
graph). Called under an outer ``torch.autocast``, eager's region still runs in its own
precision, but the compiled step's ops are all cast by the outer autocast: a float32 loss
region in bfloat16 (loss 1.538868 against eager's 1.538704, float32 logits returned as
bfloat16). So while forward is traced every region it enters is recorded with the state
it sets, and every question it asks about autocast (``autocast_entered``); a call under an
outer autocast that a recorded region would set otherwise on the same device (or that
forward asked about) is refused before anything runs (``refuse_outer_autocast``), naming
the region and the fix: the outer autocast inside forward too (a wrapper module compiled
in the model's place), which both captures keep as explicit casts. A region that sets
what the outer autocast sets already (forward's own bfloat16 under a bfloat16 one), or
another device's, runs as eager does.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .errors import CaptureError
from .forward_modes import autocast_state
from .sources import is_library, user_frame

__all__ = ["Region", "autocast_entered", "refuse_outer_autocast"]


class Region(NamedTuple):
    """Where forward enters an autocast region (``where``, the user's line) and the state it
    sets on ``device``; ``asks``: forward asked whether autocast is on there instead, so
    what it does under an outer autocast was not traced."""

    where: str
    device: str
    enabled: bool = False
    dtype: Any = None
    asks: bool = False

    def kept_under(self, outer: dict[str, Any]) -> bool:
        """Whether the compiled step runs it as eager does under ``outer`` (device ->
        dtype of the autocasts on)."""
        if self.device not in outer:
            return True
        return not self.asks and self.enabled and self.dtype == outer[self.device]


@contextlib.contextmanager
def autocast_entered() -> Iterator[list[Region]]:
    """While the block traces forward: each autocast region it enters and each question it
    asks about autocast (``torch.is_autocast_enabled``), once each, filled as it runs."""
    found: list[Region] = []
    autocast = torch.amp.autocast_mode.autocast
    enter, asked = autocast.__enter__, torch.is_autocast_enabled

    def add(region: Region) -> None:
        if region not in found:
            found.append(region)

    def recording(self: Any) -> Any:
        add(Region(user_frame(traceback.extract_stack()[:-1]), self.device,
                   bool(self._enabled), self.fast_dtype))
        return enter(self)

    def asking(device: Any = "cuda") -> bool:
        caller = sys._getframe(1).f_code.co_filename
        if not is_library(caller):  # (torch's own code asks too: not forward's question)
            add(Region(user_frame(traceback.extract_stack()[:-1]), str(device), asks=True))
        return asked(device)

    autocast.__enter__ = recording  # type: ignore[method-assign]
    torch.is_autocast_enabled = asking  # type: ignore[assignment]
    try:
        yield found
    finally:
        autocast.__enter__ = enter  # type: ignore[method-assign]
        torch.is_autocast_enabled = asked


def refuse_outer_autocast(name: str, regions: Sequence[Region]) -> None:
    """Raise for a call made under an autocast that one of ``regions`` (forward's own,
    ``autocast_entered``) would set otherwise; nothing has run."""
    if not regions:
        return
    outer = dict(autocast_state())
    changed = [r for r in regions if not r.kept_under(outer)]
    if not changed:
        return
    first = changed[0]
    device = first.device
    what = ("asks whether autocast is on" if first.asks else
            f"enters torch.autocast({device!r}, dtype={first.dtype}, enabled={first.enabled})")
    more = f", and {len(changed) - 1} more" if len(changed) > 1 else ""
    raise CaptureError(
        f"this call runs under torch.autocast({device!r}, dtype={outer[device]}), and "
        f"{name}.forward {what} ({first.where}{more}): eager runs its region in its own "
        "precision under the outer autocast, while the compiled step, traced without one, "
        "would cast the region's ops too. Fix: put the outer autocast inside forward as well "
        "(compile a wrapper module whose forward runs `with torch.autocast(...): return "
        "model(...)` in the model's place, and call it without autocast), or call without "
        "autocast. Nothing ran")
