"""Bad configurations fail early with one message that names the setting and says how to fix it; every recipe
starts with its launch line and composes into a job that passes the checks for that launch.

``load_config`` (Hydra composition: unknown keys, groups, recipes, required values) and ``check_job`` (cross-field
checks against the world size and the model) run here without any process group; ``model_config`` and
``safetensors_source`` report a missing or empty ``model.path``. Each case asserts substrings of the message: the
setting (``parallel.ring=3`` ...) and the fix.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from transformers import AutoModelForCausalLM, LlamaConfig

from lctrain.config import RECIPE_DIR, check_job, load_config
from lctrain.families import layer_windows, linear_layers
from lctrain.models import model_config, safetensors_source
from lctrain.train.stages import check_stage_jobs, stage_configs

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
VOCAB = 1000  # the tokenizer's vocabulary size given to check_job
SMALL = ["model.num_heads=4", "model.num_kv_heads=2", "data.seq_len=128"]

# (overrides, world size, substrings of the message)
BAD_JOBS = {
    "mesh_product": (
        ["parallel.ring=3"],
        4,
        ["pp x dp x ring x ulysses = 1 x 1 x 3 x 1 = 3", "4 processes", "make the degrees multiply to the world size"],
    ),
    "mesh_product_dp": (
        ["parallel.dp=2", "parallel.ring=2"],
        2,
        ["1 x 2 x 2 x 1 = 4", "2 processes", "multiply to the world size"],
    ),
    "zero_degree": (["parallel.ulysses=0"], 1, ["parallel.ulysses=0 must be >= 1"]),
    "pp_mesh_product": (["parallel.pp=2", "parallel.ring=2"], 2, ["2 x 1 x 2 x 1 = 4", "2 processes"]),
    "pp_schedule": (
        ["parallel.pp=2", "parallel.pp_schedule=Zigzag"],
        2,
        ["parallel.pp_schedule='Zigzag' must be one of"],
    ),
    "pp_more_stages_than_layers": (
        ["parallel.pp=4", "model.num_layers=3"],
        4,
        ["4 pipeline stages (parallel.pp=4 x parallel.pp_stages_per_rank=1)", "only 3 layers", "lower parallel.pp"],
    ),
    "pp_interleaved_one_stage": (
        ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
        2,
        ["parallel.pp_schedule=Interleaved1F1B interleaves several stages", "set parallel.pp_stages_per_rank >= 2"],
    ),
    "pp_single_stage_schedule": (
        ["parallel.pp=2", "parallel.pp_schedule=GPipe", "parallel.pp_stages_per_rank=2"],
        2,
        ["parallel.pp_schedule=GPipe runs one stage per rank", "parallel.pp_stages_per_rank=2: set it to 1"],
    ),
    "pp_v_schedule": (
        ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble", "parallel.pp_stages_per_rank=3", "model.num_layers=6"],
        2,
        ["ZBVZeroBubble runs exactly 2 stages per rank", "set parallel.pp_stages_per_rank=2"],
    ),
    "pp_microbatches_1f1b": (
        ["parallel.pp=4", "data.batch_size=1", "train.grad_accum=3"],
        4,
        ["1F1B needs at least as many micro-batches as stages (4)", "a step has 3", "raise data.batch_size"],
    ),
    "pp_microbatches_interleaved": (
        ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=2", "data.batch_size=5"],
        2,
        ["runs micro-batches in rounds of parallel.pp=2", "5 micro-batches", "must be a multiple of 2"],
    ),
    "pp_split_points_count": (
        ["parallel.pp=2", "parallel.pp_split_points=[model.layers.1,model.layers.2]", "data.batch_size=2"],
        2,
        ["parallel.pp_split_points has 2 entries but 2 stages need 1", "model.layers.2"],
    ),
    "pp_split_points_name": (
        ["parallel.pp=2", "parallel.pp_split_points=[layers.2]", "data.batch_size=2"],
        2,
        ["parallel.pp_split_points entry 'layers.2' is not a decoder layer", "use model.layers.<i> with 0 < i < 4"],
    ),
    "pp_split_points_order": (
        ["parallel.pp=3", "parallel.pp_split_points=[model.layers.2,model.layers.1]", "data.batch_size=3"],
        3,
        ["must name increasing layers"],
    ),
    "pp_tied_embeddings": (
        ["parallel.pp=2", "model.tie_word_embeddings=true", "data.batch_size=2"],
        2,
        ["parallel.pp=2 with tied input and output embeddings", "model.tie_word_embeddings=false"],
    ),
    "heads_vs_ulysses": (
        ["model.num_heads=6", "model.num_kv_heads=2", "parallel.ulysses=4"],
        4,
        ["parallel.ulysses=4 does not divide the 6 attention heads", "choose a ulysses degree that divides 6"],
    ),
    "kv_heads_vs_ulysses": (
        ["model.num_heads=12", "model.num_kv_heads=6", "parallel.ulysses=4"],
        4,
        ["parallel.ulysses=4 and the 6 key/value heads", "one must divide the other"],
    ),
    "seq_len_zigzag": (
        ["parallel.ring=2", "parallel.ulysses=2", "data.seq_len=100"],
        4,
        ["data.seq_len=100 is not divisible by 8", "2·ring·ulysses", "use a multiple of 8"],
    ),
    "seq_len_contiguous": (
        ["parallel.ring=4", "parallel.layout=contiguous", "data.seq_len=102"],
        4,
        ["data.seq_len=102 is not divisible by 4", "layout='contiguous'", "use a multiple of 4"],
    ),
    "unknown_layout": (["parallel.layout=diagonal"], 1, ["parallel.layout='diagonal' must be one of"]),
    "activation_checkpointing": (
        ["parallel.activation_checkpointing=sometimes"],
        1,
        ["parallel.activation_checkpointing='sometimes' must be one of", "'full'", "'selective'"],
    ),
    "ac_every": (["parallel.ac_every=0"], 1, ["parallel.ac_every=0 must be >= 1"]),
    "param_dtype": (["parallel.param_dtype=fp8"], 1, ["parallel.param_dtype='fp8' must be one of", "'bfloat16'"]),
    "batch_size": (["data.batch_size=0"], 1, ["data.batch_size=0 must be >= 1"]),
    "steps": (["train.steps=0"], 1, ["train.steps=0 must be >= 1"]),
    "grad_accum": (["train.grad_accum=-1"], 1, ["train.grad_accum=-1 must be >= 1"]),
    "loss_chunk": (["train.loss_chunk_tokens=0"], 1, ["train.loss_chunk_tokens=0 must be >= 1"]),
    "keep": (["checkpoint.keep=0"], 1, ["checkpoint.keep=0 must be >= 1"]),
    "checkpoint_every": (["checkpoint.every=-1"], 1, ["checkpoint.every=-1 must be >= 0", "0 = only at the end"]),
    "vocab_size": (
        ["model.vocab_size=999"],
        1,
        [f"model.vocab_size=999 is smaller than the tokenizer's {VOCAB} tokens", f"set model.vocab_size >= {VOCAB}"],
    ),
    "family": (
        ["model.family=gpt2"],
        1,
        ["model.family='gpt2' is a 'gpt2' model", "Supported model types: llama, mistral, qwen2, qwen3"],
    ),
    "min_lr_ratio": (["optim.min_lr_ratio=1.5"], 1, ["optim.min_lr_ratio=1.5 must be in [0, 1]"]),
    "betas": (["optim.betas=[0.9]"], 1, ["optim.betas=[0.9] must be two numbers"]),
    "device": (["train.device=tpu"], 1, ["train.device='tpu' must be auto, cuda or cpu"]),
    "wandb": (["logging.wandb=maybe"], 1, ["logging.wandb='maybe' must be disabled, offline or online"]),
    "timeout": (["train.timeout_s=0"], 1, ["train.timeout_s=0.0 must be > 0"]),
    "rope_type": (["model.rope_scaling.type=ntk"], 1, ["model.rope_scaling.type='ntk' must be one of", "yarn"]),
    "rope_factor": (
        ["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"],
        1,
        ["model.rope_scaling.factor=0.5 must be >= 1", "16 for 8K -> 128K"],
    ),
    "rope_original": (
        ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8"],
        1,
        ["model.rope_scaling.type=llama3 needs model.rope_scaling.original_max_position_embeddings", "e.g. 8192"],
    ),
    "rope_dynamic_cp": (
        ["model.rope_scaling.type=dynamic", "model.rope_scaling.factor=4", "model.max_position_embeddings=64"]
        + ["parallel.ring=2"],
        2,
        ["differs between the 2 context-parallel ranks", "set model.max_position_embeddings >= 128"],
    ),
    "ulysses_across_nodes": (
        ["parallel.ulysses_across_nodes=allow"],
        1,
        ["parallel.ulysses_across_nodes='allow' must be error or warn"],
    ),
}


def check(overrides: list[str], world_size: int, local_world_size: int | None = None) -> None:
    cfg = load_config([*SMALL, *overrides])
    check_job(
        cfg,
        world_size,
        num_heads=cfg.model.num_heads,
        num_kv_heads=cfg.model.num_kv_heads,
        num_layers=cfg.model.num_layers,
        tied_embeddings=cfg.model.tie_word_embeddings,
        vocab_size=VOCAB,
        local_world_size=local_world_size,
        max_position_embeddings=cfg.model.max_position_embeddings or 131072,
    )


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_bad_job_names_setting_and_fix(case: str) -> None:
    overrides, world_size, expected = BAD_JOBS[case]
    with pytest.raises(ValueError) as error:
        check(overrides, world_size)
    for text in expected:
        assert text in str(error.value), f"{text!r} not in {str(error.value)!r}"


@pytest.mark.parametrize(
    "overrides,world_size,expected",
    [
        (["train.val_every=-1"], 1, "train.val_every=-1 must be >= 0 (0 = only at the end)"),
        (["train.val_rows=0"], 1, "train.val_rows=0 must be >= 1"),
        (
            ["parallel.pp=2", "data.batch_size=2", "data.val_sources=[{name: v, split: validation}]"],
            2,
            "data.val_sources with parallel.pp=2: validation runs without a pipeline",
        ),
    ],
)
def test_bad_validation_settings_name_the_setting(overrides: list[str], world_size: int, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        check(overrides, world_size)


@pytest.mark.parametrize(
    "overrides,world_size",
    [
        ([], 1),
        (["parallel.ring=2", "parallel.ulysses=2"], 4),
        (["parallel.dp=2", "parallel.ring=2", "parallel.ulysses=2", "parallel.layout=contiguous"], 8),
        (["model.num_heads=8", "model.num_kv_heads=2", "parallel.ulysses=4"], 4),  # kv heads replicated
        (["model.vocab_size=1024", "checkpoint.every=0"], 1),
    ],
)
def test_good_job_passes(overrides: list[str], world_size: int) -> None:
    check(overrides, world_size)


@pytest.mark.parametrize(
    "degrees,world_size,per_node",
    [
        (["parallel.ring=2", "parallel.ulysses=4", "model.num_heads=8"], 8, 4),  # a Ulysses group per node
        (["parallel.ring=4", "parallel.ulysses=2"], 8, 4),  # two Ulysses groups per node
        (["parallel.ring=2", "parallel.ulysses=4", "model.num_heads=8"], 8, 8),  # one node
        (["parallel.ulysses=4", "model.num_heads=8", "model.num_kv_heads=4"], 4, 4),
    ],
)
def test_ulysses_groups_inside_nodes_pass(degrees: list[str], world_size: int, per_node: int) -> None:
    check(degrees, world_size, per_node)


@pytest.mark.parametrize(
    "degrees,world_size,per_node",
    [
        (["parallel.ring=2", "parallel.ulysses=4", "model.num_heads=8"], 8, 2),  # 4 ranks over two 2-rank nodes
        (["parallel.ulysses=2", "parallel.ring=3", "data.seq_len=120"], 6, 3),  # ranks 2, 3 straddle two nodes
    ],
)
def test_ulysses_group_across_nodes_is_refused_or_warned(
    degrees: list[str], world_size: int, per_node: int, caplog: pytest.LogCaptureFixture
) -> None:
    ulysses = next(d for d in degrees if d.startswith("parallel.ulysses=")).split("=")[1]
    expected = [
        f"parallel.ulysses={ulysses} does not divide the {per_node} processes per node",
        "spans two nodes",
        f"choose a ulysses degree that divides {per_node} and move the rest to parallel.ring",
        "parallel.ulysses_across_nodes=warn",
    ]
    with pytest.raises(ValueError) as error:
        check(degrees, world_size, per_node)
    for text in expected:
        assert text in str(error.value), f"{text!r} not in {str(error.value)!r}"
    with caplog.at_level("WARNING", logger="lctrain"):
        check([*degrees, "parallel.ulysses_across_nodes=warn"], world_size, per_node)
    assert any(expected[0] in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    "override,expected",
    [
        ("model.hidden=64", ["Could not override 'model.hidden'"]),  # a typo of a key
        ("trainer.steps=5", ["trainer.steps"]),  # a typo of a section
        ("parallel.ring=two", ["parallel.ring=two"]),  # the wrong type
        ("parallel=cpu8", ["Could not find 'parallel/cpu8'", "Available options", "cpu4"]),
        ("recipe=tiny", ["Could not find 'recipe/tiny'", "Available options", "tiny_cpu"]),
    ],
)
def test_bad_override_is_a_hydra_error(override: str, expected: list[str]) -> None:
    with pytest.raises(HydraException) as error:
        load_config([override])
    message = str(error.value) + str(error.value.__cause__)
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


@pytest.mark.parametrize(
    "option,value",
    [("model=hf", "model.path=/models/llama"), ("data=jsonl", "data.paths=[train.jsonl]")],
)
def test_required_value_of_a_group_option(option: str, value: str) -> None:
    """``???`` in ``configs/model/hf.yaml`` / ``configs/data/jsonl.yaml``: without it the schema's default (random
    init / the embedded corpus) would be used silently."""
    key = value.split("=")[0]
    with pytest.raises(ValueError) as error:
        load_config([option])
    assert f"{option} needs {key}: add {key}=... to the command line" in str(error.value)
    load_config([option, value])  # given: composes


def test_missing_model_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    cfg = load_config(["model=hf", f"model.path='{missing}'"])
    with pytest.raises(FileNotFoundError, match=re.escape(f"model.path={str(missing)!r} has no config.json")) as error:
        model_config(cfg.model, VOCAB)
    assert "point it at a local Hugging Face model directory" in str(error.value)
    missing.mkdir()
    (missing / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileNotFoundError, match=re.escape(f"model.path={str(missing)!r} has no *.safetensors")):
        safetensors_source(missing, LlamaConfig())


_LOAD_AND_CHECK = """
import sys
from lctrain.config import check_job, load_config
cfg = load_config(["recipe=tiny_cpu"])
m = cfg.model
check_job(cfg, 4, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, num_layers=m.num_layers,
          tied_embeddings=m.tie_word_embeddings, vocab_size=8192)
print(sorted(name for name in ("torch", "transformers", "datasets", "peft") if name in sys.modules))
"""


def test_loading_and_checking_a_config_imports_no_torch() -> None:
    """Each section checks its own fields without torch, transformers or datasets (``lctrain.data.config``,
    ``lctrain.models.config``), so a bad setting is named before any of them loads."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_AND_CHECK], capture_output=True, text=True, timeout=120, cwd=REPO, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_recipes_exist() -> None:
    assert RECIPES, "no recipes/*.yaml"


# the checkpoints recipes fine-tune (model.path), as their config.json: the recipes are checked against these sizes
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
# Qwen3-8B and Mistral-7B-v0.1 as published on the Hugging Face Hub (written from the public config.json files; the
# fields lctrain reads, and those that decide the windows)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 36,
    "tie_word_embeddings": False,
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
}
# Llama-3.1-8B-Instruct: Llama-3-8B's sizes at 128K with the llama3 RoPE scaling, as published
LLAMA31_8B_INSTRUCT = {
    **LLAMA3_8B,
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
# Qwen3-30B-A3B and Mixtral-8x7B-v0.1, mixtures of experts, as published (the fields lctrain reads)
QWEN3_30B_A3B = {
    **QWEN3_8B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "max_window_layers": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
MIXTRAL_8X7B_V01 = {
    **MISTRAL_7B_V01,
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
}
# gpt-oss-20b and -120b (MXFP4 experts as released) and Gemma 3 27B (an image-text checkpoint), as published
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "head_dim": 64,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
GPT_OSS_120B = {
    **GPT_OSS_20B,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "model_type": "gemma3_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}
# Qwen3-Next-80B-A3B-Instruct as published (its layer_types by transformers' default: three linear, then one full)
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "rope_theta": 10000000,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
}
# the Qwen3.5 family's attention head and gated delta layers (35B-A3B and 4B alike)
QWEN3_5_LINEAR = {
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
# Qwen3.5-35B-A3B (an image-text checkpoint): the sizes of its language model (transformers' Qwen3_5MoeTextConfig
# defaults but the RoPE base and context), its vision tower left to transformers' defaults
QWEN3_5_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        **QWEN3_5_LINEAR,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
    },
    "tie_word_embeddings": False,
}
# Qwen3.5-4B (an image-text checkpoint): its language model's sizes as public copies of its config.json give them;
# tied embeddings inferred from its published total (docs/recipes.md); RoPE as the Qwen3.5 family's (a quarter of
# each head, in interleaved sections)
QWEN3_5_4B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 2560,
        "intermediate_size": 9216,
        "num_hidden_layers": 32,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        **QWEN3_5_LINEAR,
        "vocab_size": 248320,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
    },
    "tie_word_embeddings": True,
}
CHECKPOINTS = {
    "/models/Qwen3.5-4B": QWEN3_5_4B,
    "/models/Qwen3-Next-80B-A3B-Instruct": QWEN3_NEXT_80B,
    "/models/Qwen3.5-35B-A3B": QWEN3_5_35B,
    "/models/gpt-oss-20b": GPT_OSS_20B,
    "/models/gpt-oss-120b": GPT_OSS_120B,
    "/models/gemma-3-27b-it": GEMMA3_27B,
    "/models/Meta-Llama-3-8B": LLAMA3_8B,
    "/models/Meta-Llama-3-8B-Instruct": LLAMA3_8B,
    "/models/Llama-3.1-8B-Instruct": LLAMA31_8B_INSTRUCT,
    "/models/Qwen3-8B": QWEN3_8B,
    "/models/Mistral-7B-v0.1": MISTRAL_7B_V01,
    "/models/Qwen3-30B-A3B": QWEN3_30B_A3B,
    "/models/Mixtral-8x7B-v0.1": MIXTRAL_8X7B_V01,
}
SBATCH_GPUS = re.search(r"#SBATCH --gpus-per-node=(\d+)", (REPO / "scripts/slurm/train.sbatch").read_text())


def recipe_model(path: str, tmp_path: Path) -> Path:
    """A local directory with the config.json of the checkpoint a recipe names."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if path in ("runs/tiny_cpu/hf", "runs/tiny_cpu_sft/hf"):  # what `make train` exports, and its SFT
        config = model_config(load_config(["recipe=tiny_cpu"]).model, vocab_size=8192).to_dict()
    else:
        assert path in CHECKPOINTS, f"add the config of {path} to this test"
        config = CHECKPOINTS[path]
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_starts_with_its_launch_line_and_composes(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch line is ``torchrun ... --nproc-per-node N -m lctrain train recipe=NAME ...`` (one node) or
    ``sbatch --nodes=M [--gpus-per-node=G] scripts/slurm/train.sbatch recipe=NAME ...`` (M nodes of G GPUs, by
    default the script's); the
    recipe composes, and every stage passes ``check_job`` for that launch with the model it trains."""
    lines = [line for line in recipe.read_text().splitlines() if not line.startswith("# @package")]
    launch = lines[0]
    torchrun = re.fullmatch(r"# torchrun .*--nproc-per-node[ =](\d+) -m lctrain train (.*)", launch)
    sbatch = re.fullmatch(r"# sbatch --nodes=(\d+)(?: --gpus-per-node=(\d+))? scripts/slurm/train\.sbatch (.*)", launch)
    assert torchrun or sbatch, f"{recipe}: the first line is {launch!r}, not a torchrun or sbatch launch line"
    if torchrun:
        world_size = per_node = int(torchrun.group(1))
    else:
        per_node = int(sbatch.group(2) or SBATCH_GPUS.group(1))
        world_size = int(sbatch.group(1)) * per_node
    overrides = (torchrun.group(2) if torchrun else sbatch.group(3)).split()
    assert f"recipe={recipe.stem}" in overrides, f"{recipe}: the launch line does not select recipe={recipe.stem}"
    cfg = load_config(overrides)
    if cfg.model.path is not None:
        cfg.model.path = str(recipe_model(cfg.model.path, tmp_path))
    model = model_config(cfg.model, vocab_size=cfg.model.vocab_size or 8192)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    jobs = stage_configs(cfg)
    check_stage_jobs(jobs, world_size, model, model.vocab_size)


def test_family_recipes_train_the_published_architecture(tmp_path: Path) -> None:
    """Mistral-7B keeps its 4,096-token window on every layer; Qwen3-8B has none and is extended with YaRN."""
    mistral = load_config(["recipe=mistral_7b_32k"])
    mistral.model.path = str(recipe_model(mistral.model.path, tmp_path / "mistral"))
    assert layer_windows(model_config(mistral.model, vocab_size=32000)) == [4096] * 32
    qwen = load_config(["recipe=qwen3_8b_128k"])
    qwen.model.path = str(recipe_model(qwen.model.path, tmp_path / "qwen"))
    config = model_config(qwen.model, vocab_size=151936)
    assert layer_windows(config) == [None] * 36 and config.head_dim == 128
    assert config.rope_parameters == {
        "rope_theta": 1000000,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }


def test_qwen3_5_4b_at_1m_scales_rope_keeping_its_rotary_quarter(tmp_path: Path) -> None:
    """The 1M recipe's YaRN (factor 4 over 262,144) on Qwen3.5-4B's language model keeps its partial rotary factor
    and interleaved sections, and its 4.21B parameters are the planner's named size."""
    from lctrain.planner import NAMED_MODELS

    cfg = load_config(["recipe=qwen3_5_4b_1m"])
    cfg.model.path = str(recipe_model(cfg.model.path, tmp_path))
    config = model_config(cfg.model, vocab_size=248320)
    geometry = {"partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144, "rope_theta": 10000000}
    assert config.rope_parameters == {**yarn, **geometry} and config.max_position_embeddings == 1048576
    assert config.tie_word_embeddings and linear_layers(config) == [i for i in range(32) if i % 4 != 3]
    with torch.device("meta"):  # keeps the tie (accelerate's init_empty_weights would break it)
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == NAMED_MODELS["qwen3.5-4b"].num_params == 4_205_751_296


def test_sizes_transformers_refuses_name_the_model_settings() -> None:
    """transformers validates a config's sizes with its own error types; lctrain reports them as a ValueError (one
    line before any process group) naming the model.* settings."""
    with pytest.raises(ValueError) as error:
        model_config(load_config(["model.num_heads=5"]).model, vocab_size=8192)
    message = str(error.value)
    assert "model.num_heads=5" in message and "not a multiple of the number of attention heads" in message
    assert "change the model.* settings" in message
