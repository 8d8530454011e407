"""The preference objective: DPO and its family on packed pairs, behind the trainer's objective interface
(``lctrain.train.objective``), exact on any dp x ring x Ulysses mesh with gradient accumulation.

A row holds whole pairs ``[prompt | chosen | rejected]`` (docs/preference.md has the layout). Its ``completions``
field numbers each trained token's completion within the row: ``2k`` pair k's chosen, ``2k + 1`` its rejected, -1
elsewhere. Per row:

1. each trained token's log-prob from the final hidden states and the LM head, a chunk of tokens at a time
   (``chunked_token_logprobs``: only the row's completion tokens, never ``[tokens, vocab]``);
2. each completion's sum of log-probs and its token count, summed over the context-parallel group (ring x
   Ulysses) by a differentiable all-reduce: every cp rank then holds every completion's whole sum and count;
3. each pair's loss from the weighted ``objective.loss_type`` terms (TRL's definitions; length normalisations use
   the completion's whole token count), summed over the row's pairs and divided by the step's pairs (over dp and the
   accumulation micro-batches, ``step_counts``): the step's loss is the mean over its pairs. The ``sft`` term is,
   as in TRL, the token mean of the chosen answers' cross-entropy over the step.

Every cp rank computes the same pair losses from the same sums, so each back-propagates ``1 / cp`` of its share: the
all-reduce's backward sums the cp ranks' gradients of the sums, so the gradient reaching each rank's part of a sum
is exactly the loss's (and the report sums are divided the same way, as the trainer sums them over every rank).

The reference model's log-probs (the losses that compare with one) are computed in ``step_counts``, before any
forward of the policy in the step, without gradients, through the same patched attention, sharding and pipeline
stages, or looked up among those computed before training (``lctrain.train.reference``); each micro-batch gets them
as a field of its rows, ``reference_logps`` (fp64 ``[2K]`` a row), which ``loss`` reads like the others. With a
pipeline only the last stage computes losses, so only it holds them (the other stages get empty ones).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lctrain.config import ObjectiveConfig
from lctrain.models.hidden_states import FinalHiddenStates
from lctrain.train.forward import model_hidden
from lctrain.train.loss import chunked_token_logprobs
from lctrain.train.reference import Reference, ReferenceCache
from lctrain.train.validate import dp_turns

Batch = dict[str, Any]

# the fields of a row the reference pass reads
REFERENCE_FIELDS = ("labels", "completions", "pair_counts")
# the pair metrics, TRL's names, in the order of the report sums (after the pair count)
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` over ``group`` whose backward all-reduces the gradient: each rank's part of a sum gets
    the gradient of the whole sum (summed over the ranks that use it)."""

    @staticmethod
    def forward(ctx, tensor: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


@dataclass
class Completions:
    """A row's completions, whole (summed over the context-parallel group): fp64 ``[2K]`` each, completion ``2k``
    pair k's chosen and ``2k + 1`` its rejected."""

    logps: Tensor  # the sum of the completion's token log-probs (differentiable when computed with gradients)
    tokens: Tensor  # its trained tokens
    sources: Tensor  # the index of its source (0 with one source)

    @property
    def chosen(self) -> Tensor:
        return self.logps[0::2]

    @property
    def rejected(self) -> Tensor:
        return self.logps[1::2]


def completion_logps(
    hidden: Tensor,
    weight: Tensor,
    row: Batch,
    num_pairs: int,
    *,
    cp_group: dist.ProcessGroup | None,
    chunk_tokens: int,
) -> Completions:
    """Each completion's log-prob sum, token count and source over the whole row, from this rank's ``hidden``
    ``[1, S_local, H]`` and the LM head ``weight`` ``[vocab, H]``; ``row``: ``labels``, ``completions`` (and
    ``sources``) ``[1, S_local]`` on the device. One host sync (the positions of this rank's completion tokens)."""
    completions = row["completions"].reshape(-1)
    positions = (completions >= 0).nonzero().squeeze(1)  # this rank's completion tokens (none: an empty sum)
    ids = completions[positions]
    logps = chunked_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions),
        weight,
        row["labels"].reshape(-1)[positions],
        chunk_tokens=chunk_tokens,
    )
    n = 2 * num_pairs
    sums = hidden.new_zeros(n, dtype=torch.float64).index_add(0, ids, logps.double())
    counts = torch.zeros(n, dtype=torch.float64, device=hidden.device).index_add_(
        0, ids, torch.ones_like(ids, dtype=torch.float64)
    )
    sources = torch.zeros_like(counts)
    if "sources" in row:
        sources.index_add_(0, ids, row["sources"].reshape(-1)[positions].double())
    packed = torch.cat([sums, counts, sources])  # one all-reduce for the three
    if cp_group is not None:
        packed = _SumOverGroup.apply(packed, cp_group)
    sums, counts, sources = packed.split([n, n, n])  # sizes, not a chunk size: a row without a pair has n = 0
    return Completions(sums, counts.detach(), (sources.detach() / counts.detach().clamp(min=1)).round().long())


def reference_completions(logps: Tensor) -> Completions:
    """The reference's ``Completions`` of a row from its log-probs ``[2K]`` (the losses read no more of them)."""
    return Completions(logps, torch.zeros_like(logps), torch.zeros_like(logps, dtype=torch.long))


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-ln 2``."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_losses(
    objective: ObjectiveConfig,
    policy: Completions,
    reference: Completions | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The weighted pair terms of ``objective.loss_type`` (all but ``sft``, a token mean over the step: see
    ``PreferenceLoss.loss``) for each pair: fp64 ``[K]``; and the rewards of the chosen and rejected answers
    (``beta`` times the log-ratio to the reference; without a reference, ``beta`` times the mean token log-prob, as
    TRL's reference-free trainers report them), detached."""
    beta, smoothing = objective.beta, objective.label_smoothing
    chosen, rejected = policy.chosen, policy.rejected
    chosen_tokens, rejected_tokens = policy.tokens[0::2].clamp(min=1), policy.tokens[1::2].clamp(min=1)
    chosen_mean, rejected_mean = chosen / chosen_tokens, rejected / rejected_tokens
    if reference is not None:
        chosen_ratio, rejected_ratio = chosen - reference.chosen, rejected - reference.rejected
        delta = chosen_ratio - rejected_ratio
    weights = objective.loss_weights or [1.0] * len(objective.loss_type)
    total = torch.zeros_like(chosen)
    for loss_type, loss_weight in zip(objective.loss_type, weights, strict=True):
        if loss_type == "sigmoid":
            term = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            term = torch.relu(1 - beta * delta)
        elif loss_type == "ipo":  # the log-ratios per token of each completion (TRL's IPO)
            term = (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2
        elif loss_type == "robust":
            term = (-(1 - smoothing) * F.logsigmoid(beta * delta) + smoothing * F.logsigmoid(-beta * delta)) / (
                1 - 2 * smoothing
            )
        elif loss_type == "simpo":
            logits = chosen_mean - rejected_mean - objective.simpo_gamma / beta
            term = -(1 - smoothing) * F.logsigmoid(beta * logits) - smoothing * F.logsigmoid(-beta * logits)
        elif loss_type == "orpo":
            log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
            term = -beta * F.logsigmoid(log_odds)
        else:  # sft: a token mean over the step, not a pair term
            continue
        total = total + loss_weight * term
    if reference is not None:
        rewards = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    else:
        rewards = beta * chosen_mean.detach(), beta * rejected_mean.detach()
    return total, *rewards


def pair_metrics(policy: Completions, chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Each pair's ``[1, *PAIR_METRICS]`` (the 1 counts it): fp64 ``[K, 1 + len(PAIR_METRICS)]``, detached."""
    return torch.stack(
        [
            torch.ones_like(chosen_rewards),
            chosen_rewards,
            rejected_rewards,
            (chosen_rewards > rejected_rewards).double(),
            chosen_rewards - rejected_rewards,
            policy.chosen.detach(),
            policy.rejected.detach(),
        ],
        dim=1,
    )


class PreferenceLoss:
    """The preference objective (module docstring). ``group``: dp_cp; ``cp_group``: ring x Ulysses (None at size 1);
    ``sources``: the source names (per-source metrics with several); ``reference``: None for reference-free losses.

    Counts: ``[pairs of the step over dp, chosen tokens of the step over dp_cp]``. Report sums: for all pairs, then
    each source (with several): ``[pairs, *PAIR_METRICS]`` summed over the pairs."""

    counted = "preference pair"  # what counts[0] counts, in words

    def __init__(
        self,
        objective: ObjectiveConfig,
        sources: Sequence[str],
        *,
        group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None,
        device: torch.device,
        chunk_tokens: int,
        reference: Reference | None,
        last_stage: bool = True,
    ):
        if objective.needs_reference and reference is None:
            raise ValueError(f"objective.loss_type={list(objective.loss_type)} needs a reference model")
        self.objective = objective
        self.sources = list(sources) if len(sources) > 1 else []
        self.group, self.cp_group, self.device, self.chunk_tokens = group, cp_group, device, chunk_tokens
        self.cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.reference = reference if objective.needs_reference else None
        self.last_stage = last_stage  # False off a pipeline's last stage, which alone computes losses
        fields = ["labels", "completions", "pair_counts", *(["sources"] if self.sources else [])]
        self.fields = (*fields, *(["reference_logps"] if self.reference is not None else []))
        self.report_size = (1 + len(self.sources)) * (1 + len(PAIR_METRICS))
        weights = objective.loss_weights or [1.0] * len(objective.loss_type)
        self.sft_weight = dict(zip(objective.loss_type, weights)).get("sft", 0.0)
        self.cache: ReferenceCache | None = None  # precomputed reference log-probs (precompute_reference)

    def precompute_reference(self, steps: Iterable[Sequence[Batch]], cache: ReferenceCache) -> None:
        """The reference's log-probs of every row of ``steps`` (each a step's micro-batches of this rank, host
        tensors) into ``cache``, saved (by the last stage's first cp rank of each dp rank); from now on the steps
        and the validation look them up and the reference model is dropped (a frozen copy's memory is freed)."""
        if self.reference is None:
            return
        for micro_batches in steps:
            logps = self.reference_logps(micro_batches)  # every pipeline stage takes part; the last keeps them
            if self.last_stage:
                for batch, rows in zip(micro_batches, logps):
                    for pair_ids, row_logps in zip(batch["pair_ids"], rows):
                        cache.add(pair_ids, row_logps)
        if self.cp_rank == 0 and self.last_stage:
            cache.save()
        self.use_cache(cache)

    def use_cache(self, cache: ReferenceCache) -> None:
        """Look the reference's log-probs up in ``cache`` instead of computing them; the model is dropped."""
        if self.reference is not None:
            self.cache, self.reference = cache, None

    def reference_logps(self, micro_batches: Sequence[Batch]) -> list[list[Tensor]]:
        """The reference's log-probs (fp64 ``[2K]`` on the device) of each row of each micro-batch (host tensors):
        looked up in the cache, or computed through the reference's forward (with a pipeline every stage takes part
        in it); empty off a pipeline's last stage."""
        pair_counts = [[int(k) for k in batch["pair_counts"]] for batch in micro_batches]
        outputs = None
        if self.cache is None:
            width = 2 * max(max(counts, default=0) for counts in pair_counts)
            outputs = self.reference(micro_batches, REFERENCE_FIELDS, functools.partial(self._padded_logps, width))
        if not self.last_stage:
            empty = torch.zeros(0, dtype=torch.float64, device=self.device)
            return [[empty for _ in counts] for counts in pair_counts]
        if self.cache is not None:
            return [[self.cache.lookup(ids, self.device) for ids in batch["pair_ids"]] for batch in micro_batches]
        rows = iter(outputs)
        return [[next(rows)[: 2 * k] for k in counts] for counts in pair_counts]

    def _padded_logps(self, width: int, hidden: Tensor, weight: Tensor, row: Batch) -> Tensor:
        """The reference pass's head: a row's completion log-probs (fp64 ``[2K]``) padded to ``width``."""
        logps = completion_logps(
            hidden, weight, row, int(row["pair_counts"]), cp_group=self.cp_group, chunk_tokens=self.chunk_tokens
        ).logps
        return F.pad(logps, (0, width - logps.numel()))

    def step_counts(self, micro_batches: Sequence[Batch]) -> Tensor:
        """int64 ``[2]`` on the device: the step's pairs (counted once per dp rank: the cp ranks of a dp rank hold the
        same pairs) and chosen tokens, summed over dp_cp; then, with a reference, each micro-batch's
        ``reference_logps`` (a list: one tensor a row)."""
        pairs = sum(sum(batch["pair_counts"]) for batch in micro_batches) if self.cp_rank == 0 else 0
        chosen = sum(int(((b["completions"] >= 0) & (b["completions"] % 2 == 0)).sum()) for b in micro_batches)
        counts = torch.tensor([pairs, chosen], dtype=torch.int64).to(self.device, non_blocking=True)
        dist.all_reduce(counts, group=self.group)
        if self.reference is not None or self.cache is not None:
            for batch, logps in zip(micro_batches, self.reference_logps(micro_batches)):
                batch["reference_logps"] = logps
        return counts

    def loss(self, hidden: Tensor, weight: Tensor, row: Batch, counts: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's share of the step's loss from one row (``1 / cp`` of the row's pairs' loss over the step's
        pairs, plus the ``sft`` term's part) and the row's report sums (fp64 ``[report_size]``, detached, also
        ``1 / cp``). ``row["pair_counts"]`` is an int or a ``[1]`` tensor, ``row["reference_logps"]`` ``[2K]`` or
        a longer padded one (a pipeline's stacked rows: ``step_inputs``)."""
        num_pairs = int(row["pair_counts"])
        policy = completion_logps(
            hidden, weight, row, num_pairs, cp_group=self.cp_group, chunk_tokens=self.chunk_tokens
        )
        reference = None
        if "reference_logps" in row:
            reference = reference_completions(row["reference_logps"].reshape(-1)[: 2 * num_pairs])
        losses, chosen_rewards, rejected_rewards = pair_losses(self.objective, policy, reference)
        pairs, chosen_tokens = counts[0].clamp(min=1), counts[1].clamp(min=1)
        share = losses.sum() / pairs
        if self.sft_weight:
            share = share - self.sft_weight * policy.chosen.sum() / chosen_tokens
        metrics = pair_metrics(policy, chosen_rewards, rejected_rewards)
        sums = [metrics.sum(0)]
        if self.sources:
            by_source = metrics.new_zeros(len(self.sources), metrics.shape[1])
            sums.append(by_source.index_add_(0, policy.sources[0::2], metrics).reshape(-1))
        return (share / self.cp).float(), torch.cat(sums) / self.cp

    @torch.no_grad()
    def validate(
        self, rows: Sequence[Batch], hidden_states: FinalHiddenStates, *, dp_rank: int, dp: int
    ) -> dict[str, float | None]:
        """Validation pairs: ``rows`` (this rank's part of each, batches of one row, every rank the same rows) scored
        without gradients through ``hidden_states`` (the training model's forward) and the reference, dp rank d taking
        rows d, d + dp, ... (``dp_turns``). Returns ``val_loss`` (the objective over all the rows' pairs),
        ``val_pairs`` and ``val_<metric>`` for ``PAIR_METRICS``; reads the sums back to the host."""
        # [pairs, *PAIR_METRICS, pair-term losses, chosen log-probs, chosen tokens], summed over the kept rows
        totals = torch.zeros(len(PAIR_METRICS) + 4, dtype=torch.float64, device=self.device)
        for index, keep in dp_turns(len(rows), dp_rank, dp):
            row = rows[index]
            reference = None
            if self.reference is not None or self.cache is not None:
                reference = reference_completions(self.reference_logps([row])[0][0])
            fields = {key: row[key].to(self.device) for key in ("labels", "completions")}
            policy = completion_logps(
                model_hidden(hidden_states, row, 0, self.device),
                hidden_states.model.lm_head.weight,
                fields,
                row["pair_counts"][0],
                cp_group=self.cp_group,
                chunk_tokens=self.chunk_tokens,
            )
            losses, chosen_rewards, rejected_rewards = pair_losses(self.objective, policy, reference)
            if keep:
                extra = torch.stack([losses.sum(), policy.chosen.sum(), policy.tokens[0::2].sum()])
                totals += torch.cat([pair_metrics(policy, chosen_rewards, rejected_rewards).sum(0), extra])
        dist.all_reduce(totals, group=self.group)
        values = (totals / self.cp).tolist()  # every cp rank of a dp rank scored the same pairs
        pairs, metrics, (pair_loss, chosen_logps, chosen_tokens) = values[0], values[1:-3], values[-3:]
        loss = pair_loss / pairs - self.sft_weight * chosen_logps / chosen_tokens if pairs else None
        result: dict[str, float | None] = {"val_loss": loss, "val_pairs": int(round(pairs))}
        result.update({f"val_{name}": value / pairs if pairs else None for name, value in zip(PAIR_METRICS, metrics)})
        return result

    def report(self, counts: Sequence[float], sums: Sequence[float]) -> dict[str, float | None]:
        """``pairs`` and TRL's pair metrics (``PAIR_METRICS``: means over the step's pairs), then with several sources
        ``pairs/<name>`` and ``<metric>/<name>``; a metric without a pair is None."""
        width = 1 + len(PAIR_METRICS)
        result: dict[str, float | None] = {"pairs": int(counts[0])}
        for index, suffix in enumerate(["", *(f"/{name}" for name in self.sources)]):
            part = sums[index * width : (index + 1) * width]
            if suffix:
                result[f"pairs{suffix}"] = int(round(part[0]))
            for name, value in zip(PAIR_METRICS, part[1:]):
                result[f"{name}{suffix}"] = value / part[0] if part[0] else None
        return result
