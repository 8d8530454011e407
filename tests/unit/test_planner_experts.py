"""``lctrain plan`` on mixtures of experts: total and active parameters (the published counts, and transformers'
models), a MoE layer's activations equal to what autograd keeps with lctrain's experts, and expert parallelism's
terms: the gathered experts divided by ep, the sharded states unchanged, the all-to-all time from the measured links,
the degrees the search tries and refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lctrain.planner import HARDWARE, NAMED_MODELS, Layout, ModelSpec, Workload, estimate_memory, layer_activation_bytes
from lctrain.planner.search import expert_degrees, layout_problems, plan_layouts
from lctrain.planner.timing import expert_all_to_all_s, link_bandwidth
from tests.helpers.models import layer_saved_bytes

QWEN3_30B = NAMED_MODELS["qwen3-30b-a3b"]
MIXTRAL = NAMED_MODELS["mixtral-8x7b"]
# transformers config fields of two tiny mixtures, and the ModelSpec of each
TINY_MOE = {
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 48, "head_dim": 32, "norm_topk_prob": True},
    "mixtral": {"num_local_experts": 8, "intermediate_size": 48},
}


def tiny_spec(family: str) -> ModelSpec:
    return ModelSpec(
        "tiny-moe", 128, 48, 2, 4, 2, 300, 32, family=family, qk_norm=family == "qwen3_moe", experts=8,
        experts_per_token=2, expert_intermediate=48,
    )  # fmt: skip


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        family, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
        num_experts_per_tok=2, **TINY_MOE[family],
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_published_total_and_active_counts() -> None:
    assert (QWEN3_30B.num_params, QWEN3_30B.active_params) == (30_532_122_624, 3_353_032_704)  # 30.5B, 3.3B
    assert (MIXTRAL.num_params, MIXTRAL.active_params) == (46_702_792_704, 12_879_925_248)  # 46.7B, 12.9B
    assert round(NAMED_MODELS["qwen3-235b-a22b"].active_params / 1e9) == 22
    assert round(NAMED_MODELS["mixtral-8x22b"].num_params / 1e9) == 141


@pytest.mark.parametrize("family", list(TINY_MOE))
def test_parameter_count_equals_transformers(family: str) -> None:
    assert tiny_spec(family).num_params == sum(p.numel() for p in tiny_model(family).parameters())


def test_gpt_oss_and_gemma3_counts() -> None:
    """The published totals (gpt-oss: 20.91B and 116.83B; active 3.61B and 5.13B without the unembedding, as
    OpenAI counts them), and each size's count equal to transformers' model of its config (built on meta)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    small, large = NAMED_MODELS["gpt-oss-20b"], NAMED_MODELS["gpt-oss-120b"]
    assert (small.num_params, large.num_params) == (20_914_757_184, 116_829_156_672)
    assert round((small.active_params - small.head_params) / 1e7) == 361
    assert round((large.active_params - large.head_params) / 1e7) == 513
    configs = {
        "gpt-oss-20b": dict(
            model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
            vocab_size=201088, sliding_window=128,
        ),
        "gemma3-27b": dict(
            model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
            num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208, sliding_window=1024,
        ),
    }  # fmt: skip
    for name, fields in configs.items():
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
        model.tie_weights()  # init_empty_weights makes Gemma 3's tied LM head a tensor of its own
        assert NAMED_MODELS[name].num_params == sum(p.numel() for p in model.parameters()), name
        spec = ModelSpec.from_hf_config(fields, name=name)
        assert spec.num_params == NAMED_MODELS[name].num_params, name
        assert spec.windows == NAMED_MODELS[name].windows, name


@pytest.mark.parametrize("family", list(TINY_MOE))
def test_moe_layer_activations_equal_what_autograd_saves(family: str) -> None:
    """One decoder layer in fp32 with lctrain's experts implementation: every tensor autograd keeps (parameters and
    RoPE cos/sin left out) adds up to the formula exactly."""
    from lctrain.models import patch_attention
    from lctrain.parallel.expert import apply_expert_parallel

    model = tiny_model(family)
    apply_expert_parallel(model, None, "loop")
    patch_attention(model, ulysses_group=None, ring_group=None)
    assert layer_saved_bytes(model, tokens=256) == 256 * layer_activation_bytes(tiny_spec(family), 4, 1)


def test_expert_parallel_divides_the_gathered_experts_not_the_states() -> None:
    work = Workload(32768, gpus_per_node=8, nodes=2)
    one, eight = (estimate_memory(MIXTRAL, Layout(1, 2, 1, 8, "full", ep=ep), work) for ep in (1, 8))
    assert one.states == eight.states
    # the peak is at the end of the step (states dominate at 32K): two layers gathered in bf16 (the current and the
    # prefetched one), of whose experts a GPU gathers 1/8 with ep 8
    assert one.phase == eight.phase == "grads"
    assert one.gathered - eight.gathered == 2 * MIXTRAL.expert_params * 7 // 8 * 2


def test_all_to_all_time_from_the_measured_links() -> None:
    work = Workload(1 << 20, gpus_per_node=8, nodes=2)
    measured = dataclasses.replace(HARDWARE["h100"], alltoall_gbps=123.0, measured=("alltoall_gbps",))
    inside, across = Layout(1, 2, 1, 8, "full", ep=8), Layout(1, 1, 2, 8, "full", ep=16)
    moved = (1 << 20) // 8 * 8 * 2048 * 2 * 7 / 8  # tokens x k x hidden x bf16, 7/8 leaving the GPU
    assert expert_all_to_all_s(QWEN3_30B, inside, measured, work) == pytest.approx(moved / 123e9)
    moved = (1 << 20) // 16 * 8 * 2048 * 2 * 15 / 16
    bandwidth = link_bandwidth(measured, work, "inter_gbps")
    assert expert_all_to_all_s(QWEN3_30B, across, measured, work) == pytest.approx(moved / bandwidth)
    assert expert_all_to_all_s(QWEN3_30B, Layout(1, 2, 1, 8, "full"), measured, work) == 0.0


def test_degrees_the_search_tries_and_refuses() -> None:
    assert expert_degrees(MIXTRAL, 16) == [1, 2, 4, 8]  # 8 experts: never 16
    assert expert_degrees(NAMED_MODELS["llama3-8b"], 16) == [1]
    work = Workload(32768, gpus_per_node=8, nodes=2)
    problems = layout_problems(MIXTRAL, Layout(1, 16, 1, 1, "full", ep=16), work)
    assert any("parallel.ep=16 does not divide the model's 8 experts" in problem for problem in problems)
    plans = plan_layouts(MIXTRAL, HARDWARE["h100"], work, mesh=(1, 2, 1, 8))
    assert [plan.layout.ep for plan in plans] == [1, 2, 4, 8]


# the mixtures of experts' recipes (the hybrid Qwen3-Next's among them), and Gemma 3's and the dense hybrid
# Qwen3.5-4B's (their headers quote the planner the same way)
MOE_RECIPES = (
    "qwen3_30b_a3b_128k", "qwen3_30b_a3b_1m", "mixtral_8x7b_32k", "gpt_oss_20b_128k", "gpt_oss_120b_128k",
    "gemma3_27b_128k", "qwen3_next_80b_a3b_128k", "qwen3_5_35b_a3b_256k", "qwen3_5_4b_256k", "qwen3_5_4b_1m",
)  # fmt: skip


@pytest.mark.parametrize("name", MOE_RECIPES)
def test_moe_recipes_carry_the_planners_memory_and_layout(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The command a MoE recipe's header quotes recommends the recipe's mesh, and predicts the memory it states."""
    import json
    import re
    import shlex

    from lctrain.config import RECIPE_DIR, load_config
    from lctrain.planner import main

    header = " ".join(
        line[2:] for line in (RECIPE_DIR / f"{name}.yaml").read_text().splitlines() if line.startswith("# ")
    )
    command = re.search(r"`python -m lctrain plan ([^`]+)`", header).group(1)
    stated = float(re.search(r"Expected memory per GPU: ([\d.]+) GiB", header).group(1))
    main([*shlex.split(command), "--json"])
    recommended = json.loads(capsys.readouterr().out)["recommended"]
    assert round(recommended["memory_gib"]["total"], 1) == stated
    parallel = load_config([f"recipe={name}"]).parallel
    layout = recommended["layout"]
    assert [layout[axis] for axis in ("pp", "dp", "ring", "ulysses", "ep")] == [
        parallel.pp, parallel.dp, parallel.ring, parallel.ulysses, parallel.ep
    ]  # fmt: skip
    assert (layout["ac"], layout["ac_every"] if layout["ac"] == "selective" else None) == (
        parallel.activation_checkpointing,
        parallel.ac_every if parallel.activation_checkpointing == "selective" else None,
    )
