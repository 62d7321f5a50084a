"""Which backend a compile runs on: the launcher's world decides ``backend="auto"``.

Launchers (torchrun, SLURM through torchrun, ``accelerate launch``, DeepSpeed's) start
one process per rank and set up the process group before the model is compiled; that
group is the contract. (Lightning's DDP sets it up in ``fit``, after a module compiled in
``__init__``: that module is simulated, and DDP averages each rank's own batch.) So
``backend="auto"`` (the default) means:

- a process group of more than one rank is initialised: ``"torch.distributed"``, one
  system per rank, so ``num_csx`` must be the world size;
- otherwise (no group, or a group of one): ``"simulated"``, every system in this process.

``"simulated"`` given explicitly under a group of more than one rank is refused: each
rank would train its own model on its own share, and the ranks' weights would drift
apart with no error.

``mbcompile fit`` started by a launcher reads the same contract from the environment
(``RANK`` and ``WORLD_SIZE``, set by torchrun and ``accelerate launch``): it joins the
group the environment describes (``join_launcher_group``) and never launches ranks again.

>>> resolve_backend("auto", 4)  # no process group in this process
'simulated'
"""

from __future__ import annotations

import os

import torch.distributed as dist

from mbcompile.execution import BACKENDS
from mbcompile.passes.errors import InputError

__all__ = ["AUTO", "group_world_size", "join_launcher_group", "launcher_world_size",
           "leave_launcher_group", "resolve_backend", "under_launcher"]

#: The default backend: ranks under an initialised group of several, else simulated.
AUTO = "auto"

#: Whether ``join_launcher_group`` initialised the default group (then this process leaves it).
_joined: list[bool] = [False]


def group_world_size() -> int:
    """The world size of the initialised default process group; 1 when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def under_launcher() -> bool:
    """Whether this process is a rank a launcher started (torchrun, ``accelerate launch``,
    SLURM through torchrun: ``RANK`` and ``WORLD_SIZE`` are set) or one of a process
    group already initialised."""
    initialised = dist.is_available() and dist.is_initialized()
    return initialised or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launcher_world_size() -> int:
    """The ranks the launcher started: the initialised group's world size, else the
    environment's ``WORLD_SIZE``, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    text = os.environ.get("WORLD_SIZE", "1") if "RANK" in os.environ else "1"
    return int(text) if text.isdigit() else 1


def join_launcher_group(backend: str = "gloo") -> int:
    """Join the process group the launcher's environment describes (``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``), unless one is initialised already or
    there is none to join; returns the world size (1 without a group)."""
    if not dist.is_initialized() and launcher_world_size() > 1:
        dist.init_process_group(backend)
        _joined[0] = True
    return group_world_size()


def leave_launcher_group() -> None:
    """Leave the group ``join_launcher_group`` joined, once every rank is done: a barrier,
    then ``destroy_process_group``. A rank that exits with the group alive closes the
    connections the other ranks' gloo threads still use, and one of them can abort at exit
    ("terminate called without an active exception", seen under torchrun on a loaded
    machine). A group the caller initialised is the caller's to end."""
    if _joined[0] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _joined[0] = False


def resolve_backend(backend: str, num_csx: int, world: int | None = None) -> str:
    """``backend`` as it runs: ``"auto"`` resolved from the process group (``world``
    ranks; default: the initialised group's), and a backend that contradicts the group
    refused (``InputError``) before anything is traced."""
    if backend != AUTO and backend not in BACKENDS:
        raise InputError(f"backend must be one of {(AUTO, *BACKENDS)}, got {backend!r}")
    world = group_world_size() if world is None else world
    if world == 1:
        return "simulated" if backend == AUTO else backend
    if backend == "simulated":
        raise InputError(
            f"backend='simulated' runs every system in this process, but this process is one "
            f"of {world} ranks of a process group (a launcher's: torchrun, accelerate launch): "
            "each rank would train its own "
            "model on its own share and the ranks' weights would drift apart. Leave backend at "
            "'auto' (or give 'torch.distributed') to run one system per rank, or compile "
            "outside the launcher (one process) to simulate the systems")
    if num_csx != world:
        raise InputError(
            f"num_csx={num_csx}, but the initialised process group has {world} ranks, and "
            f"under a process group of several ranks each rank is one system "
            f"(backend='torch.distributed'{', chosen by backend=auto' if backend == AUTO else ''}"
            f"): compile with num_csx={world}, or launch {num_csx} ranks (torchrun "
            f"--nproc-per-node {num_csx})")
    return "torch.distributed"
