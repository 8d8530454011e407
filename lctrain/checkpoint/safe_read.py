"""Reading DCP files without running code from them.

In torch 2.13, DCP's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load`` and its ``DefaultLoadPlanner``
reads non-tensor entries (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``: either would run
any code a crafted file asks for. Here ``.metadata`` is read by an unpickler that resolves only DCP's metadata
classes, ``torch.Size``, dtypes, layouts and paths, and the non-tensor entries with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lctrain.checkpoint.errors import fix_hint

# what a DCP .metadata pickle may name (torch 2.13); besides these, torch dtypes (torch.float32, ...)
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath", "Path")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP metadata is made of, so a crafted ``.metadata`` cannot call anything else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata does not hold")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Metadata:
    metadata_file = path / ".metadata"
    try:
        with metadata_file.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    except Exception as error:
        raise ValueError(
            f"{metadata_file} cannot be read safely ({error}); the checkpoint {path} is damaged or was not "
            f"written by lctrain; {fix_hint(path)}"
        ) from None
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata, which lctrain never writes
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``weights_only=True`` (DCP's own uses ``False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        # hand DCP the checked object, re-serialized by us: its torch.load then only rebuilds plain data
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)
