"""The streaming packed loader: each source's items (by kind: ``lctrain.data.kinds``) for this dp rank -> encoded
into documents -> drawn by weight -> packed into rows -> micro-batches -> this rank's context-parallel part.

Resuming is exact. The state is, per dp rank: for each source its ``epoch``, ``document`` and ``part`` (the items
of that epoch consumed, and the documents of the next one, a conversation rendered per turn: ``lctrain.data.mixture``)
and its counts (records skipped, conversations rendered per turn, turns left out); the mixture's ``draws``; and the
``offset`` (tokens of the next document already emitted; the positions of a partly emitted document continue from
it). All plain ints and lists, so json or torch.save it; with one source it is flat (``epoch``, ``document``,
``offset``). ``load_state_dict`` re-opens each source's seeded stream of its epoch, skips ``document`` items without
encoding them, and the packer drops the first ``offset`` tokens of the first document (a preference pair is one item
packed whole: never partly emitted). Cost: reading and decoding
(and shuffle-buffering) the skipped documents of the current epoch (all ranks' documents when dp ranks split a
dataset by document rather than by file), far less than encoding them (docs/benchmarks.md, "Data loader"), plus
encoding one batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lctrain.attention import SequencePlace
from lctrain.data.config import DataConfig, data_sources
from lctrain.data.kinds import read_chat_template
from lctrain.data.mixture import COUNTS, Mixture, SourceStream
from lctrain.data.opening import open_source
from lctrain.data.packing import PackedRow, Packer
from lctrain.data.tokenizer import load_tokenizer
from lctrain.rules import check_sequence_length


class PackedLoader:
    """Micro-batches of packed rows, cut to this rank's context-parallel part. Iterates forever, epoch after epoch.

    Each batch is a dict:

    - ``input_ids``, ``labels``, ``position_ids``: ``[B, S / (R·U)]`` int64, this (ring, ulysses) rank's part of
      each row (``place.shard`` on dim 1; labels were shifted on the global row, see ``lctrain.data.packing``).
    - ``sources``: ``[B, S / (R·U)]`` int16, the source index of each token (``names`` names them), sharded alike.
    - ``cu_seqlens``: a list of B int32 tensors ``[k_b + 1]``, the document boundaries of each *global* row.

    When a source holds preference pairs (``lctrain.data.kinds.PairSource``, or prepared ones), also:

    - ``completions``: ``[B, S / (R·U)]`` int64, sharded alike: the completion of each trained token of a pair
      (``2k`` pair k's chosen, ``2k + 1`` its rejected, numbered within the row), -1 elsewhere.
    - ``doc_prefix``: a list of B int64 tensors ``[k_b]``, each document's shared prefix (a document index of the
      global row, -1 for none).
    - ``pair_counts``: a list of B ints, the whole pairs of each row; ``pair_ids``: a list of B int64 tensors
      ``[pair_counts[b]]``, their identities (``lctrain.data.pairs.pair_id``).

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
        self.config = config
        self.dp_rank, self.dp_size, self.place = dp_rank, dp_size, place
        self.tokenizer = load_tokenizer(config.tokenizer)
        self._configs = data_sources(config)
        self.names = [source.name for source in self._configs]
        template = read_chat_template(config)
        self._sources = [
            open_source(
                source, config, self.tokenizer, index=index, template=template, dp_rank=dp_rank, dp_size=dp_size
            )
            for index, source in enumerate(self._configs)
        ]
        self.pairs = any(source.documents.format == "preference" for source in self._sources)
        self._state: dict[str, Any] = {
            "dp_rank": dp_rank,
            "dp_size": dp_size,
            "draws": 0,
            "offset": 0,
            "sources": [{"epoch": 0, "document": 0, "part": 0, **dict.fromkeys(COUNTS, 0)} for _ in self._sources],
        }

    def __iter__(self) -> Iterator[dict[str, Tensor | list[Tensor] | list[int]]]:
        state = self._state
        streams = [
            SourceStream(
                source.items,
                source.encode,
                description=source.description,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                epoch=position["epoch"],
                document=position["document"],
                part=position["part"],
                skipped={reason: position[reason] for reason in COUNTS},
            )
            for source, position in zip(self._sources, state["sources"])
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

    def _shard(self, rows: list[PackedRow]) -> dict[str, Tensor | list[Tensor] | list[int]]:
        batch: dict[str, Tensor | list[Tensor] | list[int]] = {}
        for key in ("input_ids", "labels", "position_ids", "sources", *(("completions",) if self.pairs else ())):
            full = torch.stack([getattr(row, key) for row in rows])  # [B, S]
            # [B, S] -> [B, S/(R·U)]
            batch[key] = self.place.shard(full, dim=1).contiguous()
        batch["cu_seqlens"] = [row.cu_seqlens for row in rows]
        if self.pairs:
            batch["doc_prefix"] = [row.doc_prefix for row in rows]
            batch["pair_counts"] = [len(row.pair_ids) for row in rows]
            batch["pair_ids"] = [row.pair_ids for row in rows]
        return batch

    def skipped(self) -> dict[str, dict[str, int]]:
        """Per source name, the counts so far of this dp rank: records skipped, ``overlong`` (dropped, longer than
        a row: conversations and pairs) and ``untrained`` (no trained token); ``divergent`` conversations (rendered
        per turn) and ``unreachable`` turns left out (``lctrain.data.chat_turns``). ``skipped_line`` words them."""
        return {
            name: {reason: position[reason] for reason in COUNTS}
            for name, position in zip(self.names, self._state["sources"])
        }

    def skipped_line(self, skipped: Mapping[str, Mapping[str, int]]) -> str:
        """``skipped`` (``skipped()``'s counts, e.g. summed over the dp ranks) as one line: each source's nonzero
        counts in the words of its kind (``counted``: text documents, conversations, pairs), named by the source
        when there are several; "" when nothing was counted."""
        parts = []
        for source, (name, counts) in zip(self._sources, skipped.items()):
            phrases = source.counted(counts)
            if phrases:
                parts.append(", ".join(phrases) + (f" ({name})" if len(self._sources) > 1 else ""))
        return "; ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts (after the last batch yielded); plain ints and lists, so json or torch.save
        it. One source: ``epoch``, ``document``, ``part``, ``offset`` and the counts (flat); several: ``draws``,
        ``offset`` and one such position per source."""
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
