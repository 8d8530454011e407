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
checkpointing, the chunked MLP recompute) is not counted again; ``RouterTotals`` adds a part's of a row to what the
pipeline stages before it passed on. The objective that adds the auxiliary term to the loss is
``lctrain.train.router_loss.RouterBalancedLoss``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from lctrain.families import moe_layers, num_experts


def router_aux_coef(config: PretrainedConfig) -> float:
    """The weight of the router's load-balancing loss in the step's loss: 0 for a dense model, else transformers'
    (``router_aux_loss_coef`` when ``output_router_logits``)."""
    if not num_experts(config) or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(config.router_aux_loss_coef)


@dataclass(frozen=True)
class Routers:
    """A mixture of experts' routers as its training loss sees them: the MoE decoder layers, their routed experts,
    the load-balancing loss's weight (``router_aux_coef``; 0: the load only)."""

    layers: list[int]
    num_experts: int
    coef: float


def model_routers(config: PretrainedConfig) -> Routers | None:
    """The routers of ``config``'s model (after the job's ``model.*`` settings); None for a dense model."""
    coef, layers = router_aux_coef(config), moe_layers(config)
    return Routers(layers, num_experts(config), coef) if layers else None


def routers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's routers by decoder layer index, in layer order: the ``gate`` (``router``: gpt-oss) of each MoE
    block (a module with ``top_k`` and ``num_experts``, transformers' ``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``,
    ``GptOssTopKRouter``, whose first output is the router logits); a dense layer (Qwen3-MoE's ``mlp_only_layers``)
    has none."""
    found = {}
    for name, module in model.named_modules():
        if name.endswith((".gate", ".router")) and hasattr(module, "top_k") and hasattr(module, "num_experts"):
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
