"""Expert parallelism reproduces the model without it: tiny Qwen3-MoE and Mixtral models built from transformers
configs, their experts spread over EP 2 (two EP groups of 2 ranks in a world of 4) and EP 4 (one group of 4).

Every rank holds the whole model (same seed) but only its slice of the experts (``apply_expert_parallel``) and runs
its own rows (as data-parallel ranks do); the loss is the token-summed cross-entropy divided by the valid tokens of
all ranks' rows. Non-expert gradients are summed over the world; an expert's gradient is summed over the ranks that
hold that expert (one per EP group). The last case runs the experts with one grouped GEMM (``torch._grouped_mm``)
instead of a loop over experts. The reference is the single-process transformers model (its own experts
implementation) on all rows. Tolerances (fp32): loss within 1e-5 relative; every gradient within 1e-6 absolute +
1e-5 relative; each rank's logits within 1e-5 of the reference's on its rows.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.parallel.expert import apply_expert_parallel, experts_modules

WORLD = 4
VOCAB = 97
ROWS, SEQ = 2, 24  # per rank
SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "num_experts_per_tok": 2,
}
FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 8, "moe_intermediate_size": 32},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 8, "intermediate_size": 32},
}
CASES = [(family, ep, "loop") for family in FAMILIES for ep in (2, 4)] + [("qwen3_moe", 4, "grouped_mm")]


def build_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**FAMILIES[family], **SIZES))


def rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels ``[ROWS, SEQ]`` of ``rank`` (some labels ignored)."""
    gen = torch.Generator().manual_seed(rank)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels[:, :3] = -100
    return input_ids, labels


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")


def ep_mesh(ep: int) -> DeviceMesh:
    """The world as (same experts, ep): each EP group is ``ep`` adjacent ranks."""
    return init_device_mesh("cpu", (WORLD // ep, ep), mesh_dim_names=("same", "ep"))


def ep_step(family: str, ep: int, kernel: str) -> tuple[float, torch.Tensor, dict[str, torch.Tensor]]:
    """The loss, this rank's logits and the reduced gradients (experts: this rank's slice) of one step."""
    mesh = ep_mesh(ep)
    model = build_model(family)
    apply_expert_parallel(model, mesh["ep"], kernel)
    input_ids, labels = rows(dist.get_rank())
    logits = model(input_ids=input_ids).logits
    tokens = (labels != -100).sum()
    dist.all_reduce(tokens)
    loss = loss_sum(logits, labels) / tokens
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    grads = {}
    for name, param in model.named_parameters():
        if isinstance(param.grad, DTensor):  # an expert weight: this rank's experts, summed where they are held
            grads[name] = param.grad.to_local()
            dist.all_reduce(grads[name], group=mesh.get_group("same"))
        else:
            grads[name] = param.grad
            dist.all_reduce(grads[name])
    return reported.item(), logits.detach(), grads


def world_job() -> dict:
    return {case: ep_step(*case) for case in CASES}


@functools.cache
def results() -> list[dict]:
    from lctrain.testing import run_distributed

    return run_distributed(world_job, WORLD)


@pytest.mark.parametrize("family,ep,kernel", CASES, ids=lambda x: str(x))
def test_expert_parallel_matches_the_model_without_it(family: str, ep: int, kernel: str) -> None:
    model = build_model(family)
    assert model.config._experts_implementation != "lctrain_experts"  # transformers' own experts
    all_rows = [rows(rank) for rank in range(WORLD)]
    input_ids, labels = (torch.cat(parts) for parts in zip(*all_rows))
    logits = model(input_ids=input_ids).logits
    expected = loss_sum(logits, labels) / (labels != -100).sum()
    expected.backward()
    num_experts = experts_modules(model)[0].gate_up_proj.shape[0]
    for rank, by_case in enumerate(results()):
        loss, rank_logits, grads = by_case[(family, ep, kernel)]
        assert abs(loss - expected.item()) <= 1e-5 * abs(expected.item())
        torch.testing.assert_close(rank_logits, logits[rank * ROWS : (rank + 1) * ROWS].detach(), atol=1e-5, rtol=0)
        for name, param in model.named_parameters():
            grad = param.grad
            if name.endswith(("gate_up_proj", "down_proj")):
                local = num_experts // ep
                grad = grad[rank % ep * local : (rank % ep + 1) * local]
            torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
