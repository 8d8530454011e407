"""The routers' load-balancing loss (``lctrain/models/moe.py``) against transformers' ``load_balancing_loss_func``:
the shares of a row cut over several ranks add up to it, value and gradient; the statistics taken by hooks from a
tiny ``qwen3_moe`` and ``mixtral`` give it, with and without the chunked MLP, and a second forward of a layer after
``take`` (activation checkpointing's recompute) adds nothing; the router totals that pipeline stages pass on give it
too. The coefficient follows transformers' rule."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from lctrain.config import load_config
from lctrain.families import active_parameters, moe_layers
from lctrain.models import model_config
from lctrain.models.moe import RouterStatistics, RouterTotals, balance_loss_share, router_aux_coef, router_statistics
from lctrain.parallel.chunked_mlp import apply_chunked_mlp
from lctrain.parallel.pipeline import ModelParts

VOCAB = 50
EXPERTS, TOP_K, LAYERS, TOKENS = 4, 2, 2, 24


def tiny(family: str, *overrides: str) -> AutoModelForCausalLM:
    cfg = load_config(
        [
            f"model.family={family}",
            "model.hidden_size=32",
            "model.intermediate_size=16",
            f"model.num_layers={LAYERS}",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            f"model.num_experts={EXPERTS}",
            f"model.experts_per_token={TOP_K}",
            *overrides,
        ]
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model_config(cfg.model, VOCAB))


def balance_loss_func(model: torch.nn.Module):  # noqa: ANN201
    return importlib.import_module(type(model).__module__).load_balancing_loss_func


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_shares_over_ranks_add_up_to_transformers_loss_and_gradient(ranks: int) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(LAYERS, TOKENS, EXPERTS, requires_grad=True)  # fp32, the router's softmax dtype
    expected = load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    # each rank's tokens of the row, its C and S; the counts and tokens summed over the ranks (no gradient)
    stats = [
        [router_statistics(part, TOP_K) for part in layer.chunk(ranks)]  # [ranks] of (C, S) per layer
        for layer in logits
    ]
    counts = torch.stack([sum(c for c, _ in layer) for layer in stats])
    shares = [
        balance_loss_share(counts, torch.stack([layer[r][1] for layer in stats]), torch.tensor(TOKENS))
        for r in range(ranks)
    ]
    total = sum(shares)
    (grad,) = torch.autograd.grad(total, logits)
    torch.testing.assert_close(total.float(), expected, atol=0, rtol=1e-6)
    torch.testing.assert_close(grad, expected_grad, atol=1e-8, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_hooked_statistics_give_transformers_loss(family: str, chunk_tokens: int) -> None:
    model = tiny(family)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    reference = model(ids, output_router_logits=True)
    expected = balance_loss_func(model)(reference.router_logits, EXPERTS, TOP_K)
    with torch.no_grad():
        unchunked = model.model(ids).last_hidden_state
    apply_chunked_mlp(model.model.layers, chunk_tokens)
    stats = RouterStatistics(model)
    hidden = model.model(ids).last_hidden_state
    torch.testing.assert_close(hidden, unchunked, atol=1e-6, rtol=1e-6)
    counts, sums, tokens = stats.take()
    assert counts.shape == (LAYERS, EXPERTS) and tokens == TOKENS and counts.sum() == LAYERS * TOKENS * TOP_K
    loss = balance_loss_share(counts, sums, torch.tensor(tokens))
    torch.testing.assert_close(loss.float(), expected, atol=0, rtol=1e-6)
    weight = model.model.layers[0].mlp.gate.weight if chunk_tokens == 0 else None
    if weight is not None:
        grad = torch.autograd.grad(loss, weight, retain_graph=True)[0]
        torch.testing.assert_close(grad.float(), torch.autograd.grad(expected, weight)[0], atol=1e-7, rtol=1e-5)
    # a layer run again after take (the recompute of a checkpointed layer in the backward) is not counted
    model.model.layers[0].mlp(torch.randn(1, 3, 32))
    assert stats._counts == [None] * LAYERS


def test_chunked_moe_block_equals_the_block() -> None:
    model = tiny("qwen3_moe")
    x = torch.randn(2, 11, 32)
    expected = model.model.layers[0].mlp(x)
    apply_chunked_mlp(model.model.layers, 4)
    torch.testing.assert_close(model.model.layers[0].mlp(x), expected, atol=1e-6, rtol=1e-6)


def test_the_coefficient_is_transformers_unless_set() -> None:
    assert router_aux_coef(tiny("mixtral").config) == 0  # random init: none
    assert router_aux_coef(tiny("mixtral", "model.router_aux_loss_coef=0.02").config) == 0.02
    assert router_aux_coef(tiny("qwen3_moe", "model.router_aux_loss_coef=0").config) == 0
    assert router_aux_coef(tiny("llama").config) == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "llama"])
def test_active_parameters_count_the_routed_experts_only(family: str) -> None:
    model = tiny(family)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    expected = total - experts + experts * TOP_K // EXPERTS
    assert active_parameters(model.config, total) == expected


def test_dense_layers_of_a_qwen3_moe_have_no_router() -> None:
    """Qwen3-MoE's ``mlp_only_layers`` keep a dense MLP: no router, not in the loss nor in the active count."""
    config = tiny("qwen3_moe").config
    config.mlp_only_layers = [0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    expected = balance_loss_func(model)(model(ids, output_router_logits=True).router_logits, EXPERTS, TOP_K)
    stats = RouterStatistics(model)
    model.model(ids)
    counts, sums, tokens = stats.take()
    assert stats.layers == [1]
    torch.testing.assert_close(
        balance_loss_share(counts, sums, torch.tensor(tokens)).float(), expected, rtol=1e-6, atol=0
    )
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert active_parameters(config, total) == total - experts + experts * TOP_K // EXPERTS


def test_router_totals_passed_over_parts_give_the_whole_models() -> None:
    """Pipeline stages: each part adds its layers' statistics of the row to the totals it passes on (a part without
    a MoE layer passes them through); the last part's totals give transformers' loss and gradient, as the whole
    model's do."""
    config = tiny("qwen3_moe", "model.num_layers=3").config
    config.mlp_only_layers = [0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    expected = balance_loss_func(model)(model(ids, output_router_logits=True).router_logits, EXPERTS, TOP_K)
    weight = model.model.layers[1].mlp.gate.weight
    (expected_grad,) = torch.autograd.grad(expected, weight)
    layers, cpu = moe_layers(config), torch.device("cpu")
    parts = [ModelParts({str(i): model.model.layers[i]}, model.model.rotary_emb) for i in range(3)]
    carries = [RouterTotals(part, layers, EXPERTS, cpu, start=model.model) for part in parts]
    whole = RouterTotals(model, layers, EXPERTS, cpu)
    model.model(ids)
    totals = None
    for carry in carries:
        totals = carry(totals)
    assert layers == [1, 2] and carries[0].stats is None
    assert torch.equal(totals.detach(), whole(None).detach())
    loss = balance_loss_share(totals[:-1].detach(), totals[-1:], torch.tensor(TOKENS))
    torch.testing.assert_close(loss.float(), expected, atol=0, rtol=1e-6)
    (grad,) = torch.autograd.grad(loss, weight)
    torch.testing.assert_close(grad.float(), expected_grad, atol=1e-7, rtol=1e-5)
