"""``lctrain prepare``: every training source rendered and tokenized once, in parallel over the machine's cores (one
worker process per core, ``data.prepare_workers``), into a prepared set: ``lctrain.data.prepared`` describes it and
reads it back."""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from lctrain.data.config import DataConfig, SourceConfig, data_sources
from lctrain.data.kinds import read_chat_template, source_of_kind
from lctrain.data.mixture import COUNTS, ENCODE_CHARACTERS, batches
from lctrain.data.packing import Document, Pair
from lctrain.data.prepared import COUNT, DOCUMENT, PAIR, VERSION, identity, tokenizer_fingerprint
from lctrain.data.shards import ArrayWriter, file_digest
from lctrain.data.sources import DocumentSource, embedded_files, resolve_paths
from lctrain.data.tokenizer import load_tokenizer

logger = logging.getLogger("lctrain")

PREPARE_ITEMS = 256  # items per task of a worker


@dataclass(frozen=True)
class _Unread:
    """What a worker's kind needs of its documents: their format."""

    format: str
    description: str = ""


_WORKER: dict[str, Any] = {}


def _start_worker(config: DataConfig, tokenizer_dir: str | None, template: str | None, threads: bool) -> None:
    if not threads:  # one process per core: the tokenizer's own threads would only compete
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER.update(config=config, tokenizer=load_tokenizer(tokenizer_dir), template=template, kinds={})


def _tokenize(format: str, items: list) -> list[list[tuple]]:
    """Each item's parts, as plain arrays: ("d", tokens, trained or None), ("p", prompt, chosen, rejected, pair id)
    or ("c", a count's name); an empty text has none."""
    kinds = _WORKER["kinds"]
    if format not in kinds:
        kinds[format] = source_of_kind(
            _Unread(format), _WORKER["config"], _WORKER["tokenizer"], index=0, template=_WORKER["template"]
        )
    kind = kinds[format]
    if format == "text":
        tokenized = iter(kind.tokenize([text for text in items if text]))
        return [[("d", next(tokenized).numpy(), None)] if text else [] for text in items]
    parts = []
    for result in kind.tokenize(items):
        parts.append([_plain(part) for part in (result if isinstance(result, list) else [result])])
    return parts


def _plain(part: Document | Pair | str) -> tuple:
    if isinstance(part, str):
        return ("c", part)
    if isinstance(part, Pair):
        return ("p", part.prompt.numpy(), part.chosen.numpy(), part.rejected.numpy(), part.pair_id)
    return ("d", part.tokens.numpy(), part.trained.numpy())


class _Done:
    """A result computed in this process, read like a worker's."""

    def __init__(self, value: Any):
        self.value = value

    def get(self) -> Any:
        return self.value


class _SourceWriter:
    """The arrays of one source, appended a batch of items at a time; ``counts`` as they grow."""

    def __init__(self, folder: Path, vocab: int, format: str):
        folder.mkdir(parents=True, exist_ok=True)
        tokens = np.uint16 if vocab <= 1 << 16 else np.uint32
        dtypes = {"tokens": tokens, "trained": np.uint8, "parts": np.int64, "items": np.int64, "shards": np.int64}
        if format != "text":
            dtypes |= {"where": np.uint8, "where_at": np.int64}
        if format != "chat":
            del dtypes["trained"]
        self.arrays = {name: ArrayWriter(folder / f"{name}.bin", dtype) for name, dtype in dtypes.items()}
        self.arrays["items"].append([0])
        if "where" in self.arrays:
            self.arrays["where_at"].append([0])
        self.counts = dict.fromkeys(("items", "empty", "documents", "pairs", "tokens", *COUNTS[2:]), 0)
        self._parts, self._places = 0, 0

    def add(self, results: list[list[tuple]], items: list) -> None:
        rows, tokens, trained, firsts = [], [], [], []
        for parts in results:
            for part in parts:
                if part[0] == "c":
                    rows.append((COUNT, 0, 0, 0, 0, COUNTS.index(part[1])))
                    self.counts[part[1]] += 1
                    continue
                arrays = part[1:2] if part[0] == "d" else part[1:4]
                lengths = [len(array) for array in arrays]
                kind, extra = (DOCUMENT, 0) if part[0] == "d" else (PAIR, part[4])
                rows.append((kind, self.counts["tokens"], *lengths, *[0] * (3 - len(lengths)), extra))
                tokens += arrays
                if part[0] == "d" and part[2] is not None:
                    trained.append(part[2])
                self.counts["tokens"] += sum(lengths)
                self.counts["pairs" if kind == PAIR else "documents"] += 1
            self._parts += len(parts)
            firsts.append(self._parts)
            self.counts["empty"] += not parts
        self.counts["items"] += len(results)
        if rows:
            self.arrays["parts"].append(np.array(rows, dtype=np.int64))
            self.arrays["tokens"].append(np.concatenate(tokens))
        if trained:
            self.arrays["trained"].append(np.concatenate(trained))
        self.arrays["items"].append(firsts)
        if "where" in self.arrays:
            places = [where.encode() for _, where in items]
            self.arrays["where"].append(np.frombuffer(b"".join(places), dtype=np.uint8))
            ends = self._places + np.cumsum([len(place) for place in places])
            self.arrays["where_at"].append(ends)
            self._places = int(ends[-1])

    def close(self, shards: list[int]) -> dict[str, Any]:
        self.arrays["shards"].append(shards)
        return {name: writer.close() for name, writer in self.arrays.items()}


def _source_files(source: SourceConfig, format: str) -> list[str]:
    if source.paths:
        return resolve_paths(source.paths)
    return embedded_files(format in ("chat", "preference"), source.split)


def prepare(config: DataConfig, tokenizer_dir: str | None, *, progress: bool = True) -> dict[str, Any]:
    """Prepare every training source of ``config`` into ``config.prepared`` (``data.prepare_workers`` processes,
    0 = one per core); returns the manifest. A source of a hub dataset is refused (download it to files first)."""
    if not config.prepared:
        raise ValueError("lctrain prepare needs data.prepared=DIR: the directory to write the prepared set to")
    out = Path(config.prepared)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    fingerprint, template = tokenizer_fingerprint(tokenizer), read_chat_template(config)
    template_text = template or tokenizer.chat_template
    workers = config.prepare_workers or os.cpu_count() or 1
    pool = None
    if workers > 1:
        start = (config, tokenizer_dir, template, False)
        pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, start)
    else:
        _start_worker(config, tokenizer_dir, template, True)
    sources = {}
    try:
        for number, source in enumerate(data_sources(config)):
            if source.dataset:
                raise ValueError(
                    f"data source {source.name!r} reads the hub dataset {source.dataset!r}: lctrain prepare reads "
                    f"local files and the embedded corpus; save the dataset to files and list them in its paths"
                )
            shaped = functools.partial(identity, source, config, tokenizer=fingerprint, template=template_text)
            sources[source.name] = _prepare_source(
                source, out / f"source_{number}", shaped, len(tokenizer), pool, workers, progress
            )
    finally:
        if pool is not None:
            pool.terminate()
    manifest = {"version": VERSION, "sources": sources}
    staging = out / "manifest.json.partial"
    staging.write_text(json.dumps(manifest, indent=1))
    os.replace(staging, out / "manifest.json")
    return manifest


def _prepare_source(
    source: SourceConfig,
    folder: Path,
    shaped: Callable[[str], dict],
    vocab: int,
    pool: Any,
    workers: int,
    progress: bool,
) -> dict[str, Any]:
    """One source's arrays written to ``folder``; its manifest entry (``shaped(format)``: its identity)."""
    documents = DocumentSource(
        paths=source.paths, split=source.split, text_field=source.text_field, format=source.format
    )
    format, began, shards = documents.format, time.perf_counter(), [0]
    files = [
        {"path": path, "bytes": os.path.getsize(path), "sha256": file_digest(path)}
        for path in _source_files(source, format)
    ]

    def items() -> Iterator[Any]:
        count = 0
        for shard in range(documents.num_shards):
            for item in documents.shard_items(shard):
                count += 1
                yield item
            shards.append(count)

    writer = _SourceWriter(folder, vocab, format)
    pending: deque = deque()
    bar = tqdm(desc=f"prepare {source.name}", unit=" items", disable=not progress, dynamic_ncols=True)

    def write_oldest() -> None:
        batch, result = pending.popleft()
        writer.add(result.get(), batch)
        bar.update(len(batch))

    for batch in batches(items(), PREPARE_ITEMS, ENCODE_CHARACTERS):
        work = pool.apply_async(_tokenize, (format, batch)) if pool else _Done(_tokenize(format, batch))
        pending.append((batch, work))
        if len(pending) > 2 * workers:  # bounds the items held in memory
            write_oldest()
    while pending:
        write_oldest()
    bar.close()
    seconds = time.perf_counter() - began
    counts = writer.counts
    logger.info(
        "prepared %s: %d items, %d tokens in %.1f s (%.0f tokens/s, %d workers)",
        source.name,
        counts["items"],
        counts["tokens"],
        seconds,
        counts["tokens"] / max(seconds, 1e-9),
        workers,
    )
    arrays = writer.close(shards)
    return {"folder": folder.name, "identity": shaped(format), "files": files, "counts": counts, "arrays": arrays}
