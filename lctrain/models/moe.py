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

from lctrain.families import moe_layers, num_experts


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
    docstring). A forward of ``start`` (default ``model.model``, the decoder; a pipeline stage's module) starts a
    forward's statistics (a pre-hook)."""

    def __init__(self, model: nn.Module, start: nn.Module | None = None):
        found = routers(model)
        if not found:
            raise ValueError(f"{type(model).__name__} has no routers (mlp.gate with top_k and num_experts)")
        self.layers = list(found)  # the decoder layer index of each router
        self.routers = list(found.values())
        self.num_experts = self.routers[0].num_experts
        self._layer = {id(router): index for index, router in enumerate(self.routers)}
        self._armed = False
        self._clear()
        (model.model if start is None else start).register_forward_pre_hook(self._start)
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


class RouterTotals:
    """A part of the model (the whole model, or a pipeline stage: ``start`` is the module whose forward runs a row)
    adding its routers' statistics of the row to the row's router totals on this rank: fp32 ``[len(layers) + 1, E]``,
    row i the routed counts ``C`` of MoE layer ``layers[i]`` (no gradient), the last row ``Σ S`` over the layers
    (differentiable). Pipeline stages pass the totals along beside the hidden states (each adds its layers'), so the
    last stage holds every layer's, and the gradient of the loss reaches each stage's routers through them."""

    def __init__(
        self,
        part: nn.Module,
        layers: Sequence[int],
        num_experts: int,
        device: torch.device,
        *,
        start: nn.Module | None = None,
    ):
        found = routers(part)
        self.shape, self.device = (len(layers) + 1, num_experts), device
        self.stats = RouterStatistics(part, start) if found else None
        self.rows = torch.tensor([list(layers).index(layer) for layer in found], device=device)

    def __call__(self, totals: Tensor | None) -> Tensor:
        """``totals`` (None: zeros) plus this part's last forward (``RouterStatistics.take``)."""
        if totals is None:
            totals = torch.zeros(self.shape, device=self.device)
        if self.stats is None:  # a stage without a MoE layer
            return totals
        counts, sums, _ = self.stats.take()
        counted = torch.zeros(self.shape[0] - 1, self.shape[1], device=counts.device).index_copy(0, self.rows, counts)
        return totals + torch.cat([counted, sums.sum(0, keepdim=True)])


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
        inner: Any,
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
    objective: Any,
    model: nn.Module,
    stages: Sequence[nn.Module],
    config: Any,
    coef: float,
    *,
    group: dist.ProcessGroup,
    cp_group: dist.ProcessGroup | None,
    device: torch.device,
    scope: str = "sequence",
    forward: Callable[..., Tensor | None] | None = None,
) -> Any:
    """``objective`` with the router's load-balancing loss times ``coef`` (``lctrain.models.hf.router_aux_coef``)
    pooled over ``scope`` (``train.router_aux_scope``) and the experts' load when ``config``'s model has routers
    (with ``coef`` 0, the load only); else ``objective``. ``model``: the whole model; with pipeline ``stages``
    (this rank's stage modules) each stage gets its ``RouterTotals`` as its ``carry`` instead: it adds its layers'
    to the totals it receives and passes them on (the last stage to its head, as the row's ``carried``)."""
    layers = moe_layers(config)
    if not layers:
        return objective
    experts = num_experts(config)
    totals = None
    if stages:
        for stage in stages:
            stage.carry = RouterTotals(stage, layers, experts, device, start=stage)
    else:
        totals = RouterTotals(model, layers, experts, device)
    return RouterBalancedLoss(
        objective,
        totals,
        layers,
        experts,
        coef=coef,
        group=group,
        cp_group=cp_group,
        scope=scope,
        forward=forward,
    )
