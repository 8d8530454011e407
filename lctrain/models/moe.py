"""The routers of a mixture of experts (``qwen3_moe``, ``mixtral``): their load-balancing loss, exact under context
parallelism, and the experts' load.

transformers' ``load_balancing_loss_func`` (the Switch Transformer loss, which ``Qwen3MoeForCausalLM`` and
``MixtralForCausalLM`` add to the LM loss times ``router_aux_loss_coef``) pools every MoE layer's tokens of the rows
it is given: with ``p_t`` the softmax of a token's router logits (fp32) over the ``E`` experts, ``C_e`` the number of
times expert ``e`` is among the tokens' top-k, ``S_e = Σ_t p_t[e]`` and ``N`` the number of (layer, token) pairs,

    aux = E · Σ_e (C_e / N) · (S_e / N) = E / N² · Σ_e C_e S_e.

Only ``S`` carries a gradient (the top-k choice does not). lctrain computes it per packed row over all of the row's
tokens, padding included, as transformers does without an attention mask (packed rows have none). The row's tokens
are spread over the context-parallel ranks (ring × Ulysses), each holding partial ``C^r``, ``S^r``, ``N^r``; with
``C = Σ_r C^r`` and ``N = Σ_r N^r`` summed over the group (no gradient) the rank's share

    aux_r = E / N² · Σ_e C_e S^r_e

adds up over the ranks to the row's ``aux``, and so do its gradients, since ``∂aux/∂S^r_e = E C_e / N²`` is what
each rank's share gives its own ``S^r``: only the counts are reduced, no gradient crosses ranks (FSDP sums the
parameters' gradients over dp_cp as for the LM loss). The step's auxiliary loss is the mean over the step's rows
(dp × accumulation), as the LM loss is a mean over their tokens (``train.router_aux_scope=sequence``).

``train.router_aux_scope=global`` pools the statistics over the whole step instead (every row of every dp rank and
micro-batch: transformers' function on all of them at once, the global-batch balancing Qwen recommends for its MoE
models). The same share is exact with ``C`` and ``N`` the step's totals, which must be known before the first row's
backward: ``step_counts`` runs a no-grad forward of the step's rows first (the parameters do not change within a
step, so the routing is the one the training forward takes) and sums the counts over dp_cp. It costs one more
forward per row.

Neither family defines a router z-loss (no such term in transformers' modelling files or configs), so none is
computed.

``RouterStatistics`` takes ``C^r``, ``S^r`` and ``N^r`` from the routers by forward hooks, per MoE layer, armed by a
pre-hook on the decoder and disarmed by ``take``: the routers' second forward in the backward (activation
checkpointing, the chunked MLP recompute) is not counted again. ``RouterBalancedLoss`` wraps an objective
(``TokenMeanLoss``) and adds the auxiliary term to its share, reporting ``lm_loss``, ``aux_loss`` and each MoE
layer's least and most loaded expert (``expert_load_min/<layer>``, ``expert_load_max/<layer>``, by decoder layer
index: fractions of the layer's routed assignments in the step; ``1/E`` each when balanced).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's routers by decoder layer index, in layer order: the ``gate`` of each MoE block (a module with
    ``top_k`` and ``num_experts``, transformers' ``Qwen3MoeTopKRouter`` and ``MixtralTopKRouter``); a dense layer
    (Qwen3-MoE's ``mlp_only_layers``) has none."""
    found = {}
    for name, module in model.named_modules():
        if name.endswith(".gate") and hasattr(module, "top_k") and hasattr(module, "num_experts"):
            parts = name.split(".")
            found[int(parts[parts.index("layers") + 1])] = module
    return found


def router_statistics(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """One layer's ``C`` (fp32 ``[E]``, no gradient: each expert's top-k picks) and ``S`` (fp32 ``[E]``, the summed
    router probabilities) of ``logits`` ``[tokens, E]``, as ``load_balancing_loss_func`` computes them."""
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices
    counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
    counts.index_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device))
    return counts, probs.sum(dim=0)


class RouterStatistics:
    """Per MoE layer, this rank's ``C`` and ``S`` of the tokens of the last forward of ``model`` (see the module
    docstring). ``model.model`` is the decoder (its pre-hook starts a forward's statistics)."""

    def __init__(self, model: nn.Module):
        found = routers(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no routers (mlp.gate with top_k and num_experts)")
        self.layers = list(found)  # the decoder layer index of each router
        self.routers = list(found.values())
        self.num_experts = self.routers[0].num_experts
        self._layer = {id(router): index for index, router in enumerate(self.routers)}
        self._armed = False
        self._clear()
        model.model.register_forward_pre_hook(self._start)
        for router in self.routers:
            router.register_forward_hook(self._record)

    def _clear(self) -> None:
        self._counts: list[Tensor | None] = [None] * len(self.routers)
        self._sums: list[Tensor | None] = [None] * len(self.routers)
        self._tokens = 0

    def _start(self, module: nn.Module, args: Any) -> None:
        self._clear()
        self._armed = True

    def _record(self, module: nn.Module, args: Any, output: tuple[Tensor, ...]) -> None:
        # computed also in the recompute of a checkpointed forward (the backward), which must save the tensors the
        # forward saved, but not kept then
        counts, sums = router_statistics(output[0], module.top_k)
        if not self._armed:
            return
        layer = self._layer[id(module)]
        if layer == 0:
            self._tokens += output[0].shape[0]
        if self._counts[layer] is None:
            self._counts[layer], self._sums[layer] = counts, sums
        else:  # a chunked MLP calls the router once per chunk of tokens
            self._counts[layer] = self._counts[layer] + counts
            self._sums[layer] = self._sums[layer] + sums

    def take(self) -> tuple[Tensor, Tensor, int]:
        """The last forward's ``C`` (``[layers, E]``), ``S`` (``[layers, E]``, differentiable) and tokens per layer
        on this rank; stops recording until the next forward."""
        self._armed = False
        counts, sums, tokens = torch.stack(self._counts), torch.stack(self._sums), self._tokens
        self._clear()
        return counts, sums, tokens


def balance_loss_share(counts: Tensor, sums: Tensor, tokens: Tensor) -> Tensor:
    """This rank's share ``E / N² · Σ_e C_e S^r_e`` of a row's auxiliary loss: ``counts`` ``[layers, E]`` summed over
    the row's ranks, ``sums`` this rank's ``[layers, E]``, ``tokens`` the row's tokens per layer over its ranks (a
    scalar tensor). Summed over the ranks: transformers' ``load_balancing_loss_func`` of the row."""
    num_experts = counts.shape[-1]
    total = tokens.double() * counts.shape[0]  # N: (layer, token) pairs
    return num_experts * (counts.sum(0).double() * sums.sum(0).double()).sum() / total.square()


class RouterBalancedLoss:
    """An objective (``lctrain.train.objective``'s interface) that adds ``coef`` × the router's load-balancing loss
    to ``inner``'s loss. ``scope``: ``sequence``, the mean over the step's rows of each row's loss (statistics summed
    over ``cp_group``, ring × Ulysses); ``global``, one loss over the step's rows (dp × accumulation), whose counts
    ``step_counts`` takes from a no-grad forward of every row first (``forward_row(batch, row)``), summed over
    ``group`` (dp_cp).

    Counts: ``inner``'s, then the step's rows over ``group`` (each counted once per context-parallel rank), then with
    ``global`` the step's routed counts ``[layers · E]`` and tokens per layer. Report sums: the LM share, the
    auxiliary share, the row's routed counts on this rank ``[layers · E]``, then ``inner``'s."""

    def __init__(
        self,
        inner: Any,
        stats: RouterStatistics,
        *,
        coef: float,
        group: dist.ProcessGroup,
        cp_group: dist.ProcessGroup | None,
        scope: str = "sequence",
        forward_row: Callable[[dict[str, Any], int], Tensor] | None = None,
    ):
        if scope == "global" and forward_row is None:
            raise ValueError("router_aux_scope=global needs forward_row, the model's forward of one row")
        self.inner, self.stats, self.coef, self.scope, self.forward_row = inner, stats, coef, scope, forward_row
        self.group, self.cp_group = group, cp_group
        self.cp = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.fields, self.counted = inner.fields, inner.counted
        self.layers, self.experts = len(stats.routers), stats.num_experts
        self.own = 1 if scope == "sequence" else 2 + self.layers * self.experts  # counts after inner's

    def step_counts(self, micro_batches: Sequence[dict[str, Any]]) -> Tensor:
        counts = self.inner.step_counts(micro_batches)
        rows = sum(batch["input_ids"].shape[0] for batch in micro_batches)
        own = [torch.tensor([rows], dtype=counts.dtype, device=counts.device)]
        if self.scope == "global":
            routed, tokens = torch.zeros(self.layers * self.experts, device=counts.device), 0
            with torch.no_grad():  # the routing the step's forward will take: its parameters do not change
                for batch in micro_batches:
                    for row in range(batch["input_ids"].shape[0]):
                        self.forward_row(batch, row)
                        row_counts, _, row_tokens = self.stats.take()
                        routed += row_counts.view(-1)
                        tokens += row_tokens
            own += [routed.to(counts.dtype), torch.tensor([tokens], dtype=counts.dtype, device=counts.device)]
        own = torch.cat(own)
        dist.all_reduce(own, group=self.group)
        return torch.cat([counts, own])

    def loss_sum(self, hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
        return self.inner.loss_sum(hidden, weight, labels)

    def share(self, loss_sum: Tensor, tokens: Tensor) -> Tensor:
        return self.inner.share(loss_sum, tokens)

    def loss(self, hidden: Tensor, weight: Tensor, row: dict[str, Tensor], counts: Tensor) -> tuple[Tensor, Tensor]:
        lm_share, inner_sums = self.inner.loss(hidden, weight, row, counts[: -self.own])
        local_counts, sums, tokens = self.stats.take()
        if self.scope == "global":  # the step's counts and tokens, over every rank
            routed, total = counts[-1 - self.layers * self.experts : -1].view(self.layers, self.experts), counts[-1]
            aux_share = balance_loss_share(routed, sums, total)
        else:  # the row's counts and tokens over its context-parallel ranks: [layers · E + 1]
            totals = torch.cat([local_counts.reshape(-1), local_counts.new_tensor([tokens])])
            if self.cp_group is not None:
                dist.all_reduce(totals, group=self.cp_group)
            routed = totals[:-1].view(self.layers, self.experts)
            # the mean over the step's rows (counts[-1]: each row once per context-parallel rank)
            aux_share = balance_loss_share(routed, sums, totals[-1]) * self.cp / counts[-1].clamp(min=1)
        share = lm_share + (self.coef * aux_share).to(lm_share.dtype)
        report = [lm_share.detach().double().view(1), aux_share.detach().view(1), local_counts.double().view(-1)]
        return share, torch.cat([*report, inner_sums])

    def report(self, counts: Sequence[float], sums: Sequence[float]) -> dict[str, float | None]:
        result = self.inner.report(counts[: -self.own], sums[2 + self.layers * self.experts :])
        if not sums:  # a pipeline's last stage reports the total only
            return result
        result |= {"lm_loss": sums[0], "aux_loss": sums[1]}
        routed = torch.tensor(sums[2 : 2 + self.layers * self.experts]).view(self.layers, self.experts)
        load = routed / routed.sum(-1, keepdim=True).clamp(min=1)
        for layer, fractions in zip(self.stats.layers, load.tolist()):
            result[f"expert_load_min/{layer}"] = min(fractions)
            result[f"expert_load_max/{layer}"] = max(fractions)
        return result


def with_router_loss(
    objective: Any,
    model: nn.Module,
    coef: float,
    *,
    group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup | None,
    scope: str = "sequence",
    forward_row: Callable[[dict[str, Any], int], Tensor] | None = None,
) -> Any:
    """``objective`` with the router's load-balancing loss times ``coef`` (``lctrain.models.hf.router_aux_coef``)
    pooled over ``scope`` (``train.router_aux_scope``) and the experts' load when ``model`` (a whole model, not
    pipeline stages) has routers; else ``objective``."""
    if not routers(model):
        return objective
    return RouterBalancedLoss(
        objective,
        RouterStatistics(model),
        coef=coef,
        group=group,
        cp_group=cp_group,
        scope=scope,
        forward_row=forward_row,
    )
