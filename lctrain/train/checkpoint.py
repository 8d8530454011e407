"""Distributed checkpoints: ``<run_dir>/checkpoints/step_XXXXXXXX/``, written atomically, checksummed, and read
without running code from the files.

Model and optimizer state go through ``torch.distributed.checkpoint`` (each rank writes its shards; loading works
for any FSDP layout). What differs per rank (data loader position, RNG states) and the small plain state (step,
scheduler, the mesh) go to ``rank_XXXXX.pt``, read back with ``weights_only=True``. Everything is written into
``step_XXXXXXXX.tmp``; once every rank is done, rank 0 renames it to ``step_XXXXXXXX``. A directory without the
``.tmp`` suffix is therefore complete, and a crash mid-save leaves only a ``.tmp`` directory, which is never resumed
from and is deleted by the next save.

**Integrity.** DCP keeps no checksums: a flipped byte in a ``.distcp`` file would load silently. So before the
rename, the SHA-256 and size of every file of the checkpoint (the DCP data files, ``.metadata``, each
``rank_XXXXX.pt``) go into ``checksums.json``, which rank 0 writes last: a complete checkpoint always has it. The
hashing is spread over the ranks: rank 0 lists the files (DCP's ``__{rank}_{i}.distcp`` naming is private, so it
is not relied on) and each rank hashes its share, the largest files first to the least loaded rank, so that each
hashes about the same number of bytes. The check at load (``Checkpointer.verify``, run once per checkpoint by the
first ``read_extra`` or ``load``, before anything else is read from it) is split the same way. Each byte is hashed
once at save and once at load, across all ranks: 0.75 s per GB and rank on the 2-core development machine, files
in the page cache (a 0.8 GB checkpoint: 3.9 s to save, 0.6 s of it hashing; 0.6 s to verify, then 0.7 s to load,
which reads the files a second time, usually from the page cache). The results of all ranks are gathered, so every
rank raises the same error and none is left waiting in a collective: a file whose size or hash differs is a
``ValueError`` naming it as corrupted, a listed file that is gone is a ``FileNotFoundError`` naming it, and so is a
missing ``checksums.json`` (a checkpoint written before checksums, or damaged). ``load`` also checks that
``.metadata`` refers only to checksummed files.

**Mismatch.** ``load`` compares the checkpoint's keys and shapes with the model's before loading (across all
ranks, whatever each holds with pipeline parallelism): a weight of another shape, a weight the checkpoint lacks or
one the model lacks is a ``ValueError`` naming the checkpoint, the first such key (with both shapes) and the fix
(the ``model.*`` settings of the run that saved it). Whatever DCP still refuses (its ``CheckpointException``, a
``BaseException`` raised on every rank) becomes a ``ValueError`` naming the checkpoint.

**No code from the files.** Checksums cannot stop a malicious checkpoint: ``checksums.json`` lies beside the files
it vouches for. What matters is how the files are deserialized. In torch 2.13, DCP's ``FileSystemReader`` reads
``.metadata`` with plain ``pickle.load`` and its ``DefaultLoadPlanner`` reads non-tensor entries (the optimizer's
hyperparameters) with ``torch.load(weights_only=False)``: either would run any code a crafted file asks for, and
torch offers no safe option for them. ``load`` therefore reads ``.metadata`` with ``_MetadataUnpickler``, an
unpickler that resolves only DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths, and the non-tensor
entries with ``weights_only=True`` (``_WeightsOnlyLoadPlanner``); DCP already reads tensor data with
``weights_only=True``, and so does ``read_extra``.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
# one key per parameter (its Hugging Face name) for the optimizer state and hyperparameters too, so each pipeline
# stage saves its own keys and any pp degree loads them (nested param_groups would keep only one rank's)
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

MANIFEST = "checksums.json"
_MANIFEST_FORMAT = 1
_CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
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


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: p.name)


class Checkpointer:
    """Save and load (model, optimizer, per-rank extras) under ``root``, keeping the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int):
        self.root = Path(root)
        self.keep = keep
        self._verified: dict[Path, frozenset[str]] = {}  # checkpoint -> the files its manifest lists

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Path:
        """Every rank calls this. ``extra`` is this rank's plain state (ints, floats, lists, dicts, tensors)."""
        rank = dist.get_rank()
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + ".tmp")
        if rank == 0:
            for stale in self.root.glob("step_*.tmp"):
                shutil.rmtree(stale)  # a save that crashed before
            tmp.mkdir(parents=True)
        dist.barrier()
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        dcp.save(state, checkpoint_id=str(tmp))
        torch.save(extra, tmp / f"rank_{rank:05d}.pt")
        dist.barrier()
        _write_manifest(tmp)
        if rank == 0:
            if final.exists():  # the same step from an earlier run in this directory (checkpoint.resume=none)
                shutil.rmtree(final)
            tmp.rename(final)
            for old in complete_checkpoints(self.root)[: -self.keep]:
                shutil.rmtree(old)
        dist.barrier()
        return final

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def verify(self, path: str | Path) -> frozenset[str]:
        """Check every file of the checkpoint ``path`` against its ``checksums.json`` (once per checkpoint; returns
        the files it lists). Collective: every rank calls it with the same path, and every rank raises the same
        ``ValueError`` (a corrupted file or manifest) or ``FileNotFoundError`` (a missing file or manifest)."""
        path = _complete(path)
        key = path.resolve()
        if key not in self._verified:
            files, problems = _check_share(path)
            _raise_first(_all_gather(problems))
            self._verified[key] = files
        return self._verified[key]

    def read_extra(self, path: str | Path, rank: int) -> dict[str, Any]:
        """The extras that ``rank`` saved in the checkpoint ``path``. Collective: every rank calls it with the same
        path (``rank`` may differ), and if any rank cannot read its file, every rank raises that error."""
        path = _complete(path)
        files = self.verify(path)
        extra_file = path / f"rank_{rank:05d}.pt"
        extra, problems = None, []
        if extra_file.name not in files:
            message = f"{extra_file} is missing: the checkpoint {path} is incomplete or damaged"
            problems.append(((dist.get_rank(),), "FileNotFoundError", message))
        else:
            try:
                extra = torch.load(extra_file, weights_only=True)
            except Exception as error:
                message = (
                    f"{extra_file} cannot be read as a checkpoint's extras ({_first_line(error)}): the checkpoint "
                    f"{path} is damaged or was not written by lctrain; {_fix(path)}"
                )
                problems.append(((dist.get_rank(),), "ValueError", message))
        _raise_first(_all_gather(problems))
        return extra

    def load(self, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Load ``path`` into the model and optimizer: any FSDP layout and any pipeline split (names are the
        Hugging Face ones), so the mesh may differ from the one that saved it. Every rank calls it; a damaged
        checkpoint or one of another model raises the same error on every rank."""
        path = _complete(path)
        files = self.verify(path)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS),
        }
        _check_matches(path, files, state)
        try:
            dcp.load(state, storage_reader=_SafeReader(path), planner=_WeightsOnlyLoadPlanner())
        except CheckpointException as error:  # a BaseException, raised on every rank
            rank, (exc, _) = min(error.failures.items(), key=lambda item: item[0])
            raise ValueError(
                f"{path} could not be loaded (rank {rank}: {type(exc).__name__}: {_first_line(exc)}): the checkpoint "
                f"is damaged, or does not match this model (the model.* settings must match the run that saved "
                f"it{_config_hint(path)})"
            ) from None
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_OPTIM_OPTIONS)


def _complete(path: str | Path) -> Path:
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no .metadata): pass a step_XXXXXXXX directory, or "
            f"checkpoint.resume=auto to take the latest complete one"
        )
    return path


# --- checksums ------------------------------------------------------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _fix(path: Path) -> str:
    return (
        f"resume from an earlier checkpoint (checkpoint.resume=<its directory>) or delete {path} "
        f"(checkpoint.resume=auto then takes the newest one left)"
    )


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK))
    with file.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(buffer[:n])
    return digest.hexdigest()


def _spread(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Each rank's share of the files: the largest first, each to the rank with the fewest bytes so far (ties: the
    lowest rank). The same sizes give the same split on every rank."""
    shares: list[list[str]] = [[] for _ in range(world)]
    loads = [(0, rank) for rank in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(loads)
        shares[rank].append(name)
        heapq.heappush(loads, (load + sizes[name], rank))
    return shares


def _all_gather(obj: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# A problem found by one rank: (sort key, exception type name, message). Every rank raises the smallest one found.
_Problem = tuple[tuple, str, str]
_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def _raise_first(gathered: list[list[_Problem]]) -> None:
    problems = sorted(problem for rank_problems in gathered for problem in rank_problems)
    if problems:
        _, kind, message = problems[0]
        if len(problems) > 1:
            message += f" ({len(problems) - 1} more problem(s) found in the same checkpoint)"
        raise _ERRORS[kind](message)


def _write_manifest(tmp: Path) -> None:
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
        local: dict[str, str] | str = {name: _sha256(tmp / name) for name in _spread(sizes, world)[rank]}
    except OSError as error:
        local = f"cannot checksum {error.filename}: {error}"
    digests: dict[str, str] = {}
    for result in _all_gather(local):
        if isinstance(result, str):
            raise OSError(result)
        digests.update(result)
    if rank == 0:
        files = {name: {"bytes": sizes[name], "sha256": digests[name]} for name in sorted(sizes)}
        manifest = {"format": _MANIFEST_FORMAT, "algorithm": "sha256", "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _read_manifest(path: Path) -> dict[str, tuple[int, str]]:
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
            f"{manifest_file} is corrupted (not a checksum manifest of this format: {error}); {_fix(path)}"
        ) from None
    return files


def _check_share(path: Path) -> tuple[frozenset[str], list[_Problem]]:
    """Read the manifest and check this rank's share of its files; never raises (the caller gathers)."""
    try:
        manifest = _read_manifest(path)
    except (ValueError, FileNotFoundError) as error:
        return frozenset(), [((0,), type(error).__name__, str(error))]
    except OSError as error:
        return frozenset(), [((0,), "ValueError", f"{path / MANIFEST} cannot be read: {error}")]
    rank, world = dist.get_rank(), dist.get_world_size()
    problems: list[_Problem] = []
    for name in _spread({name: size for name, (size, _) in manifest.items()}, world)[rank]:
        file, (size, digest) = path / name, manifest[name]
        try:
            actual = file.stat().st_size
            if actual != size:
                problem = f"it has {actual} bytes and had {size} when saved"
            elif _sha256(file) != digest:
                problem = "its SHA-256 differs from the one recorded when it was saved"
            else:
                continue
            problems.append(((1, name), "ValueError", f"{file} is corrupted ({problem}); {_fix(path)}"))
        except FileNotFoundError:
            message = f"{file} is missing: the checkpoint {path} is incomplete or damaged; {_fix(path)}"
            problems.append(((1, name), "FileNotFoundError", message))
        except OSError as error:
            problems.append(((1, name), "ValueError", f"{file} cannot be read ({error}); {_fix(path)}"))
    return frozenset(manifest), problems


# --- reading DCP files safely ---------------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only what DCP metadata is made of, so a crafted ``.metadata`` cannot call anything else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata does not hold")
        return super().find_class(module, name)


def _read_metadata(path: Path) -> Metadata:
    metadata_file = path / ".metadata"
    try:
        with metadata_file.open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP metadata")
    except Exception as error:
        raise ValueError(
            f"{metadata_file} cannot be read safely ({error}); the checkpoint {path} is damaged or was not "
            f"written by lctrain; {_fix(path)}"
        ) from None
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with ``_MetadataUnpickler`` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # DCP's fallback to per-rank metadata, which lctrain never writes
            raise FileNotFoundError(f"{self.path}: no per-rank metadata")
        metadata = _read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``weights_only=True`` (DCP's own uses ``False``)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        # hand DCP the checked object, re-serialized by us: its torch.load then only rebuilds plain data
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


# --- does the checkpoint fit the model? -----------------------------------------------------------------------------


def _shape(size: Any) -> str:
    return str(list(size))


def _describe(key: str) -> str:
    """A DCP key as the message names it: ``model.<HF name>`` for weights, ``optim.<flat key>`` for the rest."""
    top, _, name = key.partition(".")
    return f"weight {name}" if top == "model" else f"optimizer entry {name}"


def _config_hint(path: Path) -> str:
    config = path.parent.parent / "config.yaml"
    return f" (they are in {config})" if config.is_file() else ""


def _local_mismatches(path: Path, files: frozenset[str], state: dict[str, Any]) -> tuple[list[_Problem], list[str]]:
    """This rank's first key that does not fit the checkpoint (at most one problem), and its weight keys."""
    metadata = _read_metadata(path)
    outside = sorted({info.relative_path for info in metadata.storage_data.values()} - files)
    if outside:
        message = (
            f"{path / '.metadata'} refers to {outside[0]}, which is not among the files checksummed in "
            f"{path / MANIFEST}: the checkpoint is damaged; {_fix(path)}"
        )
        return [((0,), "ValueError", message)], []
    saved = metadata.state_dict_metadata
    expected = {f"{top}.{key}": value for top in ("model", "optim") for key, value in state[top].items()}  # as DCP's
    problems: list[_Problem] = []
    for index, (key, value) in enumerate(expected.items()):
        if not isinstance(value, torch.Tensor):
            continue  # plain optimizer hyperparameters: DCP checks those
        order = (1 if key.startswith("model.") else 3, dist.get_rank(), index)
        md = saved.get(key)
        if md is None:
            problems.append((order, "ValueError", f"it has no {_describe(key)}, which this model has"))
        elif not isinstance(md, TensorStorageMetadata):
            problems.append((order, "ValueError", f"its {_describe(key)} is not a tensor"))
        elif list(md.size) != list(value.shape):
            message = f"its {_describe(key)} has shape {_shape(md.size)} and this model's {_shape(value.shape)}"
            problems.append((order, "ValueError", message))
        else:
            continue
        break  # the first one of this rank
    # the checkpoint's weights that no rank's model may have (the union is known after the gather)
    unknown = [key for key in saved if key.startswith("model.") and key not in expected]
    return problems, unknown


def _check_matches(path: Path, files: frozenset[str], state: dict[str, Any]) -> None:
    """Raise on every rank if the checkpoint does not hold exactly this model's weights (the union of all ranks'
    with pipeline parallelism), with these shapes. Collective."""
    try:
        local = _local_mismatches(path, files, state)
    except ValueError as error:
        local = ([((0,), "ValueError", str(error))], [])
    except Exception as error:  # keep the collective going whatever happens
        local = ([((0,), "ValueError", f"{path} cannot be checked against this model: {error!r}")], [])
    gathered = _all_gather(local)
    problems = [problem for rank_problems, _ in gathered for problem in rank_problems]
    if not problems:  # a weight of the checkpoint that no rank's model has
        unknown = set.intersection(*(set(keys) for _, keys in gathered))
        first = next((key for key in gathered[0][1] if key in unknown), None)
        if first is not None:
            problems.append(((2,), "ValueError", f"it holds {_describe(first)}, which this model does not have"))
    if problems:
        order, kind, message = min(problems)
        if order[0] != 0:
            message = (
                f"{path} does not match this model: {message}. A checkpoint loads only into the model it was saved "
                f"from: the model.* settings must match the run that saved it{_config_hint(path)}"
            )
        raise _ERRORS[kind](message)
