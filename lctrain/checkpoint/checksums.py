"""``checksums.json``: the SHA-256 and size of every file of a checkpoint, written before the checkpoint is renamed
into place and verified before anything is read from it. Hashing is spread over the ranks (largest files first, to
the least loaded rank), at save and at load."""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lctrain.checkpoint.errors import Problem, all_gather, fix_hint

MANIFEST = "checksums.json"
_MANIFEST_FORMAT = 1
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    with file.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])
    return digest.hexdigest()


def spread(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Each rank's share of the files: the largest first, each to the rank with the fewest bytes so far (ties: the
    lowest rank). The same sizes give the same split on every rank."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [(0, rank) for rank in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(name)
        heapq.heappush(loads, (load + sizes[name], rank))
    return shares


def write_manifest(tmp: Path) -> None:
    """Every rank hashes its share of the files in ``tmp``; rank 0 writes ``checksums.json``. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    listing: list[Any] = [None]
    if rank == 0:
        try:
            listing[0] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        except OSError as error:
            listing[0] = f"cannot list {tmp} to checksum it: {error}"
    dist.broadcast_object_list(listing, src=0)
    if isinstance(listing[0], str):
        raise OSError(listing[0])
    sizes: dict[str, int] = listing[0]
    try:
        local: dict[str, str] | str = {name: _sha256(tmp / name) for name in spread(sizes, world)[rank]}
    except OSError as error:
        local = f"cannot checksum {error.filename}: {error}"
    digests: dict[str, str] = {}
    for result in all_gather(local):
        if isinstance(result, str):
            raise OSError(result)
        digests.update(result)
    if rank == 0:
        files = {name: {"bytes": sizes[name], "sha256": digests[name]} for name in sorted(sizes)}
        manifest = {"format": _MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, tuple[int, str]]:
    """``checksums.json`` of the checkpoint ``path``: file name -> (bytes, sha256)."""
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise FileNotFoundError(
            f"{manifest_file} is missing, so the checkpoint {path} cannot be verified: it was written before "
            f"checkpoints had checksums, or is damaged. Resume from another checkpoint (checkpoint.resume=<its "
            f"directory>), start afresh (checkpoint.resume=none), or delete {path}"
        )
    try:
        manifest = json.loads(manifest_file.read_bytes())
        if manifest["format"] != _MANIFEST_FORMAT or manifest["algorithm"] != "sha256":
            raise ValueError(f"format {manifest['format']!r}, algorithm {manifest['algorithm']!r}")
        files = {}
        for name, entry in manifest["files"].items():
            size, digest = entry["bytes"], entry["sha256"]
            if Path(name).name != name or name in (".", "..", MANIFEST):
                raise ValueError(f"file name {name!r}")
            if not isinstance(size, int) or size < 0 or not isinstance(digest, str) or not _SHA256.match(digest):
                raise ValueError(f"entry {name!r}: {entry!r}")
            files[name] = (size, digest)
        if ".metadata" not in files:
            raise ValueError(".metadata is not listed")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{manifest_file} is corrupted (not a checksum manifest of this format: {error}); {fix_hint(path)}"
        ) from None
    return files


def check_share(path: Path) -> tuple[frozenset[str], list[Problem]]:
    """Read the manifest and check this rank's share of its files; never raises (the caller gathers)."""
    try:
        manifest = read_manifest(path)
    except (ValueError, FileNotFoundError) as error:
        return frozenset(), [((0,), type(error).__name__, str(error))]
    except OSError as error:
        return frozenset(), [((0,), "ValueError", f"{path / MANIFEST} cannot be read: {error}")]
    rank, world = dist.get_rank(), dist.get_world_size()
    problems: list[Problem] = []
    for name in spread({name: size for name, (size, _) in manifest.items()}, world)[rank]:
        file, (size, digest) = path / name, manifest[name]
        try:
            actual = file.stat().st_size
            if actual != size:
                problem = f"it has {actual} bytes and had {size} when saved"
            elif _sha256(file) != digest:
                problem = "its SHA-256 differs from the one recorded when it was saved"
            else:
                continue
            problems.append(((1, name), "ValueError", f"{file} is corrupted ({problem}); {fix_hint(path)}"))
        except FileNotFoundError:
            message = f"{file} is missing: the checkpoint {path} is incomplete or damaged; {fix_hint(path)}"
            problems.append(((1, name), "FileNotFoundError", message))
        except OSError as error:
            problems.append(((1, name), "ValueError", f"{file} cannot be read ({error}); {fix_hint(path)}"))
    return frozenset(manifest), problems
