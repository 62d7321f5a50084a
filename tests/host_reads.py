"""Count the host-device synchronisations a piece of code makes.

A read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``,
``torch.equal``) reaches the dispatcher as ``_local_scalar_dense``,
``is_nonzero`` or ``equal``; a packed vector read at once goes through
``mbcompile.execution.runtime.read_host`` (``tolist()`` reads memory without dispatching),
so that is counted too. On a GPU each of these stalls the launch queue.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mbcompile.execution import runtime

SYNC_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal")


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...``; then ``reads.total`` and ``reads.ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = str(func.overloadpacket)
        if name in SYNC_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        self._real = runtime.read_host

        def counted(t: torch.Tensor) -> list[float]:
            self.ops["mbcompile.execution.runtime.read_host"] += 1
            return self._real(t)

        runtime.read_host = counted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        runtime.read_host = self._real
        return super().__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())
