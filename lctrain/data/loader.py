"""The streaming packed loader: dp-sharded sources -> tokenize (texts) or render and mask (conversations) -> draw by
weight -> pack -> micro-batches -> context-parallel shard.

Resuming is exact. The state is, per dp rank: for each source its ``epoch``, ``document`` and ``part`` (the items
of that epoch consumed, and the documents of the next one, a conversation rendered per turn: ``lctrain.data.mixture``)
and its counts (records skipped, conversations rendered per turn, turns left out); the mixture's ``draws``; and the
``offset`` (tokens of the next document already emitted; the positions of a partly emitted document continue from
it). All plain ints and lists, so json or torch.save it; with one source it keeps the flat form it had before
mixtures (``epoch``, ``document``, ``offset``), so older checkpoints resume. ``load_state_dict`` re-opens each
source's seeded stream of its epoch, skips ``document`` items without tokenizing them, and the packer drops the
first ``offset`` tokens of the first document. Cost: reading and decoding (and shuffle-buffering) the skipped
documents of the current epoch (all ranks' documents when dp ranks split a dataset by document rather than by
file), which is far cheaper than tokenizing them (the default corpus, 1758 files, re-reads in 0.16 s on 2 CPU
cores), plus tokenizing one batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.attention import SequencePlace
from lctrain.data.chat import TRAIN_ON, ChatEncoder, Conversation, parse_conversation
from lctrain.data.chat_turns import TurnSettings
from lctrain.data.mixture import COUNTS, Encoded, Item, Mixture, SourceStream
from lctrain.data.packing import Document, PackedRow, Packer
from lctrain.data.sources import DATA_FORMATS, DocumentSource, embedded_files, resolve_paths
from lctrain.data.tokenizer import load_tokenizer, tokenize_documents
from lctrain.rules import check_sequence_length

logger = logging.getLogger("lctrain")

OVERLONG = ("drop", "truncate", "error")


@dataclass
class SourceConfig:
    """One source of ``data.sources`` (a mixture) or ``data.val_sources`` (held-out data). Set ``paths`` or
    ``dataset``; with neither, the embedded corpus of its format and ``split``."""

    name: str = ""  # names the source in the metrics (loss/<name>) and errors; required, unique
    paths: list[str] = field(default_factory=list)  # local jsonl/json, parquet or txt files; globs allowed
    dataset: str | None = None  # a hub dataset name (needs network)
    dataset_config: str | None = None  # the hub dataset's configuration name
    split: str = "train"  # the hub dataset's split; for the embedded corpus: train or validation
    weight: float = 1.0  # share of the documents drawn (relative to the other sources' weights), > 0
    format: str | None = None  # text, chat or auto; None = data.format
    text_field: str | None = None  # the field holding a text document; None = data.text_field


@dataclass
class DataConfig:
    """What to read and how to pack it. Set ``paths`` or ``dataset``, or ``sources`` (a mixture); with none, the
    embedded default corpus."""

    seq_len: int = 4096  # tokens per packed row (global, before context-parallel sharding)
    batch_size: int = 1  # rows per micro-batch
    paths: list[str] = field(default_factory=list)  # local jsonl/json, parquet or txt files; globs allowed
    dataset: str | None = None  # a hub dataset name (needs network)
    dataset_config: str | None = None  # the hub dataset's configuration name, if it has several
    split: str = "train"  # the hub dataset's split
    text_field: str = "text"  # the field of each record that holds the document text
    tokenizer: str | None = None  # a local tokenizer directory; None = model.path's (the trainer) or the embedded one
    shuffle_buffer: int = 0  # documents in the shuffle buffer; 0 = no shuffling
    seed: int = 0  # shuffle seed
    truncate: bool = False  # drop the rest of a document that does not fit in its row, instead of continuing it
    format: str = "auto"  # text, chat (conversations) or auto (chat when a source's first record has messages)
    chat_template: str | None = None  # a Jinja chat template file; None = the tokenizer's own
    train_on: str = "assistant"  # chat tokens with loss: assistant (every assistant turn), last_assistant or all
    overlong: str = "drop"  # a conversation longer than seq_len: drop (counted in the log), truncate or error
    # a conversation whose whole rendering is not what the model sees at inference for a trained turn: expand (one
    # document per such turn, counted), last_turn (only the last trained turn) or error
    divergent_turns: str = "expand"
    unreachable_turns: str = "error"  # a turn no generation prompt leads to (reasoning templates): error or skip
    sources: list[SourceConfig] = field(default_factory=list)  # a mixture, drawn by weight; [] = paths/dataset
    val_sources: list[SourceConfig] = field(default_factory=list)  # held-out data scored every train.val_every steps


def data_sources(config: DataConfig) -> list[SourceConfig]:
    """The sources of the training data, each with its format and text field: ``data.sources``, or the one source
    of ``data.paths`` / ``data.dataset`` (named ``data``)."""
    sources = config.sources or [
        SourceConfig("data", list(config.paths), config.dataset, config.dataset_config, config.split)
    ]
    return [_filled(source, config) for source in sources]


def _filled(source: SourceConfig, config: DataConfig) -> SourceConfig:
    return replace(
        source,
        format=source.format or config.format,
        text_field=source.text_field or config.text_field,
    )


def check_data_config(config: DataConfig) -> None:
    """The data settings on their own (no file is read): one ``ValueError`` naming the setting and the fix."""
    for name, value, allowed in (
        ("data.format", config.format, DATA_FORMATS),
        ("data.train_on", config.train_on, TRAIN_ON),
        ("data.overlong", config.overlong, OVERLONG),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {', '.join(allowed)}")
    _turn_settings(config)
    if config.sources and (config.paths or config.dataset):
        raise ValueError(
            "data.sources and data.paths (or data.dataset) are both set: list every source in data.sources "
            "(data.paths is the one-source form)"
        )
    for setting, sources in (("data.sources", config.sources), ("data.val_sources", config.val_sources)):
        names = [source.name for source in sources]
        for index, source in enumerate(sources):
            where = f"{setting}[{index}]"
            if not source.name:
                raise ValueError(f"{where} has no name: give each source a name (it names its metrics, loss/<name>)")
            if names.count(source.name) > 1:
                raise ValueError(f"{setting} has two sources named {source.name!r}: give each a name of its own")
            if source.paths and source.dataset:
                raise ValueError(f"{where} ({source.name}) sets paths and dataset: set one")
            if source.format is not None and source.format not in DATA_FORMATS:
                raise ValueError(f"{where}.format={source.format!r} must be one of {', '.join(DATA_FORMATS)}")
            if not source.weight > 0:
                raise ValueError(
                    f"{where}.weight={source.weight} ({source.name}) must be > 0: weights are shares of the documents "
                    f"drawn; leave a source out instead"
                )


def _files(source: SourceConfig) -> set[str]:
    """The files a source reads (the embedded corpus's too), for the check that validation is held out."""
    if source.dataset:
        return set()
    if source.paths:
        return {str(Path(p).resolve()) for p in resolve_paths(source.paths)}
    return set(embedded_files(source.format == "chat", source.split))


def check_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every data setting checked against the data, before any process group: the settings, every source (and
    validation source) opened, the first record of every chat source rendered with the template, and no
    validation file that is also a training file. ``ValueError`` / ``FileNotFoundError`` naming the setting."""
    check_data_config(config)
    template = _template(config)
    train = data_sources(config)
    val = [_filled(source, config) for source in config.val_sources]
    for index, source in enumerate(train + val):
        opened = _open_source(source, config)
        if opened.format == "chat":
            encoder = ChatEncoder(
                tokenizer, template=template, train_on=config.train_on, turns=_turn_settings(config), source=index
            )
            record, where = next(opened.records(0))
            encoder.encode([parse_conversation(record, where)])
    for source in val:
        for other in train:
            same_hub = source.dataset and (source.dataset, source.dataset_config, source.split) == (
                other.dataset,
                other.dataset_config,
                other.split,
            )
            shared = sorted(_files(source) & _files(other))
            if shared or same_hub:
                what = shared[0] if shared else f"dataset={source.dataset!r} split {source.split!r}"
                raise ValueError(
                    f"data.val_sources {source.name!r}: {what} is also training data ({other.name!r}); validate on "
                    f"held-out files (the embedded corpus: split validation)"
                )


def _turn_settings(config: DataConfig) -> TurnSettings:
    return TurnSettings(config.divergent_turns, config.unreachable_turns)


def _template(config: DataConfig) -> str | None:
    if config.chat_template is None:
        return None
    path = Path(config.chat_template)
    if not path.is_file():
        raise FileNotFoundError(f"data.chat_template={config.chat_template!r}: no such file (a Jinja chat template)")
    return path.read_text()


def _open_source(source: SourceConfig, config: DataConfig, dp_rank: int = 0, dp_size: int = 1) -> DocumentSource:
    return DocumentSource(
        paths=source.paths,
        dataset=source.dataset,
        dataset_config=source.dataset_config,
        split=source.split,
        text_field=source.text_field,
        format=source.format,
        shuffle_buffer=config.shuffle_buffer,
        seed=config.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


class PackedLoader:
    """Micro-batches of packed rows, cut to this rank's context-parallel part. Iterates forever, epoch after epoch.

    Each batch is a dict:

    - ``input_ids``, ``labels``, ``position_ids``: ``[B, S / (R·U)]`` int64, this (ring, ulysses) rank's part of
      each row (``place.shard`` on dim 1; labels were shifted on the global row, see ``lctrain.data.packing``).
    - ``sources``: ``[B, S / (R·U)]`` int16, the source index of each token (``names`` names them), sharded alike.
    - ``cu_seqlens``: a list of B int32 tensors ``[k_b + 1]``, the document boundaries of each *global* row.

    Ranks with the same ``dp_rank`` read the same rows; different dp ranks read disjoint documents. ``place`` is
    the rank's part of each row (``SequencePlace``, which carries the layout; None = whole rows). Rank coordinates
    are plain values: no process group is needed.
    """

    def __init__(
        self,
        config: DataConfig,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        place: SequencePlace | None = None,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, dp_size={dp_size})")
        place = SequencePlace() if place is None else place
        check_sequence_length(
            config.seq_len, layout=place.layout, ring=place.ring_size, ulysses=place.ulysses_size, setting="seq_len"
        )
        if config.batch_size < 1:
            raise ValueError(f"batch_size={config.batch_size} must be >= 1")
        check_data_config(config)
        self.config = config
        self.dp_rank, self.dp_size, self.place = dp_rank, dp_size, place
        self.tokenizer = load_tokenizer(config.tokenizer)
        self._configs = data_sources(config)
        self.names = [source.name for source in self._configs]
        self._sources = [_open_source(source, config, dp_rank, dp_size) for source in self._configs]
        template = _template(config)
        self._encoders = [
            ChatEncoder(
                self.tokenizer, template=template, train_on=config.train_on, turns=_turn_settings(config), source=index
            )
            if source.format == "chat"
            else None
            for index, source in enumerate(self._sources)
        ]
        self._reported_overlong = False
        self._state: dict[str, Any] = {
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "draws": 0,
            "offset": 0,
            "sources": [{"epoch": 0, "document": 0, "part": 0, **dict.fromkeys(COUNTS, 0)} for _ in self._sources],
        }

    def _items(self, index: int, epoch: int) -> Iterator[Item]:
        source = self._sources[index]
        return source.records(epoch) if source.format == "chat" else source.texts(epoch)

    def _encode_texts(self, index: int, texts: list[str]) -> list[Encoded]:
        return [Document(tokens, source=index) for tokens in tokenize_documents(self.tokenizer, texts)]

    def _encode_chats(self, index: int, records: list[tuple[str, str]]) -> list[Encoded]:
        """Conversations -> documents (a divergent conversation: several, with counts); a conversation longer than
        a row is dropped, cut or an error (``data.overlong``), one without a trained token skipped."""
        conversations = [parse_conversation(record, where) for record, where in records]
        encoded: list[Encoded] = []
        for conversation, parts in zip(conversations, self._encoders[index].encode(conversations)):
            if isinstance(parts, list):
                encoded.append([self._fitted(conversation, p) if isinstance(p, Document) else p for p in parts])
            else:
                encoded.append(self._fitted(conversation, parts))
        return encoded

    def _fitted(self, conversation: Conversation, document: Document) -> Encoded:
        """A conversation's document, or why it gives none."""
        seq_len, overlong = self.config.seq_len, self.config.overlong
        if len(document) > seq_len:
            if overlong == "error":
                raise ValueError(
                    f"{conversation.where}: a conversation of {len(document)} tokens is longer than "
                    f"data.seq_len={seq_len}; set data.overlong=drop or truncate, or raise data.seq_len"
                )
            if overlong == "drop":
                if not self._reported_overlong:
                    logger.info(
                        "%s: a conversation of %d tokens is longer than data.seq_len=%d and is dropped "
                        "(data.overlong=drop; the count is logged at the end)",
                        conversation.where,
                        len(document),
                        seq_len,
                    )
                    self._reported_overlong = True
                return "overlong"
            document = replace(document, tokens=document.tokens[:seq_len], trained=document.trained[:seq_len])
        return document if document.trained.any() else "untrained"

    def __iter__(self) -> Iterator[dict[str, Tensor | list[Tensor]]]:
        state = self._state
        streams = [
            SourceStream(
                partial(self._items, index),
                partial(self._encode_chats if source.format == "chat" else self._encode_texts, index),
                description=source.description,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                epoch=position["epoch"],
                document=position["document"],
                part=position["part"],
                skipped={reason: position[reason] for reason in COUNTS},
            )
            for index, (source, position) in enumerate(zip(self._sources, state["sources"]))
        ]
        weights = [source.weight for source in self._configs]
        documents = Mixture(streams, weights, seed=self.config.seed, dp_rank=self.dp_rank, draws=state["draws"])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        rows = Packer(documents, self.config.seq_len, truncate=self.config.truncate, offset=state["offset"], pad_id=pad)
        while True:
            batch = self._shard([next(rows) for _ in range(self.config.batch_size)])
            # The packer holds at most one document, the last one drawn, while it is partly emitted (or waits for
            # the next row): it is drawn again on resume, from its own place in its source.
            in_progress = rows.holds_document
            self._state = {
                **self._state,
                "draws": documents.draws - in_progress,
                "offset": rows.offset,
                "sources": [
                    {**stream.position(in_progress and index == documents.last), **stream.skipped}
                    for index, stream in enumerate(streams)
                ],
            }
            yield batch

    def _shard(self, rows: list[PackedRow]) -> dict[str, Tensor | list[Tensor]]:
        batch: dict[str, Tensor | list[Tensor]] = {}
        for key in ("input_ids", "labels", "position_ids", "sources"):
            full = torch.stack([getattr(row, key) for row in rows])  # [B, S]
            # [B, S] -> [B, S/(R·U)]
            batch[key] = self.place.shard(full, dim=1).contiguous()
        batch["cu_seqlens"] = [row.cu_seqlens for row in rows]
        return batch

    def skipped(self) -> dict[str, dict[str, int]]:
        """Per source name, the counts so far of this dp rank: records skipped, ``overlong`` (dropped, longer than
        a row) and ``untrained`` (no trained token); ``divergent`` conversations (rendered per turn) and
        ``unreachable`` turns left out (``lctrain.data.chat_turns``)."""
        return {
            name: {reason: position[reason] for reason in COUNTS}
            for name, position in zip(self.names, self._state["sources"])
        }

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts (after the last batch yielded); plain ints and lists, so json or torch.save
        it. One source: ``epoch``, ``document``, ``part``, ``offset`` and the counts (the format from before
        mixtures, plus those); several: ``draws``, ``offset`` and one such position per source."""
        state = self._state
        if len(self._sources) == 1:
            position = state["sources"][0]
            return {"dp_rank": state["dp_rank"], "dp_size": state["dp_size"], **position, "offset": state["offset"]}
        return {**state, "sources": [dict(position) for position in state["sources"]]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter(self)`` yield exactly the batches that followed the one ``state`` was taken after."""
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(
                f"the data state was saved by dp rank {state['dp_rank']} of {state['dp_size']}, but this loader is "
                f"dp rank {self.dp_rank} of {self.dp_size}: resume with the same data-parallel layout"
            )
        positions: Sequence[Mapping[str, int]] = state.get("sources", [state])
        if len(positions) != len(self._sources):
            raise ValueError(
                f"the data state was saved by a loader of {len(positions)} source(s), and this one reads "
                f"{len(self._sources)} ({self.names}): resume with the data.sources it was saved with"
            )
        self._state = {
            "dp_rank": int(state["dp_rank"]),
            "dp_size": int(state["dp_size"]),
            "draws": int(state.get("draws", 0)),
            "offset": int(state["offset"]),
            "sources": [
                {key: int(position.get(key, 0)) for key in ("epoch", "document", "part", *COUNTS)}
                for position in positions
            ],
        }
