"""How forward's code reads a container it loads: the constant keys it goes through, and
whether what it reaches there is only appended to or written.

A list forward appends to is replayed once per step (``side_effects.Extend``); its length
read in the same forward (``len(self.history)``, ``len(self.box["seen"])``) would be fixed
by the trace, so ``guards.unwritten`` refuses such a read. This tells the reads from the
appends and writes, from the bytecode after the load (once per code object).

>>> import dis
>>> ins = list(dis.get_instructions(lambda s: s.box["seen"].append(1)))
>>> load = next(i for i, x in enumerate(ins) if x.argval == "box")
>>> path_after(ins, load + 1) is None
True
>>> ins = list(dis.get_instructions(lambda s: len(s.box["seen"])))
>>> load = next(i for i, x in enumerate(ins) if x.argval == "box")
>>> path_after(ins, load + 1)
('seen',)
"""

from __future__ import annotations

import dis
from typing import Any

__all__ = ["at", "path_after"]


def path_after(ins: list[dis.Instruction], n: int) -> tuple[Any, ...] | None:
    """For a load just before ``ins[n]``: the constant keys the code subscripts it with
    before using what it reached (``()``: the value itself), or None where that is only
    appended to (``.append``, ``.extend``) or written (``x["k"] = v``, ``x["k"] += 1``)."""
    path: list[Any] = []
    while n + 1 < len(ins) and ins[n].opname == "LOAD_CONST" and \
            ins[n + 1].opname == "BINARY_SUBSCR":
        path.append(ins[n].argval)
        n += 2
    if n >= len(ins):
        return tuple(path)
    if ins[n].opname in ("LOAD_METHOD", "LOAD_ATTR") and ins[n].argval in ("append", "extend"):
        return None
    return None if ins[n].opname == "LOAD_CONST" else tuple(path)  # a key written


def at(value: Any, path: tuple[Any, ...]) -> Any:
    """``value[k1][k2]...`` for ``path``, or None where a key is missing."""
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value
