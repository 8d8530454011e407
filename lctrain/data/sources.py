"""Text documents, streamed with Hugging Face ``datasets`` and split over data-parallel ranks.

A source is one of: local files (jsonl/json, parquet, txt; globs allowed; a txt file is one document), a hub dataset
(needs network; never used in tests), or, when neither is given, the embedded default corpus: the ``*.py`` files of
the Python standard library, sorted, one document per file.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

# File suffix -> the `datasets` builder that reads it. txt files are read whole (one document per file).
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def resolve_paths(paths: Sequence[str]) -> list[str]:
    """Expand globs (``**`` allowed) into a sorted list of existing files, each of a known format."""
    files: set[str] = set()
    for pattern in paths:
        if any(c in pattern for c in "*?["):
            matched = [p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)]
            if not matched:
                raise FileNotFoundError(f"paths: the glob {pattern!r} matches no files")
            files.update(matched)
        elif os.path.isfile(pattern):
            files.add(pattern)
        else:
            raise FileNotFoundError(f"paths: no such file {pattern!r}")
    for path in files:
        if Path(path).suffix not in FORMATS:
            raise ValueError(f"paths: {path!r} has an unsupported suffix; use one of {sorted(FORMATS)}")
    return sorted(files)


def stdlib_files() -> list[str]:
    """The ``*.py`` files of this interpreter's standard library (site-packages excluded), sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS]
        files += [os.path.join(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


def read_text_files(paths: list[str]) -> Iterator[dict[str, str]]:
    """One ``{"text": ...}`` per UTF-8 file, in order; files that are not valid UTF-8 are skipped."""
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            yield {"text": data.decode("utf-8")}
        except UnicodeDecodeError:
            continue


def _text_files_dataset(paths: list[str]) -> datasets.IterableDataset:
    # One shard per file, so dp ranks split (and shuffling reorders) whole files.
    features = datasets.Features({"text": datasets.Value("string")})
    return datasets.IterableDataset.from_generator(read_text_files, features=features, gen_kwargs={"paths": paths})


def _open(
    paths: Sequence[str], dataset: str | None, dataset_config: str | None, split: str
) -> datasets.IterableDataset:
    if dataset:
        return datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)
    if not paths:
        return _text_files_dataset(stdlib_files())
    files = resolve_paths(paths)
    builders = {FORMATS[Path(f).suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"paths: {list(paths)} mix formats {sorted(builders)}; use files of one format")
    builder = builders.pop()
    if builder == "text":
        return _text_files_dataset(files)
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)


class DocumentSource:
    """The text documents of one data-parallel rank.

    Ranks ``0..dp_size-1`` see disjoint sets of documents whose union is the whole dataset. ``texts(epoch)`` gives
    the same sequence on every call with the same arguments: the shuffle (buffer of ``shuffle_buffer`` documents,
    0 = off, plus a shuffled file order) is seeded by ``seed`` and re-drawn for every epoch. Without shuffling every
    epoch has the same order. Empty texts are skipped.
    """

    def __init__(
        self,
        *,
        paths: Sequence[str] = (),
        dataset: str | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        text_field: str = "text",
        shuffle_buffer: int = 0,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if paths and dataset:
            raise ValueError(f"set paths or dataset, not both (paths={list(paths)}, dataset={dataset!r})")
        if shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer={shuffle_buffer} must be >= 0 (0 turns shuffling off)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        self.text_field = text_field
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        if dataset:
            self.description = f"dataset={dataset!r}"
        elif paths:
            self.description = f"paths={list(paths)}"
        else:
            self.description = "the embedded default corpus (Python standard library)"
        try:
            ds = _open(paths, dataset, dataset_config, split)
            first = next(iter(ds), None)
        except StopIteration:  # datasets' json builder raises it (while inferring features) when all files are empty
            first = None
        if first is None:
            raise ValueError(f"{self.description}: the dataset has no documents")
        if text_field not in first:
            raise ValueError(
                f"text_field={text_field!r} is not a field of {self.description}; available fields: {sorted(first)}"
            )
        self._dataset = ds.select_columns([text_field])

    def texts(self, epoch: int) -> Iterator[str]:
        """This rank's documents for ``epoch``, in order."""
        ds = self._dataset
        if self.shuffle_buffer:
            ds = ds.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer)
        ds = split_dataset_by_node(ds, rank=self.dp_rank, world_size=self.dp_size)
        if self.shuffle_buffer:
            ds.set_epoch(epoch)
        for example in ds:
            text = example[self.text_field]
            if text:
                yield text
