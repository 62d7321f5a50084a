"""Checkpoints of a training run: written atomically, verified, read back safely.

The RNG states they hold are ``mbcompile.training.rng``'s; the signals that stop a run
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
one is tried.

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
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch

from mbcompile.errors import MbcompileError
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
DCP = "dcp"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TENSOR_REF = "__dcp_tensor__"  # {"__dcp_tensor__": key}: a tensor stored in dcp/ under key
#: ``targets(checkpoint folder, trainer.json)``: the state a sharded run loads into.
Targets = Callable[[Path, Mapping[str, Any]], Any]

#: ``check(checkpoint folder, trainer.json)``: refuses a checkpoint before its state is read.
Check = Callable[[Path, Mapping[str, Any]], Any]


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.json"


class CheckpointError(MbcompileError):
    """A checkpoint cannot be used to resume: written by another run shape, or unreadable."""


class _Damaged(Exception):
    """A checkpoint folder whose files are not what its manifest says."""


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
    """Raise ``_Damaged`` unless every file the manifest lists is there, whole and unchanged."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise _Damaged(f"it has no {MANIFEST}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise _Damaged(f"its {MANIFEST} does not parse: {exc}") from None
    for name in (TRAINER, _rng_file(0)):
        if name not in files:
            raise _Damaged(f"its manifest does not list {name}")
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise _Damaged(f"{name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise _Damaged(f"{name} has {size} bytes, the manifest says {want['bytes']} "
                           "(truncated?)")
        if _digest(path)["sha256"] != want["sha256"]:
            raise _Damaged(f"{name} does not match its SHA-256 in the manifest (corrupt)")


def _load_torch(path: Path) -> Any:
    # weights_only=True: tensors, plain containers and scalars; never arbitrary objects.
    return torch.load(path, map_location="cpu", weights_only=True)


# --------------------------------------------------------------------------- #
# torch.distributed.checkpoint: tensors only, metadata read with an allowlist
# --------------------------------------------------------------------------- #

_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                      "PurePosixPath", "PureWindowsPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` with only its own classes, dtypes, ``Size`` and paths admitted."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"{module}.{name} is not allowed in a checkpoint's metadata (only tensors are "
            "stored with torch.distributed.checkpoint)")


def read_dcp_metadata(path: Path) -> Any:
    """The ``Metadata`` of the DCP folder ``path``, read with the allowlist."""
    with open(path / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def _safe_reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _split(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with each tensor moved to ``tensors`` and replaced by a reference to it."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {_TENSOR_REF: key}
    if isinstance(value, Mapping):
        return {k: _split(v, f"{key}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_split(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _join(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of ``_split``."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: _join(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_join(v, tensors) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            yield value[_TENSOR_REF]
            return
        for v in value.values():
            yield from _refs(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _refs(v)


def _dcp_load(folder: Path, structure: Any, group: Any,
              targets: Callable[[], Any] | None = None) -> Any:
    """The state ``structure`` describes, its tensors read from ``folder``. Each tensor is
    read whole, or, where ``targets()`` (the current state, like the saved one) has a
    tensor of that key and shape (a sharded run's DTensors), into it: this rank's shard."""
    import torch.distributed.checkpoint as dcp

    metadata = read_dcp_metadata(folder)
    given: dict[str, torch.Tensor] = {}
    if targets is not None:
        _split(targets(), "", given)
    tensors: dict[str, torch.Tensor] = {}
    for key in _refs(structure):
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            raise _Damaged(f"{DCP}/ has no tensor {key!r}")
        target = given.get(key)
        if target is not None and target.shape == md.size \
                and target.dtype == md.properties.dtype:
            tensors[key] = target
        else:
            tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        if group is None:  # reading ranks' checkpoint in one process is what was asked
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(tensors, storage_reader=_safe_reader(folder), process_group=group,
                 no_dist=group is None)
    return _join(structure, tensors)


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
        state = _dcp_load(path / DCP, _load_torch(path / STRUCTURE), group, into)
    return Checkpoint(path, int(trainer["global_step"]), state, trainer, rank_state, written)


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
            structure = _split(dict(state), "", tensors)
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
