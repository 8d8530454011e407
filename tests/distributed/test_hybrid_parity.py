"""The hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE: gated delta layers before a gated
full-attention layer with partial rotary and q/k norms) patched by ``patch_attention`` on a (ring x ulysses) mesh
reproduce transformers' single-process model run on each document alone.

As ``test_model_parity``: every rank holds the full model (same seed) and its zigzag shard of one packed row (a
one-token document first, documents crossing the pieces); loss and gradients summed over the context-parallel group.
Tolerances (fp32): loss within 1e-5 relative; every parameter gradient within 1e-5 absolute + 1e-4 relative.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.families import linear_layers
from lctrain.testing import run_distributed
from tests.distributed.test_model_parity import VOCAB, assert_documents_alone_match, sharded_step

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "use_cache": False,  # as lctrain builds its models: training takes no cache
}
EXPERTS = {
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts_per_tok": 2,
}
FAMILIES = {"qwen3_5_text": {}, "qwen3_next": EXPERTS, "qwen3_5_moe_text": EXPERTS}
CASES = [(2, 2, 1, "qwen3_5_text"), (2, 1, 2, "qwen3_5_text"), (4, 4, 1, "qwen3_5_text")] + [
    (4, 2, 2, family) for family in FAMILIES
]


def build_model(family: str) -> torch.nn.Module:
    config = AutoConfig.for_model(family, **SIZES, **FAMILIES[family])
    assert linear_layers(config) == [0]
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def world_job(world: int) -> dict:
    return {
        (ring, ulysses, family): sharded_step(ring, ulysses, family, build_model)
        for w, ring, ulysses, family in CASES
        if w == world
    }


@functools.cache
def results_for(world: int) -> dict:
    return run_distributed(world_job, world, world)[0]


@pytest.mark.parametrize("world,ring,ulysses,family", CASES, ids=lambda x: str(x))
def test_sharded_hybrid_matches_documents_run_alone(world: int, ring: int, ulysses: int, family: str) -> None:
    loss, grads = results_for(world)[(ring, ulysses, family)]
    assert_documents_alone_match(build_model(family), 16 * ring * ulysses, loss, grads)
