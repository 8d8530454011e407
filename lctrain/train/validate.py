"""Validation during training: held-out rows scored on the training mesh without gradients.

``Validator`` holds ``train.val_rows`` packed rows of ``data.val_sources`` (this rank's part of each, the same rows
on every dp rank and at every validation); ``should_validate(step)`` says when (every ``train.val_every`` steps and
at the last), ``validate(hidden_states)`` scores them through the model's forward. ``score_rows`` is the scoring
itself, shared with ``lctrain eval``'s perplexity: every rank scores its part of the rows of its dp turns
(``dp_turns``) and the sums are all-reduced over dp_cp.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.attention import SequencePlace
from lctrain.config import TrainConfig
from lctrain.data import DataConfig, PackedLoader
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.train.key_tokens import KeyTokens
from lctrain.train.loss import chunked_cross_entropy_by_group

Batch = dict[str, Any]


def position_buckets(seq_len: int) -> list[int]:
    """The edges ``[0, b, 4b, 16b, ..., seq_len]`` of the validation's loss-by-position buckets: ``b`` = 4096, or
    for rows shorter than 64K the largest power of 4 with 16·b <= seq_len, so that there are at least three buckets
    (seq_len 1024: [0, 64), [64, 256), [256, 1024); 131072: [0, 4K), [4K, 16K), [16K, 64K), [64K, 128K))."""
    first = 4096
    while first > 1 and 16 * first > seq_len:
        first //= 4
    edges = [0]
    while first < seq_len:
        edges.append(first)
        first *= 4
    return [*edges, seq_len]


def validation_data(data: DataConfig) -> DataConfig:
    """The data section of the validation rows: ``data.val_sources`` only (read from their files), packed with
    ``truncate``."""
    return dataclasses.replace(
        data,
        paths=[],
        dataset=None,
        sources=data.val_sources,
        val_sources=[],
        batch_size=1,
        truncate=True,
        prepared=None,
    )


def dp_turns(count: int, dp_rank: int, dp: int) -> Iterator[tuple[int, bool]]:
    """(index, keep) for dp rank ``dp_rank`` of ``dp``: items ``dp_rank, dp_rank + dp, ...``; every rank gets the
    same number of turns, and a turn past the end repeats item 0 with ``keep=False`` (a forward FSDP needs, then
    dropped)."""
    for turn in range(math.ceil(count / dp)):
        index = turn * dp + dp_rank
        yield (index, True) if index < count else (0, False)


@torch.no_grad()
def score_rows(
    hidden_states: FinalHiddenStates,
    rows: Sequence[Batch],
    *,
    groups: Sequence[Tensor] | None = None,
    num_groups: int = 1,
    dp_rank: int,
    dp: int,
    group: dist.ProcessGroup,
    device: torch.device,
    chunk_tokens: int,
) -> Tensor:
    """The summed negative log-likelihood and the number of predicted tokens of each group of tokens over
    ``rows``: float64 ``[num_groups, 2]``, the same on every rank of ``group`` (dp_cp).

    Each row is one batch of this rank's part of one packed row (``input_ids``, ``labels``, ``position_ids``
    ``[1, S_local]``, ``cu_seqlens``); ``groups[i]`` (``[1, S_local]`` ints in ``[0, num_groups)``) puts each token
    of row i in a group (None: one group). Dp rank d scores rows d, d + dp, ... (``dp_turns``) and the sums are
    all-reduced over ``group``: context-parallel ranks add their parts of a row, dp ranks their rows."""
    totals = torch.zeros(num_groups, 2, dtype=torch.float64, device=device)
    for index, keep in dp_turns(len(rows), dp_rank, dp):
        row = rows[index]
        hidden = hidden_states(row["input_ids"].to(device), row["position_ids"].to(device), row["cu_seqlens"][0])
        labels = row["labels"].to(device)
        row_groups = torch.zeros_like(labels) if groups is None else groups[index].to(device)
        _, sums, counts = chunked_cross_entropy_by_group(
            hidden, hidden_states.model.lm_head.weight, labels, row_groups, num_groups, chunk_tokens=chunk_tokens
        )
        if keep:
            totals += torch.stack([sums, counts.double()], dim=1)
    dist.all_reduce(totals, group=group)
    return totals


class Validator:
    """The validation of one training job. ``data`` is the job's data section with its tokenizer resolved; the rows
    are read here, before the model is built. Without ``data.val_sources`` it never validates."""

    def __init__(
        self,
        data: DataConfig,
        train: TrainConfig,
        *,
        place: SequencePlace,
        dp_rank: int,
        dp: int,
        group: dist.ProcessGroup,
        device: torch.device,
    ):
        self.names = [source.name for source in data.val_sources]
        self.edges = position_buckets(data.seq_len)
        self.every, self.steps, self.chunk_tokens = train.val_every, train.steps, train.loss_chunk_tokens
        self.dp_rank, self.dp, self.group, self.device = dp_rank, dp, group, device
        self.rows, self.groups = self._rows(data, train.val_rows, place) if self.names else ([], [])
        self.key_tokens = None  # train.val_key_window: the same rows whole, and each cut in windows
        if self.rows and train.val_key_window and "pair_counts" not in self.rows[0]:
            whole = iter(PackedLoader(validation_data(data)))
            self.key_tokens = KeyTokens(
                [next(whole) for _ in range(train.val_rows)],
                train.val_key_window,
                self.edges,
                place=place,
                turns=dp_turns(train.val_rows, dp_rank, dp),
                group=group,
                device=device,
                chunk_tokens=train.loss_chunk_tokens,
            )

    def _rows(self, data: DataConfig, count: int, place: SequencePlace) -> tuple[list[Batch], list[Tensor]]:
        """``count`` rows of ``data.val_sources``, packed with ``truncate``: every row starts at a document start, so a
        token's position is the context it is predicted from. Each token's group: its source x its position bucket
        (``position_buckets``)."""
        rows = iter(PackedLoader(validation_data(data), place=place))
        batches = [next(rows) for _ in range(count)]
        inner = torch.tensor(self.edges[1:-1])
        buckets = len(self.edges) - 1
        groups = [
            batch["sources"].long() * buckets + torch.bucketize(batch["position_ids"], inner, right=True)
            for batch in batches
        ]
        return batches, groups

    def should_validate(self, step: int) -> bool:
        """After optimizer step ``step``: every ``train.val_every`` steps (0: never) and at the last step."""
        return bool(self.rows) and (step == self.steps or (self.every > 0 and step % self.every == 0))

    def validate(self, hidden_states: FinalHiddenStates, objective: Any) -> dict[str, Any]:
        """The rows scored through ``hidden_states`` (the training model's forward) without gradients: ``val_loss``
        (the token mean), ``val_tokens``, ``val_loss_by_position`` (``"a-b"``: the mean loss of the tokens predicted
        at document positions [a, b); None where there is none) and, with several validation sources,
        ``val_loss/<name>``; with ``train.val_key_window``, the key-token loss (``lctrain.train.key_tokens``:
        ``val_key_loss``, ``val_key_tokens``, ``val_key_loss_by_position``). Rows of preference pairs are scored by
        the job's ``objective`` instead (``PreferenceLoss.validate``: the pair metrics). Reads the sums back to the
        host."""
        if "pair_counts" in self.rows[0]:
            return objective.validate(self.rows, hidden_states, dp_rank=self.dp_rank, dp=self.dp)
        buckets = len(self.edges) - 1
        totals = score_rows(
            hidden_states,
            self.rows,
            groups=self.groups,
            num_groups=len(self.names) * buckets,
            dp_rank=self.dp_rank,
            dp=self.dp,
            group=self.group,
            device=self.device,
            chunk_tokens=self.chunk_tokens,
        )
        sums = totals.view(len(self.names), buckets, 2).cpu()  # [source, bucket, (NLL, tokens)]

        def mean(part: Tensor) -> float | None:
            nll, tokens = part.reshape(-1, 2).sum(0).tolist()
            return nll / tokens if tokens else None

        edges = self.edges
        result = {
            "val_loss": mean(sums),
            "val_tokens": int(sums[..., 1].sum()),
            "val_loss_by_position": {f"{edges[b]}-{edges[b + 1]}": mean(sums[:, b]) for b in range(buckets)},
        }
        if len(self.names) > 1:
            result.update({f"val_loss/{name}": mean(sums[i]) for i, name in enumerate(self.names)})
        if self.key_tokens is not None:
            result.update(self.key_tokens.measure(hidden_states))
        return result
