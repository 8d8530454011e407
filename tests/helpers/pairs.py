"""Packed rows of preference pairs made by hand from token lists, as the preference source packs them, and the plain
single-process computation of the preference losses from TRL's formulas, which the objective's tests compare with.

Shared layout (the default): per pair ``[p[:-1]] [p[-1], c] [p[-1], r]``, the answers' segments seeing the first
document as their shared prefix (``doc_prefix``) and continuing the prompt's positions; unshared: ``[p, c] [p, r]``
as two plain documents. The trained tokens are exactly the completion tokens; ``completions`` numbers them ``2k``
(chosen) and ``2k + 1`` (rejected); the row's rest is padding (one document of token 0, positions from 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lctrain.attention import SequencePlace, shard_sequence
from lctrain.data import IGNORE_INDEX

Pair = tuple[Sequence[int], Sequence[int], Sequence[int]]  # prompt, chosen, rejected token ids
Row = dict


def pack_pairs(pairs: Sequence[Pair], seq_len: int, *, shared: bool = True, source: int = 0) -> Row:
    """One global row (1-D tensors of ``seq_len``: ``input_ids``, ``position_ids``, ``labels``, ``completions``,
    ``sources``; ``cu_seqlens`` int32, ``doc_prefix`` int64, ``pair_count``) holding ``pairs`` whole."""
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
    batch["pair_ids"] = [torch.arange(row["pair_count"], dtype=torch.int64) for row in rows]
    return batch


def sequence_logps(model: torch.nn.Module, pairs: Sequence[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's summed log-prob and token count under the plain ``model``, every ``[prompt, answer]`` a
    sequence of its own (the unshared layout): fp64 ``[2K]`` (chosen, rejected, chosen, ...) and ``[2K]``."""
    logps, counts = [], []
    for prompt, chosen, rejected in pairs:
        for answer in (chosen, rejected):
            ids = torch.tensor([*prompt, *answer])[None]
            logits = model(input_ids=ids).logits[0, :-1].double()
            token_logps = F.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
            logps.append(token_logps[len(prompt) - 1 :].sum())
            counts.append(float(len(answer)))
    return torch.stack(logps), torch.tensor(counts, dtype=torch.float64)


def trl_loss(
    loss_type: str,
    policy: torch.Tensor,
    reference: torch.Tensor | None,
    counts: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> torch.Tensor:
    """TRL's loss of one ``loss_type`` over a batch of pairs (``DPOTrainer``; ``simpo`` as ``CPOTrainer``, ``orpo``'s
    odds-ratio term as ``ORPOTrainer``, ``sft`` the token-mean cross-entropy of the chosen answers), written
    plainly: ``policy``, ``reference`` and ``counts`` ``[2K]`` as ``sequence_logps`` gives them."""
    pc, pr = policy[0::2], policy[1::2]
    nc, nr = counts[0::2], counts[1::2]
    if loss_type == "sft":
        return -pc.sum() / nc.sum()
    if loss_type in ("simpo", "orpo"):
        ac, ar = pc / nc, pr / nr
        if loss_type == "simpo":
            logits = ac - ar - simpo_gamma / beta
            losses = (
                -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
            )
        else:

            def log1mexp(x: torch.Tensor) -> torch.Tensor:
                return torch.log(-torch.expm1(x)) if x > -math.log(2) else torch.log1p(-torch.exp(x))

            log_odds = torch.stack([(a - b) - (log1mexp(a) - log1mexp(b)) for a, b in zip(ac, ar)])
            losses = -beta * F.logsigmoid(log_odds)
        return losses.mean()
    rc, rr = reference[0::2], reference[1::2]
    delta = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        losses = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
        flipped = -label_smoothing * F.logsigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * label_smoothing)
    else:
        raise ValueError(loss_type)
    return losses.mean()


def trl_metrics(policy: torch.Tensor, reference: torch.Tensor | None, counts: torch.Tensor, beta: float) -> dict:
    """TRL's pair metrics of a batch (rewards against the reference; without one, beta times the mean token
    log-prob, as its reference-free trainers)."""
    pc, pr = policy[0::2], policy[1::2]
    if reference is None:
        chosen, rejected = beta * pc / counts[0::2], beta * pr / counts[1::2]
    else:
        chosen, rejected = beta * (pc - reference[0::2]), beta * (pr - reference[1::2])
    return {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": (chosen > rejected).double().mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "logps/chosen": pc.mean().item(),
        "logps/rejected": pr.mean().item(),
    }
