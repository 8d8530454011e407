"""Key-token loss on the validation rows (LongPPL's idea, with the model itself as the judge): the tokens whose
log-probability rises the most when the model sees the whole row instead of only the ``train.val_key_window`` tokens
before them are the ones that need long context; their mean loss is what long-context training should lower, while
the plain loss is dominated by tokens a short window predicts as well.

A token t is a key token when ``log p(t | whole row) - log p(t | window) > ALPHA`` and ``log p(t | whole row) >
BETA`` (LongPPL's thresholds: the long context helps by more than 2 nats, and the model with it predicts the token
fairly well). Tokens stay inside their documents in both passes.

The short pass is exact on every mesh because it is only another packed row: each document is cut in blocks of
``k = window / 2`` tokens, and block b becomes a document of its own made of the ``k`` tokens before it and itself
(positions from 0), labelled on the block only; so each token is predicted from between ``k`` and ``window`` tokens
before it (the first block of a document from the same tokens as in the long pass). That row is about twice as long
as the validation row. Each rank computes the log-probabilities of the labelled tokens it holds in both passes,
written at their positions in the global row; summed over dp_cp, every rank has both for every token of every row and
finds the same key tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention import SequencePlace
from lctrain.data import IGNORE_INDEX
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.train.loss import chunked_token_logprobs

Batch = dict[str, Any]

ALPHA = 2.0  # nats the whole row must add to a token's log-probability over the window
BETA = -2.0  # the least log-probability of a key token with the whole row


def check_key_window(window: int, seq_len: int) -> None:
    """``train.val_key_window`` shorter than the rows (a window as long sees everything: no key tokens)."""
    if window and window >= seq_len:
        raise ValueError(
            f"train.val_key_window={window} must be shorter than data.seq_len={seq_len} (the short pass sees this "
            f"many tokens, the long one the whole row); lower it, or set 0 to measure no key-token loss"
        )


def windowed_row(row: Batch, window: int, divisor: int) -> tuple[Batch, Tensor]:
    """The short pass of a global row (``input_ids``, ``labels``, ``position_ids`` ``[1, S]``, ``cu_seqlens``): the
    row of blocks with their windows (module docstring), padded with a document of its own to a multiple of
    ``divisor``; and ``origin`` ``[S']``, the position in ``row`` of each labelled token (-1 elsewhere)."""
    half = window // 2
    pieces, labels, positions, origin, bounds = [], [], [], [], [0]
    document_bounds = row["cu_seqlens"][0].tolist()
    for start, stop in zip(document_bounds, document_bounds[1:]):
        for block in range(start, stop, half):
            first, end = max(start, block - half), min(stop, block + half)
            pieces.append(row["input_ids"][0, first:end])
            labelled = torch.full((end - first,), IGNORE_INDEX, dtype=torch.int64)
            labelled[block - first :] = row["labels"][0, block:end]
            labels.append(labelled)
            positions.append(torch.arange(end - first))
            labelled_here = torch.arange(block, end).masked_fill(row["labels"][0, block:end] == IGNORE_INDEX, -1)
            origin.append(torch.cat([torch.full((block - first,), -1), labelled_here]))
            bounds.append(bounds[-1] + end - first)
    pad = -bounds[-1] % divisor
    if pad:
        pieces.append(torch.zeros(pad, dtype=torch.int64))
        labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.int64))
        positions.append(torch.arange(pad))
        origin.append(torch.full((pad,), -1))
        bounds.append(bounds[-1] + pad)
    short = {
        "input_ids": torch.cat(pieces)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
        "cu_seqlens": [torch.tensor(bounds, dtype=torch.int32)],
    }
    return short, torch.cat(origin).long()


class KeyTokens:
    """The key-token loss of the validation rows (``rows``: whole rows, every rank the same) through the model's
    forward, on this rank's ``place``: this rank scores the rows of its ``turns`` ((index, keep), the validation's
    ``dp_turns``), the sums over ``group`` (dp_cp)."""

    def __init__(self, rows: list[Batch], window: int, edges: list[int], *, place: SequencePlace,
                 turns: Sequence[tuple[int, bool]], group: dist.ProcessGroup, device: torch.device,
                 chunk_tokens: int):  # fmt: skip
        self.place, self.turns, self.group, self.device = place, list(turns), group, device
        self.chunk_tokens, self.edges = chunk_tokens, edges
        divisor = place.sequence_divisor
        self.passes = []  # per row: the long row and the short one, each this rank's part, with its origin
        for row in rows:
            short, origin = windowed_row(row, window, divisor)
            length = row["input_ids"].shape[1]
            long_origin = torch.where(row["labels"][0] != IGNORE_INDEX, torch.arange(length), -1)
            self.passes.append([(self._shard(row), self._cut(long_origin)), (self._shard(short), self._cut(origin))])
        self.rows = rows

    def _shard(self, row: Batch) -> Batch:
        cut = {key: self._cut(row[key][0])[None] for key in ("input_ids", "labels", "position_ids")}
        return {**cut, "cu_seqlens": row["cu_seqlens"]}

    def _cut(self, values: Tensor) -> Tensor:
        return self.place.shard(values[None], dim=1)[0]

    @torch.no_grad()
    def measure(self, hidden_states: FinalHiddenStates) -> dict[str, object]:
        """``val_key_loss`` (mean loss of the key tokens with the whole row; None without any), ``val_key_tokens``
        and ``val_key_loss_by_position`` (the position buckets of the plain loss)."""
        length = self.rows[0]["input_ids"].shape[1]
        logprobs = torch.zeros(len(self.rows), 2, length, dtype=torch.float64, device=self.device)
        for index, keep in self.turns:
            for which, (row, origin) in enumerate(self.passes[index]):
                hidden = hidden_states(row["input_ids"].to(self.device), row["position_ids"].to(self.device),
                                       row["cu_seqlens"][0])  # fmt: skip
                where = origin >= 0
                values = chunked_token_logprobs(
                    hidden[0, where.to(self.device)],
                    hidden_states.model.lm_head.weight,
                    row["labels"][0, where].to(self.device),
                    chunk_tokens=self.chunk_tokens,
                )
                if keep:
                    logprobs[index, which, origin[where].to(self.device)] = values.double()
        dist.all_reduce(logprobs, group=self.group)  # cp: disjoint positions; dp: disjoint rows
        logprobs = logprobs.cpu()
        labelled = torch.stack([row["labels"][0] != IGNORE_INDEX for row in self.rows])
        whole, window = logprobs[:, 0], logprobs[:, 1]
        key = labelled & (whole - window > ALPHA) & (whole > BETA)
        positions = torch.stack([row["position_ids"][0] for row in self.rows])
        by_position = {}
        for low, high in zip(self.edges, self.edges[1:]):
            inside = key & (positions >= low) & (positions < high)
            by_position[f"{low}-{high}"] = float(-whole[inside].mean()) if inside.any() else None
        return {
            "val_key_loss": float(-whole[key].mean()) if key.any() else None,
            "val_key_tokens": int(key.sum()),
            "val_key_loss_by_position": by_position,
        }
