"""What a checkpoint's state may hold: the values ``torch.load(weights_only=True)`` reads.

A checkpoint is read back without unpickling arbitrary objects (``checkpoint.py``), so a
value that ``weights_only`` refuses made a checkpoint that could be written but never
read: an optimizer built with ``lr=np.float64(0.1)``, an object a model's
``get_extra_state`` returns. Every such checkpoint was then set aside as damaged at resume,
and the run started again from step 0. Now the state is checked as it is saved: numpy's
scalars become Python's (the same numbers), anything else is refused by its place in the
state, before a file is written.

>>> plain_state({"optimizer": {"param_groups": [{"lr": np.float64(0.1)}]}})
{'optimizer': {'param_groups': [{'lr': 0.1}]}}
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from mbcompile.errors import MbcompileError

__all__ = ["CheckpointError", "plain_state"]


class CheckpointError(MbcompileError):
    """A checkpoint cannot be used to resume: written by another run shape, or unreadable;
    or cannot be written (a value it could not read back). Public as
    ``mbcompile.training.checkpoint.CheckpointError``."""

#: Leaves ``weights_only`` reads back (by exact type: a subclass pickles as itself).
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype,
          torch.device, torch.layout, torch.memory_format)


def plain_state(value: Any, where: str = "state") -> Any:
    """``value`` with numpy's scalars as Python's; raises ``CheckpointError`` naming the
    first value ``weights_only`` would refuse (``where``: its place, for the message)."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((k, plain_state(v, f"{where}[{k!r}]")) for k, v in value.items())
    if type(value) in (list, tuple, set):
        return type(value)(plain_state(v, f"{where}[{i}]") for i, v in enumerate(value))
    if type(value).__module__ == "numpy" and hasattr(value, "item") and \
            getattr(value, "shape", None) == ():
        return value.item()  # np.float64(0.1) -> 0.1: the value the optimizer computes with
    raise CheckpointError(
        f"the checkpoint's {where} is a {type(value).__module__}.{type(value).__qualname__}, "
        "which torch.load(weights_only=True) does not read back, so the checkpoint could "
        "never be resumed from; nothing was written. Fix: keep plain Python values, "
        "tensors, lists, tuples and dicts there (an optimizer's lr=float(lr); a model's "
        "get_extra_state returning a dict)")
