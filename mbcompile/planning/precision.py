"""The precision a plan assumes: the autocast the step will run under, named as Lightning names it.

>>> parse_precision("bf16-mixed").dtype
torch.bfloat16
>>> parse_precision("32").describe()
'32 (no autocast: activations in the dtype of the model)'

Activations under bf16 or fp16 autocast take half the bytes of float32 ones, so an MBS
planned for float32 is half what fits. The cost model's probes run under the precision's
autocast (``Precision.autocast``), so the plan sees the dtypes the step will see.
``"auto"`` is the autocast ``compile()`` itself runs under (none: ``"32"``); a model
compiled outside its autocast region says ``precision="bf16-mixed"``, or is planned again
on its first call under an autocast the plan did not assume (``CompiledModule``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mbcompile.errors import InputError
from mbcompile.planning.plan_text import describe_precision

__all__ = ["PRECISIONS", "Precision", "ambient_precision", "parse_precision", "probe_precision"]

#: name -> autocast dtype (None: no autocast); Lightning's spellings are aliases
_DTYPES: dict[str, torch.dtype | None] = {
    "32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
_ALIASES = {"32-true": "32", "16-mixed": "fp16-mixed", 32: "32"}
PRECISIONS = ("auto", *_DTYPES)


@dataclass(frozen=True)
class Precision:
    """One precision: its name and the dtype autocast computes in (None: no autocast)."""

    name: str = "32"

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES[self.name]

    def describe(self) -> str:
        return describe_precision(self.name)

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[Any]:
        """The autocast a probe on ``device_type`` tensors runs under: this precision's,
        or autocast switched off (a compile under an ambient autocast that asked for "32")."""
        if device_type not in ("cpu", "cuda"):
            return contextlib.nullcontext()
        if self.dtype is None:
            return torch.autocast(device_type, enabled=False)
        return torch.autocast(device_type, dtype=self.dtype)

    def matches_ambient(self, device_type: str) -> bool:
        """Whether the autocast in force now (on ``device_type``) is this precision's."""
        return ambient_precision(device_type) == self


def ambient_precision(device_type: str) -> Precision:
    """The precision the autocast in force now gives (``"32"`` when none is on)."""
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        for name, d in _DTYPES.items():
            if d == dtype:
                return Precision(name)
    return Precision("32")


def parse_precision(value: Any, device_type: str = "cpu") -> Precision:
    """``compile(precision=...)`` checked: a name of ``PRECISIONS`` (or a Lightning alias);
    ``"auto"`` is the autocast in force now on ``device_type``."""
    if value == "auto":
        return ambient_precision(device_type)
    name = _ALIASES.get(value, value)
    if name not in _DTYPES:
        raise InputError(
            f"precision must be one of {', '.join(map(repr, PRECISIONS))} (Lightning's "
            f"'16-mixed' and '32-true' too), got {value!r}; it names the autocast the step "
            "runs under, so the plan sizes activations in that dtype")
    return Precision(name)


@contextlib.contextmanager
def probe_precision(precision: Precision | None, prober: Any) -> Iterator[None]:
    """The autocast a cost-model probe runs under: ``precision``'s on the device the probed
    graph's tensors live on (``prober.device_type``); None: whatever is in force.

    Each probe starts with autocast's cast cache empty, as a training step does: the
    low-precision copies of the weights are made in its first microbatch and live through
    the step, so they are counted (once), also when compile() itself runs inside an
    autocast region whose cache an earlier probe filled."""
    with contextlib.nullcontext() if precision is None else \
            precision.autocast(getattr(prober, "device_type", "cpu")):
        torch.clear_autocast_cache()
        yield
