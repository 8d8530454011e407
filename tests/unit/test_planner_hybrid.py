"""``lctrain plan`` on the hybrid linear-attention families (Qwen3-Next, Qwen3.5 dense and MoE): their parameters as
transformers builds them (tiny models, and the named sizes from their config classes' defaults, built on meta),
LoRA's adapters as peft adds them, each kind of layer's activations near what autograd keeps, the gated delta layers'
state and summary exchange independent of the length (only the attention layers' K/V grow with it), their FLOPs in
place of attention's (the trainer's count and the planner's the same), and their heads under Ulysses refused in one
line when they do not divide."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lctrain.flops import delta_rule_flops_per_token, flops_per_token
from lctrain.planner import HARDWARE, NAMED_MODELS, Layout, ModelSpec, Workload, ring_step, stage_memory
from lctrain.planner.memory import CHUNK, Lora, layer_activation_bytes, linear_state_bytes
from lctrain.planner.search import layout_problems
from lctrain.planner.timing import link_bandwidth, model_flops_per_token, summary_exchange_bytes

QWEN3_NEXT = NAMED_MODELS["qwen3-next-80b-a3b"]
# transformers config fields of tiny hybrids: a gated delta layer, then a gated full-attention layer
SIZES = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"], "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "vocab_size": 300,
}  # fmt: skip
EXPERTS = {
    "num_experts": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_experts_per_tok": 2,
}
FAMILIES = {"qwen3_5_text": {}, "qwen3_next": EXPERTS, "qwen3_5_moe_text": EXPERTS}


def tiny(family: str) -> tuple[ModelSpec, torch.nn.Module]:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"model_type": family, **SIZES, **FAMILIES[family]}
    if family == "qwen3_5_moe_text":
        del fields["intermediate_size"]  # its config has none: the experts' width is the MLP's
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    return ModelSpec.from_hf_config(fields, name=f"tiny-{family}"), model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_count_equals_transformers(family: str) -> None:
    spec, model = tiny(family)
    assert spec.linear_layers == (True, False) and spec.attention_gate
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    mixer = sum(p.numel() for p in model.model.layers[0].linear_attn.parameters())
    assert spec.linear_params == mixer  # the gated delta layer's q/k/v/z/b/a projections, conv, A_log, dt_bias, norm


def test_an_image_text_checkpoint_is_planned_as_its_language_model() -> None:
    text, _ = tiny("qwen3_5_moe_text")
    fields = {key: value for key, value in {**SIZES, **EXPERTS}.items() if key != "intermediate_size"}
    spec = ModelSpec.from_hf_config({"model_type": "qwen3_5_moe", "text_config": fields}, name=text.name)
    assert spec == text


# a named size, the transformers config class whose defaults are its sizes, and its published total in billions
PUBLISHED = {"qwen3-next-80b-a3b": ("Qwen3NextConfig", 80), "qwen3.5-35b-a3b": ("Qwen3_5MoeTextConfig", 35)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_sizes_equal_transformers_defaults(name: str) -> None:
    """Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B's language model equal their config class's defaults (built on meta)
    and the planner's reading of that config; 80B and 35B parameters, 3B active."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    named, (config_class, billions) = NAMED_MODELS[name], PUBLISHED[name]
    config = getattr(transformers, config_class)()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    assert named.num_params == sum(p.numel() for p in model.parameters())
    spec = ModelSpec.from_hf_config(config.to_dict(), name=name)
    # the config class's RoPE base is not the checkpoint's; its dense width is unused (every layer has experts)
    assert dataclasses.replace(spec, rope_theta=1e7, intermediate=512) == named
    assert sum(named.linear_layers) == 3 * named.layers // 4 and round(named.num_params / 1e9) == billions
    assert int(named.active_params / 1e9) == 3  # the A3B of their names: 3.87B and 3.45B


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_adapters_equal_peft(family: str) -> None:
    """Adapters of rank 4 on the family's default targets (the attention's and the gated delta layers' projections,
    a dense MLP's) as peft adds them."""
    from peft import LoraConfig, get_peft_model

    from lctrain.families import FAMILIES as RECORDS

    spec, model = tiny(family)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(RECORDS[family].lora_targets)))
    adapters = sum(p.numel() for name, p in peft_model.named_parameters() if "lora_" in name)
    assert adapters == sum(Lora(4).layer_adapter_params(spec, layer) for layer in range(spec.layers))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_activations_near_what_autograd_saves(family: str) -> None:
    """Each kind of layer in fp32, patched as lctrain runs it (one rank: the row's two zigzag pieces): what autograd
    keeps is within 5% of the formula. An estimate, not a byte count: the gated delta rule's tensors are counted per
    run of transformers' kernel, and which runs a piece makes depends on its documents."""
    from lctrain.models import patch_attention
    from tests.helpers.models import layer_saved_bytes

    spec, model = tiny(family)
    patch_attention(model, ulysses_group=None, ring_group=None)
    for layer, linear in enumerate(spec.linear_layers):
        formula = 256 * layer_activation_bytes(spec, 4, 1, linear=linear)
        assert layer_saved_bytes(model, tokens=256, layer=layer) == pytest.approx(formula, rel=0.05), layer


def test_only_the_attention_layers_grow_with_the_length() -> None:
    """Without checkpointing, a row's kept activations are per token (both kinds of layer) plus, per gated delta
    layer, its summaries, entering states and halos (``linear_state_bytes``), the same at any length; the gated delta
    layers keep no K/V: their per-token bytes do not change with the ring, the attention layers' do."""
    work = Workload(32768, gpus_per_node=8, dtype_bytes=2)
    layout = Layout(1, 1, 4, 2)
    short, long = (stage_memory(QWEN3_NEXT, layout, dataclasses.replace(work, seq_len=s))[0] for s in (32768, 65536))
    assert short.phase == long.phase != "grads"  # activations are kept at this peak
    state = linear_state_bytes(QWEN3_NEXT, 4, 2, 2)
    assert 2 * short.activations - long.activations == 36 * state
    # pieces (2 x ring 4) x value heads per rank (32 / 2) x [dk, dk + dv] and [dk, dv] fp32, and halos [3, 8192 / 2]
    assert state == 8 * 16 * 128 * (256 + 128) * 4 + 8 * 3 * 4096 * 2
    linear = [layer_activation_bytes(QWEN3_NEXT, 2, 2, ring=ring, linear=True) for ring in (1, 4)]
    attention = [layer_activation_bytes(QWEN3_NEXT, 2, 2, ring=ring) for ring in (1, 4)]
    assert linear[0] == linear[1] and attention[0] < attention[1]


def test_summary_exchange_in_the_ring_step() -> None:
    """A gated delta layer all-gathers its pieces' summaries and halos over the ring, bytes independent of the
    length (the attention's K/V transfer doubles with it); its backward all-reduces twice as much; each gated delta
    layer adds the exchange to the ring's exposed time in place of the attention's ring steps."""
    hw, layout = HARDWARE["h100"], Layout(1, 1, 8, 1)
    steps = [ring_step(QWEN3_NEXT, layout, hw, Workload(s, gpus_per_node=8)) for s in (65536, 131072)]
    assert steps[0].summary_fwd_s == steps[1].summary_fwd_s > 0 and steps[1].comm_fwd_s == 2 * steps[0].comm_fwd_s
    # 7 other ranks x 2 pieces x (32 heads x [128, 256] fp32 + [3, 8192] bf16)
    received = summary_exchange_bytes(QWEN3_NEXT, 8, 1, 2)
    assert received == 7 * 2 * (32 * 128 * 256 * 4 + 3 * 8192 * 2)
    bandwidth = link_bandwidth(hw, Workload(65536, gpus_per_node=8), "intra_gbps")
    assert steps[0].summary_fwd_s == pytest.approx(received / bandwidth)
    assert steps[0].summary_bwd_s == 2 * steps[0].summary_fwd_s
    assert summary_exchange_bytes(NAMED_MODELS["qwen3-30b-a3b"], 8, 1, 2) == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_count_attention_on_the_attention_layers_only(family: str) -> None:
    """The planner's FLOPs per token and the trainer's (``lctrain.train.meter``) agree: 6 per active parameter,
    the causal pairs of the attention layers only, and the gated delta rule's on the others."""
    from lctrain.families import model_flops_per_token as trainer_flops

    spec, model = tiny(family)
    delta = delta_rule_flops_per_token(4, 16, 8, CHUNK)
    expected = 6 * spec.active_params + 12 * 64 * 4096 / 2 + delta
    assert model_flops_per_token(spec, 4096) == expected
    assert trainer_flops(model.config, spec.num_params, 4096) == expected
    full = model_flops_per_token(QWEN3_NEXT, 131072)
    assert full == flops_per_token(QWEN3_NEXT.active_params, 12, 2048, 131072) + 36 * delta_rule_flops_per_token(
        32, 128, 128
    )


def test_ulysses_must_divide_the_linear_heads() -> None:
    work = Workload(131072, gpus_per_node=32)
    problems = layout_problems(dataclasses.replace(QWEN3_NEXT, heads=32, kv_heads=32), Layout(1, 1, 1, 32), work)
    assert problems == [
        "parallel.ulysses=32 does not divide the linear-attention layers' 16 key heads and 32 value heads "
        "(linear_num_key_heads, linear_num_value_heads): choose a ulysses degree that divides both and move the rest "
        "to the ring"
    ]
    assert not layout_problems(QWEN3_NEXT, Layout(1, 4, 2, 4, "full", ep=4), work)
