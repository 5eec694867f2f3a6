"""Reading ``torch.distributed.checkpoint`` (DCP) directories without running code from them.

DCP keeps a checkpoint's index in a ``.metadata`` file that torch's ``FileSystemReader`` reads with ``pickle.load``:
whoever wrote the directory (a downloaded run, a shared disk) could make loading it run any code. A SHA-256
manifest does not help, since the same person writes it. :class:`SafeReader` reads the index with an unpickler that
only builds the classes DCP itself puts there (its metadata dataclasses, ``torch.Size``, dtypes, layouts, paths) and
refuses everything else with a :class:`MiniGPTError`; the tensor data files were already read by torch with
``weights_only=True``.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from minigpt.errors import MiniGPTError

_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a DCP index pickle of torch 2.13 refers to (found with pickletools on DDP and FSDP checkpoints).
ALLOWED_GLOBALS = frozenset({
    (_METADATA, "Metadata"), (_METADATA, "BytesStorageMetadata"), (_METADATA, "ChunkStorageMetadata"),
    (_METADATA, "MetadataIndex"), (_METADATA, "StorageMeta"), (_METADATA, "TensorProperties"),
    (_METADATA, "TensorStorageMetadata"), (_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})


class _IndexUnpickler(pickle.Unpickler):
    """An unpickler that builds only :data:`ALLOWED_GLOBALS` and torch dtypes."""

    def __init__(self, file, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise MiniGPTError(f"{self.where} refers to {module}.{name}, which a training checkpoint never holds; "
                           "refusing to load it (the file may have been crafted to run code)")


def read_index(path, where: str) -> Metadata:
    """The DCP index (``Metadata``) in the file ``path``, read without running code. Raises :class:`MiniGPTError`
    for a global outside :data:`ALLOWED_GLOBALS`, a file that is not an index, or a truncated one."""
    try:
        with open(path, "rb") as f:
            metadata = _IndexUnpickler(f, where).load()
    except MiniGPTError:
        raise
    except Exception as e:  # truncated or garbage bytes: pickle raises many types
        raise MiniGPTError(f"{where} is not a readable checkpoint index ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise MiniGPTError(f"{where} holds a {type(metadata).__name__}, not a checkpoint index")
    return metadata


class SafeReader(FileSystemReader):
    """torch's ``FileSystemReader`` with the index read by :func:`read_index` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        metadata = read_index(path, f"checkpoint index {path}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load(state: dict[str, Any], directory) -> None:
    """``torch.distributed.checkpoint.load(state, ...)`` from ``directory`` through :class:`SafeReader`.

    The index is checked here first: DCP wraps a reader's exception into its own ``CheckpointException`` (with a
    traceback in the message), and a user should see the one-line :class:`MiniGPTError` instead."""
    index = Path(directory) / ".metadata"
    read_index(index, f"checkpoint index {index}")
    torch.distributed.checkpoint.load(state, storage_reader=SafeReader(directory))
