"""LoRA adapters on a mixture of experts' expert weights (``model.lora.target_parameters``), without any process
group: bad settings are refused with one line naming the setting and the fix; ``apply_lora`` puts peft's
``ParamWrapper`` on both expert weights of every layer with names that stay apart under ``hf_name``, and only there
(a mixture of experts' default targets are the attention's); lctrain's expert kernel computes the adapted experts as
transformers' own forward does; the export on a mesh of one reloads with peft and ``from_pretrained``; the planner
counts the expert adapters as peft makes them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig

from lctrain.config import load_config
from lctrain.families import ATTENTION
from lctrain.models import build_empty_model, materialize, model_config, random_init_source
from lctrain.models.hf import hf_name
from lctrain.models.lora import adapter_source, apply_lora, check_lora
from lctrain.train.trainer import check
from tests.unit.test_checkpoint_files import process_group  # noqa: F401  (a gloo group of one)

SMALL = ["model.hidden_size=32", "model.intermediate_size=24", "model.num_layers=2", "model.num_heads=4"]
SMALL += ["model.num_kv_heads=2", "model.num_experts=4", "model.experts_per_token=2", "data.seq_len=128"]
EXPERTS = ["model.lora.rank=4", "model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]"]
FAMILIES = ("qwen3_moe", "mixtral")
VOCAB = 64

# (overrides, world size, substrings of the message)
BAD = {
    "unknown_weight": (
        ["model.family=mixtral", "model.lora.rank=4", "model.lora.target_parameters=[experts.w1]"],
        1,
        ["model.lora.target_parameters has 'experts.w1'", "experts.down_proj, experts.gate_up_proj"],
    ),
    "not_an_expert_weight": (
        ["model.family=mixtral", "model.lora.rank=4", "model.lora.target_parameters=[q_proj.weight]"],
        1,
        ["names no expert weight", "model.lora.target_modules"],
    ),
    "dense_model": (
        ["model.family=llama", *EXPERTS],
        1,
        ["model.lora.target_parameters has 'experts.gate_up_proj'", "it has no experts"],
    ),
    "dropout": (
        ["model.family=qwen3_moe", *EXPERTS, "model.lora.dropout=0.1"],
        1,
        ["model.lora.dropout=0.1 with model.lora.target_parameters", "set model.lora.dropout=0"],
    ),
    "expert_parallel": (
        ["model.family=qwen3_moe", *EXPERTS, "parallel.dp=2", "parallel.ep=2"],
        2,
        ["model.lora.target_parameters with parallel.ep=2", "set parallel.ep=1"],
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_expert_adapter_settings_name_the_setting_and_fix(name: str) -> None:
    overrides, world, expected = BAD[name]
    with pytest.raises(ValueError) as error:
        check(load_config([*SMALL, *overrides]), world)  # the check train runs before any process group
    message = str(error.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, f"{name}: {part!r} not in {message!r}"


def test_mlp_names_peft_would_move_to_the_experts_are_refused() -> None:
    """peft reads Qwen3-MoE's ``down_proj`` in ``target_modules`` as the experts' weights (transformers 4's name):
    with a dense layer (``mlp_only_layers``) that has one, the name is refused rather than silently moved."""
    config = Qwen3MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, mlp_only_layers=[0],
    )  # fmt: skip
    cfg = load_config(
        [*SMALL, "model.family=qwen3_moe", "model.lora.rank=4", "model.lora.target_modules=[q_proj,down_proj]"]
    )
    with pytest.raises(ValueError, match="has 'down_proj', which peft reads on a model as transformers 4's name"):
        check_lora(cfg.model.lora, config, cfg.parallel, "a model")


def expert_model(family: str, *overrides: str) -> torch.nn.Module:
    cfg = load_config([*SMALL, f"model.family={family}", *overrides])
    model = build_empty_model(model_config(cfg.model, VOCAB))
    apply_lora(model, cfg.model.lora)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_adapters_have_names_of_their_own(family: str) -> None:
    model = expert_model(family, *EXPERTS)
    trained = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    h, inter, rank = 32, 24, 4
    layer = "model.layers.1.mlp.experts"
    assert trained[f"{layer}.base_layer.lora_A.default.weight"] == (4 * rank, h)  # gate_up_proj's: h -> 2I
    assert trained[f"{layer}.base_layer.lora_B.default.weight"] == (2 * inter, 4 * rank)
    assert trained[f"{layer}.lora_A.default.weight"] == (4 * rank, inter)  # down_proj's: I -> h
    assert trained[f"{layer}.lora_B.default.weight"] == (h, 4 * rank)
    assert len({hf_name(name) for name in trained}) == len(trained)  # checkpoints and the init tell them apart
    assert all(hf_name(name) == name for name in trained)
    # the frozen weights keep their Hugging Face names (the checkpoint's or the random init's tensors)
    plain = {name for name, _ in build_empty_model(model.config).named_parameters()}
    assert {hf_name(name) for name, p in model.named_parameters() if not p.requires_grad} == plain
    source = adapter_source(random_init_source(model.config, 0), 0)
    first_a = [source(name, shape) for name, shape in trained.items() if name.startswith("model.layers.1.mlp.")]
    assert first_a[0].std() > 0 and not first_a[1].any() and first_a[2].std() > 0 and not first_a[3].any()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_mixture_of_experts_gets_attention_adapters_by_default(family: str) -> None:
    """Without ``target_parameters`` the experts stay frozen and unwrapped (peft would otherwise read Qwen3-MoE's
    default MLP names as the experts')."""
    model = expert_model(family, "model.lora.rank=4")
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted == set(ATTENTION)
    assert all(not p.requires_grad for name, p in model.named_parameters() if ".experts." in name)


def materialized(family: str, *, seed: int = 0) -> torch.nn.Module:
    """The expert-adapted model with its seeded init and every trained parameter moved off it (as if trained)."""
    model = expert_model(family, *EXPERTS)
    materialize(model, adapter_source(random_init_source(model.config, seed), seed), torch.device("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())) / 10)
    return model


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lctrain_expert_kernel_computes_the_adapted_experts(family: str, kernel: str) -> None:
    """lctrain's experts implementation (``apply_expert_parallel`` without EP) on the adapted model: the logits and
    every trained parameter's gradient of transformers' own experts forward."""
    from lctrain.parallel.expert import apply_expert_parallel, grouped_linear

    try:
        grouped_linear(torch.ones(2, 4), torch.ones(2, 3, 4), [1, 1], kernel)
    except (RuntimeError, NotImplementedError):
        pytest.skip(f"no {kernel} kernel on this CPU in fp32")
    reference, ours = materialized(family), materialized(family)
    apply_expert_parallel(ours, None, kernel)
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    outputs = [model(input_ids=input_ids).logits for model in (reference, ours)]
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-6, rtol=1e-5)
    for logits in outputs:
        logits.square().mean().backward()
    grads = [{n: p.grad for n, p in model.named_parameters() if p.requires_grad} for model in (reference, ours)]
    assert any(".experts.base_layer.lora_B." in name and grad.abs().max() > 0 for name, grad in grads[0].items())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.usefixtures("process_group")
def test_export_on_a_mesh_of_one_reloads_with_peft_and_merged(tmp_path: Path) -> None:
    """FSDP2 on a group of one: the adapter on the base model (``PeftModel.from_pretrained``) and the merged export
    (``from_pretrained``) give the trained model's logits."""
    from peft import PeftModel
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lctrain.models.lora import export_lora
    from lctrain.parallel.fsdp import apply_fsdp

    cfg = load_config([*SMALL, "model.family=qwen3_moe", *EXPERTS])
    model = materialized("qwen3_moe")
    apply_fsdp(model, init_device_mesh("cpu", (1,)))
    input_ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = model(input_ids=input_ids).logits
        export_lora(model, model.config, cfg.model.lora, tmp_path, base_path=None, merged=True)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        base = AutoModelForCausalLM.from_config(model.config)
        materialize(base, random_init_source(model.config, 0), torch.device("cpu"))
        untrained = base(input_ids=input_ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
        for logits in (merged(input_ids=input_ids), adapted(input_ids=input_ids), model(input_ids=input_ids)):
            torch.testing.assert_close(logits.logits, trained, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(untrained, trained, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_planner_counts_the_expert_adapters_peft_makes(family: str) -> None:
    from lctrain.planner import ModelSpec
    from lctrain.planner.memory import Lora

    model = expert_model(family, *EXPERTS)
    config = model.config.to_dict()
    spec = ModelSpec.from_hf_config(config, name="tiny")
    per_layer = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and ".layers.0." in name)
    assert Lora(4, experts=True).layer_adapter_params(spec) == per_layer
    expert_adapters = 4 * 4 * (2 * 32 + 3 * 24)  # rank · E · (2h + 3I)
    assert Lora(4).layer_adapter_params(spec) == per_layer - expert_adapters  # the attention's


def test_planner_keeps_the_adapted_expert_weights_and_refuses_expert_parallelism() -> None:
    from lctrain.planner import NAMED_MODELS, Layout, Workload, stage_memory
    from lctrain.planner.search import layout_problems

    model = NAMED_MODELS["qwen3-30b-a3b"]
    none, full = Layout(1, 8, 1, 1, "none"), Layout(1, 8, 1, 1, "full")
    attention, experts = Workload(32768, 8, lora_rank=16), Workload(32768, 8, lora_rank=16, lora_experts=True)
    # in the backward (the peak of all four), every non-checkpointed layer keeps its adapted expert weights (bf16)
    assert {stage_memory(model, layout, work)[0].phase for layout in (none, full) for work in (attention, experts)} == {
        "backward"
    }
    kept = stage_memory(model, none, experts)[0].activations - stage_memory(model, none, attention)[0].activations
    assert kept == model.layers * model.expert_params * 2
    # checkpointed: one layer's, rebuilt in the backward
    rebuilt = stage_memory(model, full, experts)[0].recompute - stage_memory(model, full, attention)[0].recompute
    assert rebuilt == model.expert_params * 2
    # and their gradient while that layer's backward runs
    working = stage_memory(model, full, experts)[0].backward - stage_memory(model, full, attention)[0].backward
    assert working == model.expert_params * 2
    assert layout_problems(model, Layout(1, 8, 1, 1, "full", ep=2), experts) == [
        "model.lora.target_parameters with parallel.ep=2: peft holds every expert's adapters in one matrix and adds "
        "them to the whole expert weight, which expert parallelism splits over ranks; set parallel.ep=1, or "
        "model.lora.target_parameters=[] (adapters on attention only)"
    ]
    assert layout_problems(model, Layout(1, 8, 1, 1, "full", ep=2), attention) == []
