"""Packed rows of preference pairs made from token lists, as the preference source packs them (for the objective's
tests and the preference benchmark).

Shared layout (the default): per pair ``[p[:-1]] [p[-1], c] [p[-1], r]``, the answers' segments seeing the first
document as their shared prefix (``doc_prefix``) and continuing the prompt's positions; unshared: ``[p, c] [p, r]``
as two plain documents. The trained tokens are exactly the completion tokens; ``completions`` numbers them ``2k``
(chosen) and ``2k + 1`` (rejected); the row's rest is padding (one document of token 0, positions from 0).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from lctrain.attention import SequencePlace, shard_sequence
from lctrain.data import IGNORE_INDEX

Pair = tuple[Sequence[int], Sequence[int], Sequence[int]]  # prompt, chosen, rejected token ids
Row = dict


def pack_pairs(pairs: Sequence[Pair], seq_len: int, *, shared: bool = True, source: int = 0) -> Row:
    """One global row (1-D tensors of ``seq_len``: ``input_ids``, ``position_ids``, ``labels``, ``completions``,
    ``sources``; ``cu_seqlens`` int32, ``doc_prefix`` int64, ``pair_count``, ``pair_ids``: each pair's identity, a
    hash of its tokens) holding ``pairs`` whole."""
    tokens: list[int] = []
    positions: list[int] = []
    labels: list[int] = []
    completions: list[int] = []
    bounds, prefixes = [0], []

    def document(ids: Sequence[int], start: int, trained_from: int, completion: int, prefix: int) -> None:
        # token j predicts ids[j + 1]; the tokens from trained_from on are the completion's
        tokens.extend(ids)
        positions.extend(range(start, start + len(ids)))
        for j in range(len(ids)):
            trained = trained_from <= j + 1 < len(ids)
            labels.append(ids[j + 1] if trained else IGNORE_INDEX)
            completions.append(completion if trained else -1)
        bounds.append(len(tokens))
        prefixes.append(prefix)

    for k, (prompt, chosen, rejected) in enumerate(pairs):
        prompt, size = list(prompt), len(prompt)
        for offset, answer in enumerate((chosen, rejected)):
            if not shared:
                document([*prompt, *answer], 0, size, 2 * k + offset, -1)
                continue
            if offset == 0 and size > 1:
                document(prompt[:-1], 0, size, -1, -1)  # nothing trained: the shared prefix
            prefix = len(prefixes) - 1 - offset if size > 1 else -1
            document([prompt[-1], *answer], size - 1, 1, 2 * k + offset, prefix)
    if len(tokens) > seq_len:
        raise ValueError(f"the pairs take {len(tokens)} tokens, more than seq_len={seq_len}")
    if len(tokens) < seq_len:
        document([0] * (seq_len - len(tokens)), 0, seq_len, -1, -1)
    return {
        "input_ids": torch.tensor(tokens),
        "position_ids": torch.tensor(positions),
        "labels": torch.tensor(labels),
        "completions": torch.tensor(completions),
        "sources": torch.full((seq_len,), source),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "doc_prefix": torch.tensor(prefixes),
        "pair_count": len(pairs),
        "pair_ids": torch.tensor(
            [zlib.crc32(repr(tuple(map(list, pair))).encode()) for pair in pairs], dtype=torch.int64
        ),
    }


def shard_rows(rows: Sequence[Row], place: SequencePlace | None = None, layout: str = "zigzag") -> dict:
    """A micro-batch of global ``rows`` cut to this rank's ``place``, as the loader gives it: ``[B, S_local]``
    tensors, host lists ``cu_seqlens``, ``doc_prefix``, ``pair_counts``, ``pair_ids``."""
    place = place or SequencePlace()

    def cut(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(
            x[None],
            dim=1,
            ring_rank=place.ring_rank,
            ring_size=place.ring_size,
            ulysses_rank=place.ulysses_rank,
            ulysses_size=place.ulysses_size,
            layout=layout,
        )

    keys = ("input_ids", "position_ids", "labels", "completions", "sources")
    batch: dict = {key: torch.cat([cut(row[key]) for row in rows]) for key in keys}
    batch["cu_seqlens"] = [row["cu_seqlens"] for row in rows]
    batch["doc_prefix"] = [row["doc_prefix"] for row in rows]
    batch["pair_counts"] = [row["pair_count"] for row in rows]
    batch["pair_ids"] = [row["pair_ids"] for row in rows]
    return batch
