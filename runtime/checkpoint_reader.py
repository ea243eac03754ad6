"""Reading DCP's `.metadata` without running code from the checkpoint.

DCP's FileSystemReader reads `.metadata` with `pickle.load`: a crafted file runs whatever its
`__reduce__` names. Here it is read by `MetadataUnpickler`, whose `find_class` admits only the
types a DCP metadata pickle is made of (DCP's metadata dataclasses, torch.Size, dtypes, layouts,
paths) and refuses every other global, so no function outside that list can be called.
`SafeReader` is a FileSystemReader that reads metadata this way; the tensor data it then reads
goes through DCP's own `torch.load(..., weights_only=True)`, itself a restricted unpickler.
`BytesStorageMetadata` is not admitted: DCP loads an entry of that kind with
`torch.load(..., weights_only=False)`, so a crafted `.metadata` that declared one of our keys as
bytes would run the pickle in a data file; autoplan saves only tensors, so it never writes one
(and `read_dcp_metadata` refuses any entry that is not a tensor's).

Why this rather than DCP's Hugging Face (safetensors) storage, which keeps its metadata in JSON
headers: that changes the on-disk format (the checkpoints saved so far would no longer load),
needs the `safetensors` package, and its reader and writer arguments have changed between
torch releases (a private `_hf_storage` module before the public `hf_storage`), while
FileSystemReader, `read_metadata` and the metadata classes named here are DCP's long-standing
default path (checked on torch 2.13). If a torch release pickles another type into `.metadata`,
loading is refused with a message naming it (`ALLOWED` then needs that name), never unpickled
unchecked.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from autoplan.runtime.checkpoint_files import CheckpointError

DCP_METADATA = ".metadata"
_META = "torch.distributed.checkpoint.metadata"
ALLOWED = frozenset({
    (_META, "Metadata"), (_META, "TensorStorageMetadata"),  # not BytesStorageMetadata: above
    (_META, "TensorProperties"), (_META, "ChunkStorageMetadata"), (_META, "MetadataIndex"),
    (_META, "StorageMeta"), (_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of a layout by its name
    ("collections", "OrderedDict"),
    # StorageMeta.checkpoint_id may be a path; constructing one touches no file
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"), ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
})


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside `ALLOWED` (and torch's dtypes) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a type of DCP's metadata")
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("DCP's metadata has no persistent ids")


def read_dcp_metadata(directory: Path, rank: int | None = None) -> Metadata:
    """DCP's `.metadata` (or a rank's `__<rank>.metadata`) of a checkpoint, read by
    MetadataUnpickler; CheckpointError naming the file and the reason otherwise."""
    name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
    path = Path(directory) / name
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError) as exc:  # what a damaged or crafted pickle raises
        raise CheckpointError(f"cannot read {str(path)!r} as DCP checkpoint metadata "
                              f"({type(exc).__name__}: {exc}); nothing of it was run. Load only "
                              f"checkpoints that autoplan saved") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{str(path)!r} holds a {type(metadata).__name__}, not DCP "
                              f"checkpoint metadata; load only checkpoints that autoplan saved")
    others = sorted(k for k, v in metadata.state_dict_metadata.items()
                    if not isinstance(v, TensorStorageMetadata))
    if others:  # DCP would torch.load them with weights_only=False
        raise CheckpointError(f"{str(path)!r} declares entries that are not tensors "
                              f"({others[:3]}); autoplan saves only tensors: refusing it")
    return metadata


def storage_files(metadata: Metadata) -> set[str]:
    """The files (relative paths) the metadata says the tensors are in."""
    return {info.relative_path for info in metadata.storage_data.values()}


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through MetadataUnpickler; `metadata`: one
    already read (and checked), returned instead of reading the file again."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self._metadata
        if metadata is None or rank is not None:
            metadata = read_dcp_metadata(Path(self.path), rank)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata
