"""The router's load-balancing loss as an objective: ``RouterBalancedLoss`` wraps the job's objective
(``TokenMeanLoss``) and adds ``router_aux_loss_coef`` times transformers' ``load_balancing_loss_func`` of each row
(or of the step's rows: ``train.router_aux_scope=global``), exact under context parallelism from the routers'
statistics (``lctrain.models.moe``, which derives the rank's share), reporting ``lm_loss``, ``aux_loss`` and each MoE
layer's least and most loaded expert (``expert_load_min/<layer>``, ``expert_load_max/<layer>``, by decoder layer
index: fractions of the layer's routed assignments in the step; ``1/E`` each when balanced)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lctrain.models.moe import Routers, RouterTotals, balance_loss_share
from lctrain.train.objective import Objective


class RouterBalancedLoss:
    """An objective (``lctrain.train.objective``'s interface) that adds ``coef`` × the router's load-balancing loss
    to ``inner``'s loss. ``layers``: the model's MoE decoder layers, ``num_experts`` their experts; ``totals``: the
    whole model's ``RouterTotals``, or None when pipeline stages pass their totals to the last stage (a row's field
    ``carried``, added by the stage). ``scope``: ``sequence``, the mean over the step's rows of each row's loss
    (statistics summed over ``cp_group``, ring × Ulysses); ``global``, one loss over the step's rows (dp ×
    accumulation), whose counts ``step_counts`` takes from a no-grad run of every row first (``forward``: the
    model's forward-only run of a step's rows with a head, ``lctrain.train.forward``), summed over ``group`` (dp_cp).

    Counts: ``inner``'s, then the step's rows over ``group`` (each counted once per context-parallel rank), then with
    ``global`` the step's routed counts ``[layers · E]`` and tokens per layer. Report sums: the LM share, the
    auxiliary share, the row's routed counts on this rank ``[layers · E]``, then ``inner``'s."""

    def __init__(
        self,
        inner: Objective,
        totals: RouterTotals | None,
        layers: Sequence[int],
        num_experts: int,
        *,
        coef: float,
        group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None,
        scope: str = "sequence",
        forward: Callable[..., Tensor | None] | None = None,
    ):
        if scope == "global" and forward is None:
            raise ValueError("router_aux_scope=global needs forward, the model's forward-only run of a step's rows")
        self.inner, self.totals, self.coef, self.scope, self.forward = inner, totals, coef, scope, forward
        self.group, self.cp_group = group, cp_group
        self.cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.fields, self.counted = inner.fields, inner.counted
        self.layers, self.experts = list(layers), num_experts
        self.own = 1 if scope == "sequence" else 2 + len(self.layers) * self.experts  # counts after inner's
        self.report_size = 2 + len(self.layers) * self.experts + inner.report_size

    def _row_totals(self, hidden: Tensor, row: dict[str, Any]) -> Tensor:
        """The row's router totals on this rank (``RouterTotals``): carried by the pipeline stages, or taken from
        the whole model's forward that made ``hidden``."""
        return row["carried"] if "carried" in row else self.totals(None)

    def _routed(self, hidden: Tensor, weight: Tensor, row: dict[str, Any]) -> Tensor:
        """The global scope's first pass, a head: the row's routed counts ``[layers · E]`` and tokens on this
        rank."""
        totals = self._row_totals(hidden, row)
        return torch.cat([totals[:-1].reshape(-1), totals.new_tensor([hidden.shape[1]])])

    def step_counts(self, micro_batches: Sequence[dict[str, Any]]) -> Tensor:
        counts = self.inner.step_counts(micro_batches)
        rows = sum(batch["input_ids"].shape[0] for batch in micro_batches)
        own = [torch.tensor([rows], dtype=counts.dtype, device=counts.device)]
        if self.scope == "global":
            # the routing the step's forward will take: its parameters do not change (None off a pipeline's last
            # stage, which adds zeros)
            with torch.no_grad():
                routed = self.forward(micro_batches, (), self._routed)
            width = len(self.layers) * self.experts + 1
            step = torch.zeros(width, device=counts.device) if routed is None else routed.sum(0)
            own.append(step.to(counts.dtype))
        own = torch.cat(own)
        dist.all_reduce(own, group=self.group)
        return torch.cat([counts, own])

    def loss(self, hidden: Tensor, weight: Tensor, row: dict[str, Any], counts: Tensor) -> tuple[Tensor, Tensor]:
        lm_share, inner_sums = self.inner.loss(hidden, weight, row, counts[: -self.own])
        totals = self._row_totals(hidden, row)
        local_counts, probs = totals[:-1].detach(), totals[-1:]
        width = len(self.layers) * self.experts
        if self.scope == "global":  # the step's counts and tokens, over every rank
            routed, tokens = counts[-1 - width : -1].view(len(self.layers), self.experts), counts[-1]
            aux_share = balance_loss_share(routed, probs, tokens)
        else:  # the row's counts and tokens over its context-parallel ranks: [layers · E + 1]
            reduced = torch.cat([local_counts.reshape(-1), local_counts.new_tensor([hidden.shape[1]])])
            if self.cp_group is not None:
                dist.all_reduce(reduced, group=self.cp_group)
            routed = reduced[:-1].view(len(self.layers), self.experts)
            # the mean over the step's rows (counts[-1]: each row once per context-parallel rank)
            aux_share = balance_loss_share(routed, probs, reduced[-1]) * self.cp / counts[-1].clamp(min=1)
        share = lm_share + (self.coef * aux_share).to(lm_share.dtype)
        report = [lm_share.detach().double().view(1), aux_share.detach().view(1), local_counts.double().view(-1)]
        return share, torch.cat([*report, inner_sums])

    def report(self, counts: Sequence[float], sums: Sequence[float]) -> dict[str, float | None]:
        width = len(self.layers) * self.experts
        result = self.inner.report(counts[: -self.own], sums[2 + width :])
        result |= {"lm_loss": sums[0], "aux_loss": sums[1]}
        routed = torch.tensor(sums[2 : 2 + width]).view(len(self.layers), self.experts)
        load = routed / routed.sum(-1, keepdim=True).clamp(min=1)
        for layer, fractions in zip(self.layers, load.tolist()):
            result[f"expert_load_min/{layer}"] = min(fractions)
            result[f"expert_load_max/{layer}"] = max(fractions)
        return result


def with_router_loss(
    objective: Objective,
    routers: Routers | None,
    totals: RouterTotals | None,
    *,
    group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup | None,
    scope: str = "sequence",
    forward: Callable[..., Tensor | None] | None = None,
) -> Objective | RouterBalancedLoss:
    """``objective`` with the router's load-balancing loss of the model's ``routers`` (``lctrain.models.moe.Routers``:
    its layers, experts and weight), pooled over ``scope`` (``train.router_aux_scope``), and the experts' load (with a
    weight of 0, the load only); ``objective`` itself for a dense model (``routers`` None). ``totals``: the whole
    model's ``RouterTotals``, or None when the pipeline stages carry theirs (``lctrain.build.build_model`` made
    both)."""
    if routers is None:
        return objective
    return RouterBalancedLoss(
        objective,
        totals,
        routers.layers,
        routers.num_experts,
        coef=routers.coef,
        group=group,
        cp_group=cp_group,
        scope=scope,
        forward=forward,
    )
