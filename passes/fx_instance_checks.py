"""``isinstance(h, torch.Tensor)`` and ``torch.is_tensor(h)`` on a value torch.fx traces.

A traced value is a ``Proxy``, not a tensor: the check answered False where eager answers
True, and a branch on it took the other side, silently (``if isinstance(weight,
torch.Tensor): weight = weight.clamp(max=0.5)`` was skipped: loss 0.8751 against eager's
0.8390).

- ``torch.is_tensor``, a function of torch's, is watched while the trace runs: asked of a
  proxy by the user's code, it answers True, as eager's (``tensor_checks_answered``).
- ``isinstance`` cannot be taught (torch's tensor metaclass is immutable; patching the
  builtin changed what TorchDynamo, which snapshots the builtins, traced later; a proxy
  claiming ``torch.Tensor`` as its ``__class__`` crashed torch's C code). So the user's
  code of the modules the trace runs is read first: ``isinstance(..., torch.Tensor)``
  there is a ``CaptureError`` at its line (``tensor_checks_refused``), and
  ``capture="auto"`` captures with torch.export, whose values are tensors. A check of a
  value that is not traced (a tensor attribute) is refused too: the code cannot tell.
"""

from __future__ import annotations

import contextlib
import dis
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from .errors import CaptureError
from .whose_code import user_code

__all__ = ["tensor_checks_answered", "tensor_checks_refused"]

_IS_TENSOR = torch.is_tensor


@contextlib.contextmanager
def tensor_checks_answered() -> Iterator[None]:
    """While the block traces: ``torch.is_tensor`` of a proxy, asked by the user's code, is
    True (torch's own ``isinstance`` inside it would see the proxy's type)."""

    def is_tensor(obj: Any) -> bool:
        if isinstance(obj, fx.Proxy) and user_code(sys._getframe(1).f_code.co_filename):
            return True
        return _IS_TENSOR(obj)

    torch.is_tensor = is_tensor
    try:
        yield
    finally:
        torch.is_tensor = _IS_TENSOR


def tensor_checks_refused(model: torch.nn.Module, model_name: str) -> None:
    """A ``CaptureError`` where the user's code of ``model``'s modules (their ``forward``
    and the methods of their classes) asks ``isinstance(..., torch.Tensor)``."""
    seen: set[int] = set()
    for cls in {type(m) for m in model.modules()}:
        for value in vars(cls).values():
            code = getattr(value, "__code__", None)
            if isinstance(code, types.CodeType) and user_code(code.co_filename):
                line = _checks_tensor(code, seen)
                if line is not None:
                    raise CaptureError(
                        f"{model_name}.forward may ask isinstance(..., torch.Tensor) of a "
                        f"traced value ({line}); torch.fx traces symbols, not tensors, so "
                        "the answer would be False where eager's is True, and a branch on "
                        "it would go the other way. Fix: compile with capture='export' "
                        "(capture='auto' does), or decide it outside forward (pass the "
                        "value or None)")


def _checks_tensor(code: types.CodeType, seen: set[int]) -> str | None:
    """``file:line`` of an ``isinstance`` call naming ``Tensor`` in ``code`` (or a function
    nested in it), else None."""
    if id(code) in seen:
        return None
    seen.add(id(code))
    pending: int | None = None  # the line of an isinstance whose call is open
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval == "isinstance":
            pending = ins.positions.lineno if ins.positions else None
        elif pending is not None and ins.argval == "Tensor" and ins.opname in (
                "LOAD_ATTR", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_METHOD"):
            return f"{code.co_filename}:{pending}"
        elif ins.opname.startswith("CALL"):
            pending = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found = _checks_tensor(const, seen)
            if found is not None:
                return found
    return None
