"""The files of a prepared set (``lctrain prepare``): flat numpy arrays, memory-mapped, each described in the manifest
by its dtype, its length, its size in bytes and a CRC-32 of every ``CHUNK`` bytes.

A file whose size is not the manifest's (truncated, or another file) is refused when it is opened; a chunk whose
checksum does not match is refused the first time anything in it is read (each chunk is checked once per process,
so reading costs one CRC pass over the bytes read, not a pass over the whole set before the first step). Either
error is one line naming the file and the fix. Nothing is ever read from a chunk that was not checked.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from typing import Any

import numpy as np

CHUNK = 4 << 20  # bytes per checksum
AGAIN = "prepare it again (lctrain prepare with the job's config)"


class ArrayWriter:
    """Appends values of one dtype to a file, checksumming each ``CHUNK`` bytes as they pass."""

    def __init__(self, path: Path, dtype: Any):
        self.path, self.dtype = path, np.dtype(dtype)
        self._file = open(path, "wb")
        self.count, self.crcs = 0, []
        self._crc, self._filled = 0, 0

    def append(self, values: Any) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype).reshape(-1)
        self._file.write(data.tobytes())
        self.count += len(data)
        view = memoryview(data).cast("B")
        while len(view):
            take = min(CHUNK - self._filled, len(view))
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == CHUNK:
                self.crcs.append(self._crc)
                self._crc, self._filled = 0, 0

    def close(self) -> dict[str, Any]:
        """The file's entry of the manifest."""
        if self._filled:
            self.crcs.append(self._crc)
        self._file.close()
        return {
            "dtype": self.dtype.str,
            "count": self.count,
            "bytes": self.count * self.dtype.itemsize,
            "crc32": self.crcs,
        }


class CheckedArray:
    """A file written by ``ArrayWriter``, memory-mapped; ``array[a:b]`` checks the chunks it covers first."""

    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path, self.dtype, self.crcs = path, np.dtype(meta["dtype"]), meta["crc32"]
        if not path.is_file():
            raise FileNotFoundError(f"{path}: a file of the prepared set is missing; {AGAIN}")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise ValueError(
                f"{path}: {size} bytes where the manifest says {meta['bytes']} (truncated or replaced); {AGAIN}"
            )
        count = meta["count"]
        self._data = np.memmap(path, self.dtype, mode="r", shape=(count,)) if count else np.empty(0, self.dtype)
        self._bytes = self._data.view(np.uint8)
        self._checked = bytearray(len(self.crcs))

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, _ = key.indices(len(self._data))
        if stop > start:
            size = self.dtype.itemsize
            for chunk in range(start * size // CHUNK, ((stop * size) - 1) // CHUNK + 1):
                if not self._checked[chunk]:
                    self._check(chunk)
        return self._data[start:stop]

    def _check(self, chunk: int) -> None:
        if zlib.crc32(self._bytes[chunk * CHUNK : (chunk + 1) * CHUNK]) != self.crcs[chunk]:
            raise ValueError(
                f"{self.path}: bytes {chunk * CHUNK}-{min((chunk + 1) * CHUNK, len(self._bytes))} do not match their "
                f"checksum (the file is corrupted); {AGAIN}"
            )
        self._checked[chunk] = 1


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def text_digest(text: str | None) -> str | None:
    """The SHA-256 of a text (a template, a tokenizer's serialisation), in hex; None for None."""
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()
