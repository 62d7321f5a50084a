"""Local process groups for tests, benchmarks and ``mbcompile fit --nproc``: ``launch``
runs a function on N gloo ranks of this machine (CPU) and waits for them.

The ranks are forked from multiprocessing's forkserver, which imports torch and mbcompile
once (``set_forkserver_preload``): a spawned rank imports them itself, 3-4 s of CPU per
rank, which was most of a short run's time. The forkserver is a clean single-threaded
process, so forking from it is as safe as spawning. It keeps the environment and working
folder of its start, so each rank takes the caller's current ones from ``launch``, and
writes to the caller's current stdout and stderr (passed as descriptors).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import socket
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["free_port", "launch"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a rank imports before it runs: the forkserver imports these once for every launch.
PRELOAD = ("torch", "torch.distributed", "mbcompile.compiler", "mbcompile.execution.ranks")


class _CallerStdio:
    """Pickled into a forked rank's arguments: the caller's stdout and stderr at ``launch``
    travel as duplicated descriptors (multiprocessing's ``DupFd``), and the rank writes to
    them, as a spawned child would, not to where the forkserver's pointed when it began."""

    def __reduce__(self) -> tuple[Any, ...]:
        sys.stdout.flush()
        sys.stderr.flush()
        return _attach_stdio, (multiprocessing.reduction.DupFd(1),
                               multiprocessing.reduction.DupFd(2))


def _attach_stdio(out: Any, err: Any) -> None:
    for fd, dup in ((1, out), (2, err)):
        received = dup.detach()
        os.dup2(received, fd)
        os.close(received)


def _worker(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any],
            args: tuple[Any, ...], here: tuple[str, Mapping[str, str], Any] | None = None
            ) -> None:
    if here is not None:  # the caller's folder and environment, not the forkserver's
        cwd, environment, _ = here  # its stdio was attached when the arguments unpickled
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environment)
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

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":  # once started, the forkserver keeps its first list
        module = getattr(fn, "__module__", None)
        extra = (module,) if module and module != "__main__" else ()
        multiprocessing.forkserver.set_forkserver_preload([*PRELOAD, *extra])
    here = (os.getcwd(), dict(os.environ), _CallerStdio() if method == "forkserver" else None)
    mp.start_processes(_worker, args=(nproc, free_port(), timeout_s, fn, args, here),
                       nprocs=nproc, join=True, start_method=method)
