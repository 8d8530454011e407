"""A prepared set (written by ``lctrain prepare``: ``lctrain.data.prepare``): every training source rendered and
tokenized once into memory-mapped files (``lctrain.data.shards``), which a job reads with no tokenizer work
(``data.prepared``).

What is stored is what each kind's ``tokenize`` gives (``lctrain.data.kinds``), item by item, in the source's own
order (its shards in order, the items of each): a text's tokens; a conversation's documents with their trained masks
(and the turns rendered apart or left out); a pair's prompt, answers and identity. Nothing that depends on the row
(``data.seq_len``, ``overlong``, ``truncate``) or on the order of reading (``shuffle_buffer``, ``seed``, the mesh)
is applied: a job applies it as it reads (the kind's ``fit``), so one prepared set serves every row length and mesh.

Order: a prepared source streams item indices through the same shuffle and dp split as its files
(``lctrain.data.sources.ordered``), over shards of the same sizes; these place items by count alone, so every rank
reads the same items in the same order as from the files, every epoch: the same rows, and either's data state
resumes the other.

A directory: ``manifest.json`` (written last: without it the directory is no prepared set) and a folder per source,
``source_<k>/``, of flat arrays: ``tokens`` (uint16 for vocabularies up to 65536, else uint32), ``trained`` (uint8,
conversations), ``parts`` (int64 ``[n, 6]``: kind, first token, three lengths, a pair's identity or a count's index),
``items`` (int64 ``[items + 1]``: each item's first part; an empty text has none and is left out as from the files),
``shards`` (int64 ``[shards + 1]``: each shard's first item), ``where`` and ``where_at`` (the records' places,
utf-8, and their offsets). The manifest holds, per source, what shaped its tokens (``identity``: the tokenizer's and
the chat template's SHA-256, the format and the settings of its kind, the paths), its files' sizes and SHA-256,
its counts and its arrays' checksums.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lctrain.data.config import DataConfig, SourceConfig
from lctrain.data.mixture import COUNTS
from lctrain.data.packing import Document, Pair
from lctrain.data.shards import AGAIN, CheckedArray, text_digest
from lctrain.data.sources import ordered

if TYPE_CHECKING:
    from lctrain.data.kinds import ChatSource, PairSource, TextSource

VERSION = 1
DOCUMENT, PAIR, COUNT = 0, 1, 2  # the kinds of part


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """The SHA-256 of what the tokenizer maps text to: its serialisation and its special tokens' ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return text_digest(body + json.dumps([tokenizer.bos_token_id, tokenizer.eos_token_id, len(tokenizer)]))


def identity(source: SourceConfig, config: DataConfig, format: str, tokenizer: str, template: str | None) -> dict:
    """What shaped a source's tokens, by setting (the manifest's ``identity``; ``tokenizer``: its fingerprint)."""
    found: dict[str, Any] = {"format": format, "paths": list(source.paths)}
    if not source.paths:
        found["split"] = source.split  # the embedded corpus's
    if format == "text":
        found["text_field"] = source.text_field
    if format == "chat":
        found |= {"train_on": config.train_on, "divergent_turns": config.divergent_turns}
        found["unreachable_turns"] = config.unreachable_turns
    if format == "preference":
        found["share_prompt"] = config.share_prompt
    found["tokenizer"] = tokenizer
    if format != "text":
        found["chat_template"] = text_digest(template)
    return found


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a prepared set; one line naming the setting when there is none or it is of another version."""
    path = Path(directory) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"data.prepared={directory!r} holds no manifest.json (no prepared set, or lctrain prepare did not "
            f"finish): run lctrain prepare with data.prepared={directory}"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("version") != VERSION:
        raise ValueError(
            f"data.prepared={directory!r} is of format version {manifest.get('version')}, not {VERSION}; {AGAIN}"
        )
    return manifest


def check_entry(
    entry: dict, source: SourceConfig, config: DataConfig, tokenizer: PreTrainedTokenizerBase, template: str | None
) -> None:
    """The job's settings against those the source was prepared with: the first difference in one line."""
    prepared = entry["identity"]
    format = prepared["format"] if source.format == "auto" else source.format
    job = identity(source, config, format, tokenizer_fingerprint(tokenizer), template or tokenizer.chat_template)
    where = f"data.prepared={config.prepared!r}: source {source.name!r}"
    for key in [*prepared, *(k for k in job if k not in prepared)]:
        if prepared.get(key) != job.get(key):
            if key in ("tokenizer", "chat_template"):
                differs = (
                    f"was prepared with another {key.replace('_', ' ')} (SHA-256 {str(prepared.get(key))[:12]}; "
                    f"this job's: {str(job.get(key))[:12]})"
                )
            else:
                differs = f"was prepared with {key}={prepared.get(key)!r} and this job has {key}={job.get(key)!r}"
            raise ValueError(f"{where} {differs}; {AGAIN}, or run with the settings it was prepared with")
    for file in entry["files"]:
        if os.path.isfile(file["path"]) and os.path.getsize(file["path"]) != file["bytes"]:
            raise ValueError(
                f"{where} was prepared from {file['path']} of {file['bytes']} bytes, which now has "
                f"{os.path.getsize(file['path'])}; {AGAIN}"
            )


def _indices(shards: list[list[int]]) -> Iterator[dict[str, int]]:
    for first, end in shards:
        for index in range(first, end):
            yield {"index": index}


class PreparedShards:
    """One prepared source for one dp rank: its items in the order of its files (``items``) and what they hold
    (``read``), as ``tokenize`` gave it. ``format`` and ``description`` as a ``DocumentSource``'s."""

    def __init__(self, folder: Path, entry: dict, config: DataConfig, *, index: int, dp_rank: int, dp_size: int):
        self.format, self.index = entry["identity"]["format"], index
        self.description = f"{folder} (prepared)"
        self.shared = entry["identity"].get("share_prompt", True)
        self.shuffle_buffer, self.seed, self.dp_rank, self.dp_size = (
            config.shuffle_buffer,
            config.seed,
            dp_rank,
            dp_size,
        )
        self.arrays = {name: CheckedArray(folder / f"{name}.bin", meta) for name, meta in entry["arrays"].items()}
        bounds = self.arrays["shards"][:].tolist()
        self._dataset = datasets.IterableDataset.from_generator(
            _indices,
            features=datasets.Features({"index": datasets.Value("int64")}),
            gen_kwargs={"shards": [[a, b] for a, b in zip(bounds[:-1], bounds[1:])]},
        )

    def items(self, epoch: int) -> Iterator[tuple[int, str]]:
        """This rank's items of ``epoch`` (empty texts left out): (index, where)."""
        firsts, places = self.arrays["items"], self.arrays.get("where_at")
        for example in ordered(self._dataset, self.shuffle_buffer, self.seed, self.dp_rank, self.dp_size, epoch):
            index = example["index"]
            first, end = firsts[index : index + 2].tolist()
            if first == end:
                continue
            if places is None:
                yield index, ""
                continue
            start, stop = places[index : index + 2].tolist()
            yield index, bytes(self.arrays["where"][start:stop]).decode()

    def read(self, indices: list[int]) -> list[Any]:
        """What ``tokenize`` gave for each item: a text's tokens, a conversation's document (or its parts), a pair."""
        return [self._item(index) for index in indices]

    def _item(self, index: int) -> Any:
        first, end = self.arrays["items"][index : index + 2].tolist()
        rows = self.arrays["parts"][6 * first : 6 * end].reshape(-1, 6).tolist()
        parts = [self._part(*row) for row in rows]
        return parts[0] if len(parts) == 1 else parts

    def _part(self, kind: int, start: int, first: int, second: int, third: int, extra: int) -> Any:
        if kind == COUNT:
            return COUNTS[extra]
        tokens = self.arrays["tokens"]
        if kind == PAIR:
            bounds = np.cumsum([start, first, second, third]).tolist()
            prompt, chosen, rejected = (
                torch.from_numpy(tokens[a:b].astype(np.int64)) for a, b in zip(bounds, bounds[1:])
            )
            return Pair(prompt, chosen, rejected, source=self.index, pair_id=extra, shared=self.shared)
        ids = torch.from_numpy(tokens[start : start + first].astype(np.int64))
        if self.format == "text":
            return ids
        trained = torch.from_numpy(self.arrays["trained"][start : start + first].astype(bool))
        return Document(ids, trained, source=self.index, splittable=False)


class PreparedSource:
    """A source read from a prepared set, in the shape of ``lctrain.data.kinds``' classes: its ``items`` are
    (index, where) and ``encode`` reads them and fits them to the row like the kind (``kind``) of its files."""

    def __init__(self, shards: PreparedShards, kind: TextSource | ChatSource | PairSource):
        self.documents, self.kind, self.description = shards, kind, shards.description

    def items(self, epoch: int) -> Iterator[tuple[int, str]]:
        return self.documents.items(epoch)

    def encode(self, items: list[tuple[int, str]]) -> list:
        return self.kind.fit(self.documents.read([index for index, _ in items]), items)

    def check(self) -> None:
        """Nothing: the settings were checked against the manifest when the source was opened."""

    def counted(self, counts: dict[str, int]) -> list[str]:
        return self.kind.counted(counts)
