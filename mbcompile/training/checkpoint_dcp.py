"""Checkpoints on ranks: the tensors of a state go through ``torch.distributed.checkpoint``
(DCP), and only tensors, so that reading one back never unpickles arbitrary objects.

``split_tensors`` takes the tensors out of a state (each replaced by a reference to its
key) for ``dcp.save``; ``dcp_load`` reads them back, each into the current state's
tensor of that key where there is one (a sharded run's DTensors: this rank's shard),
and ``join_tensors`` puts them back in place. DCP's ``.metadata`` is a pickle: it is
read with an unpickler that admits only DCP's metadata classes, torch dtypes,
``torch.Size`` and paths (``read_dcp_metadata``).

>>> tensors = {}
>>> structure = split_tensors({"w": torch.ones(2), "step": 3}, "", tensors)
>>> structure, list(tensors)
({'w': {'__dcp_tensor__': '/w'}, 'step': 3}, ['/w'])
>>> join_tensors(structure, tensors)["w"]
tensor([1., 1.])
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["DCP", "Damaged", "dcp_load", "join_tensors", "read_dcp_metadata", "split_tensors"]

DCP = "dcp"  # the folder of a checkpoint that holds DCP's files
_TENSOR_REF = "__dcp_tensor__"  # {"__dcp_tensor__": key}: a tensor stored in dcp/ under key


class Damaged(Exception):
    """A checkpoint's files are incomplete, corrupt or do not load (the store sets it aside)."""



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


def split_tensors(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` with each tensor moved to ``tensors`` and replaced by a reference to it."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value
        return {_TENSOR_REF: key}
    if isinstance(value, Mapping):
        return {k: split_tensors(v, f"{key}/{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [split_tensors(v, f"{key}/{i}", tensors) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def join_tensors(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of ``split_tensors``."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: join_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [join_tensors(v, tensors) for v in value]
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


def dcp_load(folder: Path, structure: Any, group: Any,
              targets: Callable[[], Any] | None = None) -> Any:
    """The state ``structure`` describes, its tensors read from ``folder``. Each tensor is
    read whole, or, where ``targets()`` (the current state, like the saved one) has a
    tensor of that key and shape (a sharded run's DTensors), into it: this rank's shard."""
    import torch.distributed.checkpoint as dcp

    metadata = read_dcp_metadata(folder)
    given: dict[str, torch.Tensor] = {}
    if targets is not None:
        split_tensors(targets(), "", given)
    tensors: dict[str, torch.Tensor] = {}
    for key in _refs(structure):
        md = metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "size"):
            raise Damaged(f"{DCP}/ has no tensor {key!r}")
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
    return join_tensors(structure, tensors)
