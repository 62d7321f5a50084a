"""Local process groups for tests, benchmarks and ``mbcompile fit --nproc``: ``launch``
runs a function on N gloo ranks of this machine (CPU) and waits for them."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["free_port", "launch"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any],
            args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``nproc`` local gloo ranks (CPU) and wait.

    If a rank raises, the others are stopped and the error is raised here; a rank
    stuck in a collective gives up after ``timeout_s``.
    """
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(nproc, free_port(), timeout_s, fn, args), nprocs=nproc, join=True)
