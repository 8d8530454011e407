"""Expert parallelism on one process: the experts implementation lctrain registers equals transformers' own experts
(Qwen3-MoE, Mixtral and gpt-oss with its biases and clamped SwiGLU, each local kernel), the CPU kernel choice is a
known kernel, and bad ``parallel.ep`` settings fail before anything runs with one message naming the setting and the
fix. The EP runs themselves (2 and 4 ranks) are in ``tests/distributed/test_expert_parallel.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.config import check_job, load_config
from lctrain.families import num_experts
from lctrain.parallel.dims import ParallelDims
from lctrain.parallel.expert import KERNELS, apply_expert_parallel, experts_modules, fastest_cpu_kernel

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
FAMILIES = {
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 16, "norm_topk_prob": True},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 16},
    # a SwiGLU limit that clamps some of the tiny model's activations (the published one is 7)
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "intermediate_size": 16, "swiglu_limit": 0.5},
}


def tiny(family: str) -> torch.nn.Module:
    """A tiny model of ``family``; gpt-oss's expert biases (transformers' init: zeros) drawn from N(0, 1)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(**FAMILIES[family], **SIZES, vocab_size=61, num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj_bias"):
                param.normal_()
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_lctrain_experts_equal_transformers_experts(family: str, kernel: str) -> None:
    reference = tiny(family)
    model = copy.deepcopy(reference)
    apply_expert_parallel(model, None, kernel)
    assert model.config._experts_implementation != reference.config._experts_implementation
    input_ids = torch.randint(0, 61, (2, 19), generator=torch.Generator().manual_seed(1))
    expected, got = reference(input_ids, labels=input_ids), model(input_ids, labels=input_ids)
    expected.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-6, rtol=1e-6)
    for (name, param), mine in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(mine.grad, param.grad, atol=1e-7, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_cpu_kernel_choice_is_measured_among_the_kernels() -> None:
    assert fastest_cpu_kernel(torch.float32) in KERNELS


def test_num_experts_reads_each_family() -> None:
    assert [num_experts(tiny(family).config) for family in FAMILIES] == [8, 4, 4]
    assert num_experts(AutoConfig.for_model("llama")) == 0


def test_expert_parallel_needs_experts() -> None:
    with pytest.raises(ValueError, match="no experts module"):
        apply_expert_parallel(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SIZES)), None, "loop")


# (overrides, world size, experts per layer, substrings of the message)
BAD_EP = {
    "ep_not_dividing_ranks": (["parallel.dp=2", "parallel.ep=4"], 2, 8, ["parallel.ep=4 does not divide dp x ring"]),
    "ep_not_dividing_experts": (["parallel.ring=2", "parallel.ulysses=2", "parallel.ep=4"], 4, 6, ["the model's 6"]),
    "ep_on_dense_model": (["parallel.dp=2", "parallel.ep=2"], 2, 0, ["has no experts: set parallel.ep=1"]),
    "ep_zero": (["parallel.ep=0"], 1, 8, ["parallel.ep=0 must be >= 1"]),
}


@pytest.mark.parametrize("case", list(BAD_EP))
def test_bad_ep_names_setting_and_fix(case: str) -> None:
    overrides, world_size, experts, expected = BAD_EP[case]
    with pytest.raises(ValueError) as error:  # parallel.ep's own checks when the config is made, the rest in check_job
        cfg = load_config(["model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=128", *overrides])
        check_job(cfg, world_size, num_heads=4, num_kv_heads=2, num_layers=2, tied_embeddings=False, vocab_size=61,
                  num_experts=experts)  # fmt: skip
    for text in expected:
        assert text in str(error.value), f"{text!r} not in {str(error.value)!r}"


def test_ep_ranks_come_from_dp_cp() -> None:
    dims = ParallelDims(pp=2, dp=2, ring=2, ulysses=2, ep=4)
    assert (dims.dp_cp, dims.efsdp) == (8, 2)
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide dp x ring x ulysses = 8"):
        ParallelDims(pp=2, dp=2, ring=2, ulysses=2, ep=3)


def test_experts_of_the_tiny_models() -> None:
    assert [len(experts_modules(tiny(family))) for family in FAMILIES] == [2, 2, 2]
