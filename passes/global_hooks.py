"""Global module hooks (``register_module_forward_hook`` and its kin) while mbcompile works.

torch calls a global module hook on every module's call: while compile probes the model
on made-up data (the shape probe, the copies that check a layer's hooks, the cost probe),
on mbcompile's own modules (the rewritten graph, its microbatch body), and on each
microbatch's call of a layer the graph calls as one node. Of these, eager makes only the
last, once per step on the whole batch. So:

- ``hidden()``: while compile runs, the global hooks are taken out of torch's tables (and
  put back, in their order, after it), so no probe calls one;
- ``shown()``: inside that, the capture's trace sees them (fx calls them on the modules it
  traces through, and their writes are replayed once per step, as a hook of the user's
  module is);
- in a step, ``mbcompile.execution.live_hooks.watch_global_hooks`` calls them on the
  user's layers only.

Example::

    with hidden():              # compile()
        ...                     # probes: no global hook runs
        with shown():
            tracer.trace(model)  # the hooks are traced on the modules fx enters
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch.nn.modules import module as module_globals

from .hook_tables import refill

__all__ = ["BACKWARD", "FORWARD", "forward_hooks", "hidden", "module_tracker", "shown", "tables"]

#: torch's tables of global module hooks, by kind
FORWARD = (module_globals._global_forward_pre_hooks, module_globals._global_forward_hooks)
BACKWARD = (module_globals._global_backward_pre_hooks, module_globals._global_backward_hooks)
tables = (*FORWARD, *BACKWARD)

_stashed: list[list[dict[int, Any]]] = []  # per ``hidden()`` block: what it took out


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """No global module hook runs in the block; after it, each is back in its place (one
    registered inside the block comes after them)."""
    saved = [dict(table) for table in tables]
    for table in tables:
        table.clear()
    _stashed.append(saved)
    try:
        yield
    finally:
        _stashed.pop()
        for table, before in zip(tables, saved):
            refill(table, before)


@contextlib.contextmanager
def shown() -> Iterator[None]:
    """Inside ``hidden()``: the hooks it took out run again in the block (a capture's trace);
    one removed in the block stays removed."""
    if not _stashed:
        yield
        return
    saved = _stashed[-1]
    for table, before in zip(tables, saved):
        refill(table, before)
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            for key in list(before):
                if key in table:
                    before[key] = table.pop(key)
                else:  # removed while shown
                    del before[key]


def forward_hooks() -> list[Any]:
    """The global forward (pre-)hooks registered, shown or hidden."""
    found = [fn for table in FORWARD for fn in table.values()]
    for saved in _stashed:
        found += [fn for table in saved[:len(FORWARD)] for fn in table.values()]
    return found


def module_tracker() -> bool:
    """Whether torch's ``torch.utils.module_tracker.ModuleTracker`` has its global forward
    hooks registered (``FlopCounterMode`` enters one), seen through the wrappers a call
    puts around them (``fn``, ``__wrapped__``): two truth tests when no global hook is."""
    for table in FORWARD:
        for fn in table.values():
            for _ in range(4):  # the call's, the step's, dynamo's, a per_microbatch mark
                inner = getattr(fn, "fn", None) or getattr(fn, "__wrapped__", None)
                if inner is None or inner is fn:
                    break
                fn = inner
            if getattr(fn, "__module__", "") == "torch.utils.module_tracker":
                return True
    return False
