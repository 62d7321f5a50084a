"""Checkpoints of a training run: written atomically, verified, read back safely.

The RNG states they hold are ``mbcompile.training.rng``'s, their tensors on ranks go through
``mbcompile.training.checkpoint_dcp``; the signals that stop a run
and have it write one are ``mbcompile.training.signals``'.

A checkpoint is one folder under the run's output folder; its name is the global
step it was taken after::

    runs/gpt/checkpoints/
      step-00000010/
        state.pt          model and optimizer state_dicts (one process)
        trainer.json      step, data position, LR scaling, noise scale, config, metrics rows
        rng-rank0.json    RNG states (torch, Python, numpy): now, and where the data pass began
        MANIFEST.json     size and SHA-256 of every other file; written last
      step-00000020/      on torch.distributed ranks, instead of state.pt:
        dcp/              torch.distributed.checkpoint: .metadata, __0_0.distcp, __1_0.distcp
        structure.pt      the two state_dicts with each tensor replaced by its key in dcp/
        rng-rank1.json    one RNG file per rank; a resume on another number of ranks
                          restores rank 0's on every rank (``mbcompile.training.elastic``)

How a checkpoint is written (``CheckpointStore.save``):

1. every file goes into ``.tmp-step-00000020/`` and is fsynced. On ranks each rank
   writes its own part (``torch.distributed.checkpoint`` spreads the replicated
   tensors over the ranks) and its RNG file, and hashes what it wrote;
2. ``MANIFEST.json``, the size and SHA-256 of every file, is written last;
3. the folder is renamed to ``step-00000020`` (atomic on POSIX) and its parent is
   fsynced: a folder with that name is complete, whenever the process dies;
4. all but the newest ``keep`` checkpoints are deleted.

How one is read back (``CheckpointStore.load_newest``): newest first, a checkpoint
whose files do not match its manifest (truncated, corrupt, missing) or do not load
is reported on stderr by its path, renamed to ``step-...damaged`` and the previous
one is tried; one whose files are as written but hold a value ``weights_only`` refuses
is refused (``CheckpointError``), left in place (``save`` checks what it is given:
``checkpoint_values.py``).

Why loading is safe: no file is unpickled with arbitrary globals.
``state.pt`` and ``structure.pt`` are read with ``torch.load(weights_only=True)``
(tensors and plain Python containers and scalars only: everything non-tensor in
them is stored as plain Python types); the ``.json`` files are JSON; DCP reads its
tensors with ``weights_only=True`` itself, and its ``.metadata`` (a pickle, DCP's
own format) is read with an unpickler that admits only DCP's metadata classes,
torch dtypes, ``torch.Size`` and paths. Only tensors go into ``dcp/``, so DCP's
"bytes" entries, which it would unpickle freely, never occur: metadata that holds
one is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch

from mbcompile.training.checkpoint_dcp import (
    DCP,
    Damaged,
    dcp_load,
    read_dcp_metadata,
    split_tensors,
)
from mbcompile.training.checkpoint_values import CheckpointError, plain_state
from mbcompile.training.signals import TrainingInterrupted

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "TrainingInterrupted",  # raised by the Trainer (signals.py); public here, beside the store
    "latest_checkpoint",
    "read_checkpoint",
]

FORMAT = 1  # trainer.json's "format": bump when the layout changes
MANIFEST = "MANIFEST.json"
TRAINER = "trainer.json"
STATE = "state.pt"  # one process
STRUCTURE = "structure.pt"  # ranks: the state_dicts, tensors replaced by their key in dcp/
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
#: ``targets(checkpoint folder, trainer.json)``: the state a sharded run loads into.
Targets = Callable[[Path, Mapping[str, Any]], Any]

#: ``check(checkpoint folder, trainer.json)``: refuses a checkpoint before its state is read.
Check = Callable[[Path, Mapping[str, Any]], Any]


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.json"


# --------------------------------------------------------------------------- #
# Files: durable writes, manifests
# --------------------------------------------------------------------------- #


def _write(path: Path, fill: Callable[[IO[bytes]], Any]) -> None:
    with open(path, "wb") as f:
        fill(f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, value: Any, indent: int | None = 1) -> None:
    _write(path, lambda f: f.write(json.dumps(value, indent=indent).encode()))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _verify(folder: Path) -> None:
    """Raise ``Damaged`` unless every file the manifest lists is there, whole and unchanged."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise Damaged(f"it has no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise Damaged(f"its {MANIFEST} does not parse: {exc}") from None
    for name in (TRAINER, _rng_file(0)):
        if name not in files:
            raise Damaged(f"its manifest does not list {name}")
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise Damaged(f"{name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise Damaged(f"{name} has {size} bytes, the manifest says {want['bytes']} "
                           "(truncated?)")
        if _digest(path)["sha256"] != want["sha256"]:
            raise Damaged(f"{name} does not match its SHA-256 in the manifest (corrupt)")


def _load_torch(path: Path) -> Any:
    # weights_only=True: tensors, plain containers and scalars; never arbitrary objects.
    return torch.load(path, map_location="cpu", weights_only=True)


def control_group() -> Any:
    """A gloo group beside the default one for the trainer's own messages (stop requests,
    checkpoint barriers): CPU tensors, whatever the default backend, with its timeout."""
    import torch.distributed as dist

    timeout = timedelta(minutes=10)
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # another backend, or another torch: keep the default above
        pass
    return dist.new_group(backend="gloo", timeout=timeout)


# --------------------------------------------------------------------------- #
# The store
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint read back: ``state`` holds ``model`` and ``optimizer`` state_dicts,
    ``trainer`` the contents of trainer.json, ``rank`` this rank's RNG file (rank 0's when
    the number of processes changed) and ``world_size`` the processes that wrote it."""

    path: Path
    step: int
    state: Mapping[str, Any]
    trainer: Mapping[str, Any]
    rank: Mapping[str, Any]
    world_size: int = 1


def _complete(folder: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder in ``folder`` (not verified), or None."""
    found = _complete(Path(folder))
    return found[-1][1] if found else None


def _read(path: Path, rank: int = 0, world: int = 1, group: Any = None,
          targets: Targets | None = None, check: Check | None = None) -> Checkpoint:
    trainer = json.loads((path / TRAINER).read_text())
    if trainer.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {trainer.get('format')!r}; this mbcompile "
                              f"reads format {FORMAT}")
    if check is not None:
        check(path, trainer)
    written = int(json.loads((path / MANIFEST).read_text()).get("world_size", 1))
    # another number of processes: every rank restores rank 0's RNG states, the ones the
    # data order was drawn from (the ranks' own files were written for other shares)
    rank_state = json.loads((path / _rng_file(rank if world == written else 0)).read_text())
    if (path / STATE).is_file():
        state = _load_torch(path / STATE)
    else:
        into = None if targets is None else lambda: targets(path, trainer)
        state = dcp_load(path / DCP, _load_torch(path / STRUCTURE), group, into)
    return Checkpoint(path, int(trainer["global_step"]), state, trainer, rank_state, written)


def _unreadable(path: Path, exc: BaseException) -> CheckpointError:
    """A checkpoint whose files are as written but hold a value ``weights_only`` refuses
    (written before ``plain_state`` checked them): kept where it is, named."""
    return CheckpointError(
        f"checkpoint {path} is as it was written, but holds a value torch.load("
        f"weights_only=True) refuses: {str(exc).splitlines()[0]}. It was left in place. "
        "Fix: load it yourself with torch.load(..., weights_only=False) if you trust it, "
        "and save the model and optimizer again with plain values")


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Verify and read the checkpoint folder ``path`` in this process (also one written by
    ranks, whose RNG file of rank 0 it returns); raises ``CheckpointError`` if damaged."""
    path = Path(path)
    try:
        _verify(path)
        return _read(path)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from exc


class CheckpointStore:
    """The checkpoints folder of one run: write atomically, keep the newest ``keep``,
    read back the newest good one. ``group`` is set on torch.distributed ranks."""

    def __init__(self, folder: str | os.PathLike[str], keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.group: Any = None

    def _rank(self) -> tuple[int, int]:
        if self.group is None:
            return 0, 1
        import torch.distributed as dist

        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def complete(self) -> list[tuple[int, Path]]:
        return _complete(self.folder)

    def start_over(self, err: IO[str] | None = None) -> Path | None:
        """A new run in this folder: move the earlier run's checkpoints into
        ``earlier-<time>/`` (kept, never pruned or resumed from) and return it."""
        rank, _ = self._rank()
        moved = None
        found = self.complete()
        if rank == 0 and found:
            moved = self.folder / time.strftime("earlier-%Y%m%d-%H%M%S")
            n = 1
            while moved.exists():
                n += 1
                moved = moved.with_name(time.strftime("earlier-%Y%m%d-%H%M%S") + f"-{n}")
            moved.mkdir()
            for _, path in found:
                os.rename(path, moved / path.name)
            print(f"a new run in {self.folder}: the earlier run's checkpoints (newest "
                  f"{found[-1][1].name}) were moved to {moved}; resume a run to continue it",
                  file=err if err is not None else sys.stderr, flush=True)
        self._barrier()
        return moved

    # --------------------------------------------------------------- writing
    def save(self, step: int, state: Mapping[str, Any], trainer: Mapping[str, Any],
             rank_state: Mapping[str, Any]) -> Path:
        """Write a checkpoint of global step ``step`` and return its folder.

        ``state`` is ``{"model": ..., "optimizer": ...}`` (tensors and plain values),
        ``trainer`` and ``rank_state`` plain JSON-able values; on ranks every rank calls
        this with its own ``rank_state``.
        """
        rank, world = self._rank()
        state = plain_state(dict(state))  # what weights_only reads back, or refused here
        tmp = self.folder / f".tmp-{_step_dir(step)}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        mine = [_rng_file(rank)]
        if world == 1:
            _write(tmp / STATE, lambda f: torch.save(dict(state), f))
            mine.append(STATE)
        else:
            import torch.distributed.checkpoint as dcp

            tensors: dict[str, torch.Tensor] = {}
            structure = split_tensors(dict(state), "", tensors)
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp / DCP),
                     process_group=self.group)
            mine += [f"{DCP}/{p.name}" for p in sorted((tmp / DCP).glob(f"__{rank}_*"))]
            if rank == 0:
                _write(tmp / STRUCTURE, lambda f: torch.save(structure, f))
                mine += [STRUCTURE, f"{DCP}/.metadata"]
        _write_json(tmp / _rng_file(rank), dict(rank_state), indent=None)
        if rank == 0:
            _write_json(tmp / TRAINER, {"format": FORMAT, **trainer})
            mine.append(TRAINER)
        _write_json(tmp / f".manifest-rank{rank}.json", {p: _digest(tmp / p) for p in mine})
        self._barrier()
        final = self.folder / _step_dir(step)
        if rank == 0:
            files: dict[str, Any] = {}
            for r in range(world):
                part = tmp / f".manifest-rank{r}.json"
                files.update(json.loads(part.read_text()))
                part.unlink()
            _write_json(tmp / MANIFEST, {"step": step, "world_size": world,
                                         "files": dict(sorted(files.items()))})
            for folder in (tmp / DCP, tmp):
                if folder.is_dir():
                    _fsync_dir(folder)
            old = None
            if final.exists():  # a damaged or older run's folder of the same step
                old = self.folder / f".old-{_step_dir(step)}-{os.getpid()}"
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(self.folder)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()
        self._barrier()
        return final

    def _prune(self) -> None:
        for _, path in self.complete()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        for p in self.folder.iterdir():  # leftovers of writes that a kill interrupted
            if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
                shutil.rmtree(p, ignore_errors=True)

    # --------------------------------------------------------------- reading
    def _set_aside(self, path: Path, reason: str, err: IO[str]) -> None:
        aside = path.with_name(path.name + ".damaged")
        n = 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{path.name}.damaged{n}")
        try:
            os.rename(path, aside)
            moved = f"; moved to {aside.name}"
        except OSError:
            moved = ""
        print(f"checkpoint {path} is damaged: {reason}{moved}; trying the previous one",
              file=err, flush=True)

    def load_newest(self, err: IO[str] | None = None, targets: Targets | None = None,
                    check: Check | None = None) -> Checkpoint | None:
        """The newest good checkpoint (None if there is none); damaged ones are reported on
        ``err`` (stderr) by path and set aside. On ranks rank 0 chooses, all ranks load;
        ``check(path, trainer_json)`` may refuse it (``CheckpointError``) before its state
        is read; ``targets(path, trainer_json)`` (sharded runs) gives the state whose
        DTensors receive this rank's shards."""
        err = err if err is not None else sys.stderr
        rank, world = self._rank()
        if world == 1:
            for _, path in reversed(self.complete()):
                try:
                    _verify(path)
                    return _read(path, check=check)
                except CheckpointError:
                    raise
                except pickle.UnpicklingError as exc:  # as written (verified): not damaged
                    raise _unreadable(path, exc) from exc
                except Exception as exc:  # truncated, corrupt, unsafe: the previous one
                    self._set_aside(path, str(exc), err)
            return None
        import torch.distributed as dist

        chosen = torch.tensor([-1], dtype=torch.int64)
        if rank == 0:
            for step, path in reversed(self.complete()):
                try:
                    _verify(path)
                    if not (path / STATE).is_file():  # written by ranks (one process: state.pt)
                        read_dcp_metadata(path / DCP)
                        _load_torch(path / STRUCTURE)
                except Exception as exc:
                    self._set_aside(path, str(exc), err)
                    continue
                chosen[0] = step
                break
        dist.broadcast(chosen, src=dist.get_global_rank(self.group, 0), group=self.group)
        if int(chosen) < 0:
            return None
        return _read(self.folder / _step_dir(int(chosen)), rank, world, self.group, targets,
                     check)
