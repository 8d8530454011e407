"""Documents of one source, streamed with Hugging Face ``datasets`` and split over data-parallel ranks.

A source is one of: local files (jsonl/json, parquet, txt; globs allowed; a txt file is one document), a hub dataset
(needs network; never used in tests), or, when neither is given, an embedded default corpus, in two splits
(``split``: ``train``, or ``validation`` = every ``HELD_OUT_EVERY``-th file, never trained on):

- text: the ``*.py`` files of the Python standard library, sorted, one document per file;
- chat: questions about the standard library's functions answered by their docstrings (``lctrain.data.stdlib_chat``);
- preference: each such function's code, its true docstring preferred to a corrupted one
  (``lctrain.data.stdlib_pairs``).

A source holds text documents (``texts``) or records (``records``, chat or preference: each record's JSON text and
where it is, ``file:line``, for the errors). ``format``: ``text``, ``chat``, ``preference``, or ``auto``: chat when
the first record has ``messages`` or ``prompt`` and ``completion``, preference when it has ``chosen`` and
``rejected``.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

from lctrain.data.chat import is_chat_record
from lctrain.data.config import DATA_FORMATS
from lctrain.data.pairs import is_pair_record
from lctrain.data.stdlib_chat import stdlib_conversations
from lctrain.data.stdlib_pairs import stdlib_pairs

# File suffix -> the `datasets` builder that reads it. txt files are read whole (one document per file).
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
EMBEDDED_SPLITS = ("train", "validation")
HELD_OUT_EVERY = 50  # the embedded corpora's validation split: files 49, 99, 149, ... of the sorted list
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}  # the chat corpus asks about the library, not about its tests


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


def embedded_files(chat: bool, split: str) -> list[str]:
    """The files of an embedded corpus's split: the standard library's (without its tests, for chat and preference
    pairs: ``chat``), sorted, with
    every ``HELD_OUT_EVERY``-th one in ``validation`` and the others in ``train``."""
    if split not in EMBEDDED_SPLITS:
        raise ValueError(f"split={split!r}: the embedded corpus has the splits {', '.join(EMBEDDED_SPLITS)}")
    files = stdlib_files()
    if chat:
        root = sysconfig.get_paths()["stdlib"]
        files = [f for f in files if not _TEST_DIRS & set(Path(os.path.relpath(f, root)).parts[:-1])]
    held_out = {i for i in range(HELD_OUT_EVERY - 1, len(files), HELD_OUT_EVERY)}
    return [f for i, f in enumerate(files) if (i in held_out) == (split == "validation")]


def read_text_files(paths: list[str]) -> Iterator[dict[str, str]]:
    """One ``{"text": ...}`` per UTF-8 file, in order; files that are not valid UTF-8 are skipped."""
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            yield {"text": data.decode("utf-8")}
        except UnicodeDecodeError:
            continue


def read_records(paths: list[str]) -> Iterator[dict[str, str]]:
    """One ``{"record": <JSON text>, "where": <file:line>}`` per record of each file, in order: a jsonl line (blank
    lines skipped), an element of a json file holding one array, a parquet row."""
    for path in paths:
        suffix = Path(path).suffix
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches():
                for record in batch.to_pylist():
                    yield {"record": json.dumps(record, default=str), "where": f"{path} row {row}"}
                    row += 1
            continue
        if suffix == ".txt":
            raise ValueError(f"{path}: a txt file is one text document, not records: use data.format=text")
        with open(path, encoding="utf-8") as f:
            first = f.read(1024).lstrip()[:1]
            f.seek(0)
            if suffix == ".json" and first == "[":
                for index, record in enumerate(json.load(f)):
                    yield {"record": json.dumps(record), "where": f"{path} record {index}"}
                continue
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield {"record": line, "where": f"{path}:{number}"}


_TEXT_FEATURES = datasets.Features({"text": datasets.Value("string")})
_RECORD_FEATURES = datasets.Features({"record": datasets.Value("string"), "where": datasets.Value("string")})


def _from_files(reader, paths: list[str], features: datasets.Features) -> datasets.IterableDataset:
    # One shard per file, so dp ranks split (and shuffling reorders) whole files.
    return datasets.IterableDataset.from_generator(reader, features=features, gen_kwargs={"paths": paths})


def _hub_records(example: dict, index: int, *, name: str) -> dict[str, str]:
    return {"record": json.dumps(example, default=str), "where": f"{name} record {index}"}


def _first_record(paths: Sequence[str], dataset: str | None, dataset_config: str | None, split: str) -> dict | None:
    """The first record of a source of files or a hub dataset (for ``format=auto``); None when it has none or the
    files are not records (txt)."""
    if dataset:
        return next(iter(datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)), None)
    files = resolve_paths(paths)
    if any(Path(f).suffix == ".txt" for f in files):
        return None
    first = next(read_records(files[:1]), None)
    try:
        return None if first is None else json.loads(first["record"])
    except json.JSONDecodeError as error:
        raise ValueError(f"{first['where']}: not valid JSON ({error.msg}); write one JSON object per line") from None


def _open_text(
    paths: Sequence[str], dataset: str | None, dataset_config: str | None, split: str
) -> datasets.IterableDataset:
    if dataset:
        return datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)
    if not paths:
        return _from_files(read_text_files, embedded_files(False, split), _TEXT_FEATURES)
    files = resolve_paths(paths)
    builders = {FORMATS[Path(f).suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"paths: {list(paths)} mix formats {sorted(builders)}; use files of one format")
    builder = builders.pop()
    if builder == "text":
        return _from_files(read_text_files, files, _TEXT_FEATURES)
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=True)


def _open_records(
    paths: Sequence[str], dataset: str | None, dataset_config: str | None, split: str, format: str
) -> datasets.IterableDataset:
    if dataset:
        ds = datasets.load_dataset(dataset, dataset_config, split=split, streaming=True)
        return ds.map(_hub_records, with_indices=True, fn_kwargs={"name": dataset}, remove_columns=ds.column_names)
    if not paths:
        corpus = stdlib_pairs if format == "preference" else stdlib_conversations
        return _from_files(corpus, embedded_files(True, split), _RECORD_FEATURES)
    return _from_files(read_records, resolve_paths(paths), _RECORD_FEATURES)


def ordered(
    ds: datasets.IterableDataset, shuffle_buffer: int, seed: int, dp_rank: int, dp_size: int, epoch: int
) -> datasets.IterableDataset:
    """``ds``'s examples of dp rank ``dp_rank`` of ``dp_size`` for ``epoch``: shuffled (a buffer of
    ``shuffle_buffer`` examples and the shards' order, seeded by ``seed`` and the epoch; 0 = in order), then split
    by shard when the ranks divide the shards, else by example. Which example goes where depends on the number of
    shards and of examples in each, never on what they hold."""
    if shuffle_buffer:
        ds = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)
    ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)
    if shuffle_buffer:
        ds.set_epoch(epoch)
    return ds


class DocumentSource:
    """The documents of one data-parallel rank: text documents (``texts``) or chat or preference records
    (``records``).

    Ranks ``0..dp_size-1`` see disjoint sets of documents whose union is the whole dataset. ``texts(epoch)`` and
    ``records(epoch)`` give the same sequence on every call with the same arguments: the shuffle (buffer of
    ``shuffle_buffer`` documents, 0 = off, plus a shuffled file order) is seeded by ``seed`` and re-drawn for every
    epoch. Without shuffling every epoch has the same order. Empty texts are skipped.
    """

    def __init__(
        self,
        *,
        paths: Sequence[str] = (),
        dataset: str | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        text_field: str = "text",
        format: str = "text",
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
        if format not in DATA_FORMATS:
            raise ValueError(f"format={format!r} must be one of {', '.join(DATA_FORMATS)}")
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
            kind = {
                "chat": "chat: the standard library's docstrings",
                "preference": "preference: the standard library's docstrings against corrupted ones",
            }.get(format, "Python standard library")
            self.description = f"the embedded default corpus ({kind}, split {split})"
        if format == "auto":
            first = _first_record(paths, dataset, dataset_config, split) if paths or dataset else None
            format = "chat" if is_chat_record(first) else "preference" if is_pair_record(first) else "text"
        self.format = format
        if format in ("chat", "preference"):
            self._dataset = _open_records(paths, dataset, dataset_config, split, format)
            if next(iter(self._dataset), None) is None:
                raise ValueError(f"{self.description}: the dataset has no records")
            return
        try:
            ds = _open_text(paths, dataset, dataset_config, split)
            first = next(iter(ds), None)
        except StopIteration:  # datasets' json builder raises it (while inferring features) when all files are empty
            first = None
        if first is None:
            raise ValueError(f"{self.description}: the dataset has no documents")
        if text_field not in first:
            kind = "chat" if is_chat_record(first) else "preference" if is_pair_record(first) else None
            hint = f" (a {kind} record: use data.format={kind} or auto)" if kind else ""
            raise ValueError(
                f"text_field={text_field!r} is not a field of {self.description}; available fields: "
                f"{sorted(first)}{hint}"
            )
        self._dataset = ds.select_columns([text_field])

    def _stream(self, epoch: int) -> datasets.IterableDataset:
        return ordered(self._dataset, self.shuffle_buffer, self.seed, self.dp_rank, self.dp_size, epoch)

    @property
    def num_shards(self) -> int:
        """The shards the dataset streams from (a file each, or a parquet file's row groups): the units dp ranks
        split, and shuffling reorders, whole when they can."""
        return self._dataset.num_shards

    def shard_items(self, shard: int) -> Iterator[str | tuple[str, str]]:
        """Every item of shard ``shard`` in order, unshuffled and for all ranks: texts (an empty one as "", so that
        each item keeps its place) or (record, where)."""
        for example in split_dataset_by_node(self._dataset, rank=shard, world_size=self.num_shards):
            if self.format == "text":
                yield example[self.text_field] or ""
            else:
                yield example["record"], example["where"]

    def texts(self, epoch: int) -> Iterator[str]:
        """This rank's text documents for ``epoch``, in order."""
        for example in self._stream(epoch):
            text = example[self.text_field]
            if text:
                yield text

    def records(self, epoch: int) -> Iterator[tuple[str, str]]:
        """This rank's chat or preference records for ``epoch``, in order: (the record's JSON text, where it is)."""
        for example in self._stream(epoch):
            yield example["record"], example["where"]
