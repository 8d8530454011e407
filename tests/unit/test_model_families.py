"""The model families lctrain runs (``lctrain/families.py``): every decoder layer's attention receives the
sliding window ``layer_windows`` says it has (recorded from the attention function transformers calls), for
checkpoints shaped like the published ones and for random init, with ``model.sliding_window`` null, 0 and W; the
exported ``config.json`` reloads with the same windows; model types and config features lctrain cannot run exactly
are refused by name with the reason, before any process group exists. (Parity of each family with transformers:
``tests/distributed/test_model_parity.py``, ``test_pipeline_parity.py``, ``test_export.py``.)
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lctrain.config import check_model_job, load_config
from lctrain.data import load_tokenizer
from lctrain.families import layer_windows
from lctrain.models import export_hf, model_config

VOCAB = 50
SIZES = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
LLAMA32_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# config.json fields of the published checkpoints each case is shaped like (sizes shrunk to SIZES)
MISTRAL_V01 = {"model_type": "mistral", "sliding_window": 4096}  # Mistral-7B-v0.1
MISTRAL_V03 = {"model_type": "mistral", "sliding_window": None}  # Mistral-7B-v0.3
QWEN25 = {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28}
QWEN2_SLIDING = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
QWEN3 = {"model_type": "qwen3", "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36}
QWEN3_SLIDING = {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}
MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "head_dim": 16,
    "use_sliding_window": False,
}
GPT_OSS = {  # gpt-oss-20b: every other layer slides (128 tokens there)
    "model_type": "gpt_oss",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "head_dim": 8,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}
GEMMA3 = {  # Gemma 3: five local layers to one global (its window 1024 on the local ones), here two to one
    "model_type": "gemma3_text",
    "head_dim": 8,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
}
# (config.json fields, model.sliding_window, the window of each of the 3 layers)
CHECKPOINTS = {
    "llama": ({"model_type": "llama"}, None, [None, None, None]),
    "llama3.2": (
        {"model_type": "llama", "tie_word_embeddings": True, "rope_scaling": LLAMA32_ROPE, "rope_theta": 5e5},
        None,
        [None, None, None],
    ),
    "mistral_v0.1": (MISTRAL_V01, None, [4096, 4096, 4096]),
    "mistral_v0.1_off": (MISTRAL_V01, 0, [None, None, None]),
    "mistral_v0.1_16": (MISTRAL_V01, 16, [16, 16, 16]),
    "mistral_v0.3": (MISTRAL_V03, None, [None, None, None]),
    "mistral_v0.3_16": (MISTRAL_V03, 16, [16, 16, 16]),
    "qwen2.5": (QWEN25, None, [None, None, None]),
    "qwen2.5_off": (QWEN25, 0, [None, None, None]),
    "qwen2_sliding": (QWEN2_SLIDING, None, [None, 8, 8]),  # layers >= max_window_layers slide
    "qwen2_sliding_off": (QWEN2_SLIDING, 0, [None, None, None]),
    "qwen2_sliding_16": (QWEN2_SLIDING, 16, [None, 16, 16]),
    "qwen2_layer_types": (
        {**QWEN2_SLIDING, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        None,
        [8, None, 8],
    ),
    "qwen3": ({**QWEN3, "head_dim": 16}, None, [None, None, None]),
    "qwen3_sliding": ({**QWEN3_SLIDING, "head_dim": 16}, None, [None, None, 8]),
    "qwen3_sliding_5": ({**QWEN3_SLIDING, "head_dim": 16}, 5, [None, None, 5]),
    # Mixtral-8x7B-v0.1 declares no window, Qwen3-30B-A3B none (use_sliding_window false): every layer or none
    "mixtral": ({**MIXTRAL, "sliding_window": None}, None, [None, None, None]),
    "mixtral_16": ({**MIXTRAL, "sliding_window": None}, 16, [16, 16, 16]),
    "mixtral_window": ({**MIXTRAL, "sliding_window": 8}, None, [8, 8, 8]),
    "mixtral_window_off": ({**MIXTRAL, "sliding_window": 8}, 0, [None, None, None]),
    "qwen3_moe": (QWEN3_MOE, None, [None, None, None]),
    "qwen3_moe_16": (QWEN3_MOE, 16, [16, 16, 16]),
    "qwen3_moe_sliding": ({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}, None, [8, 8, 8]),
    "qwen3_moe_sliding_off": ({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}, 0, [None] * 3),
    "gpt_oss": (GPT_OSS, None, [8, None, 8]),
    "gpt_oss_off": (GPT_OSS, 0, [None, None, None]),
    "gpt_oss_16": (GPT_OSS, 16, [16, None, 16]),
    "gemma3_text": (GEMMA3, None, [8, 8, None]),
    "gemma3_text_off": (GEMMA3, 0, [None, None, None]),
    "gemma3_text_16": (GEMMA3, 16, [16, 16, None]),
}
# random init: (model.family, model.sliding_window, windows)
RANDOM_INIT = {
    "llama": ("llama", None, [None, None, None]),
    "mistral": ("mistral", None, [None, None, None]),  # not transformers' default 4096
    "mistral_16": ("mistral", 16, [16, 16, 16]),
    "qwen2": ("qwen2", None, [None, None, None]),
    "qwen2_16": ("qwen2", 16, [16, 16, 16]),
    "qwen3": ("qwen3", None, [None, None, None]),
    "qwen3_16": ("qwen3", 16, [16, 16, 16]),
    "mixtral": ("mixtral", None, [None, None, None]),  # not transformers' default 4096
    "mixtral_16": ("mixtral", 16, [16, 16, 16]),
    "qwen3_moe": ("qwen3_moe", None, [None, None, None]),
    "qwen3_moe_16": ("qwen3_moe", 16, [16, 16, 16]),
    "gpt_oss": ("gpt_oss", None, [None, None, None]),  # not transformers' default 128 on every other layer
    "gpt_oss_16": ("gpt_oss", 16, [16, None, 16]),  # its own sliding layers
    "gemma3_text": ("gemma3_text", None, [None, None, None]),
    "gemma3_text_16": ("gemma3_text", 16, [16, 16, 16]),  # transformers' pattern: the sixth layer is the first global
}

_received: dict[int, int | None] = {}


def _recording_attention(module, query, key, value, attention_mask, *, sliding_window=None, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    _received[module.layer_idx] = sliding_window
    return torch.zeros_like(query).transpose(1, 2), None


AttentionInterface.register("lctrain_test_record_window", _recording_attention)


def received_windows(config: object) -> list[int | None]:
    """The ``sliding_window`` each layer's attention module passes to the attention function in a forward."""
    _received.clear()
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="lctrain_test_record_window")
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])
    return [_received[index] for index in range(config.num_hidden_layers)]


def checkpoint(tmp_path: Path, fields: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**SIZES, **fields}))
    return tmp_path


def job(overrides: list[str]):  # noqa: ANN201
    return load_config(["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=3"] + overrides)


def assert_windows(config: object, expected: list[int | None], tmp_path: Path) -> None:
    assert layer_windows(config) == expected
    assert received_windows(config) == expected
    config.save_pretrained(tmp_path / "export")  # what export_hf writes
    exported = AutoConfig.from_pretrained(tmp_path / "export")
    assert layer_windows(exported) == expected
    assert received_windows(exported) == expected


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_checkpoint_layers_get_their_window(case: str, tmp_path: Path) -> None:
    fields, setting, expected = CHECKPOINTS[case]
    window = "null" if setting is None else setting
    cfg = job(["model=hf", f"model.path={checkpoint(tmp_path, fields)}", f"model.sliding_window={window}"])
    config = model_config(cfg.model, VOCAB)
    check_model_job(cfg, 1, config, VOCAB)
    assert_windows(config, expected, tmp_path)
    if case == "llama3.2":
        assert config.tie_word_embeddings and config.rope_parameters["rope_type"] == "llama3"


@pytest.mark.parametrize("case", list(RANDOM_INIT))
def test_random_init_layers_get_their_window(case: str, tmp_path: Path) -> None:
    family, setting, expected = RANDOM_INIT[case]
    window = "null" if setting is None else setting
    cfg = job(["model.num_heads=4", "model.num_kv_heads=2", f"model.family={family}", f"model.sliding_window={window}"])
    config = model_config(cfg.model, VOCAB)
    check_model_job(cfg, 1, config, VOCAB)
    assert config.model_type == family
    assert getattr(config, "head_dim", 8) == 8  # hidden / heads, also for Qwen3 (its config class defaults to 128)
    assert_windows(config, expected, tmp_path)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_has_q_and_k_norms(family: str) -> None:
    config = model_config(job([f"model.family={family}"]).model, VOCAB)
    names = {name for name, _ in AutoModelForCausalLM.from_config(config).named_parameters()}
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= names


# refused: (config.json fields, or None for random init with the overrides; overrides; world size; message parts)
REFUSED = {
    "gemma2": (
        {"model_type": "gemma2"},
        [],
        1,
        ["is a 'gemma2' model", "soft-caps", "llama, mistral, qwen2, qwen3, qwen3_moe, mixtral"],
    ),
    "qwen2_moe": ({"model_type": "qwen2_moe"}, [], 1, ["is a 'qwen2_moe' model", "mixture-of-experts"]),
    "router_jitter": (
        {**MIXTRAL, "router_jitter_noise": 0.1},
        [],
        1,
        ["sets router_jitter_noise=0.1", "set router_jitter_noise to 0"],
    ),
    "router_loss_without_routers": (
        None,
        ["model.router_aux_loss_coef=0.01"],
        1,
        ["model.router_aux_loss_coef=0.01 for model.family='llama'", "without routers: set it to null"],
    ),
    "global_router_scope_without_router_loss": (
        None,
        ["model.family=qwen3_moe", "train.router_aux_scope=global"],
        1,
        ["train.router_aux_scope=global for model.family='qwen3_moe'", "set train.router_aux_scope=sequence"],
    ),
    "negative_router_loss": (QWEN3_MOE, ["model.router_aux_loss_coef=-1"], 1, ["must be >= 0 (or null"]),
    "top_k_above_experts": (
        None,
        ["model.family=qwen3_moe", "model.num_experts=2", "model.experts_per_token=3"],
        1,
        ["routes each token to 3 of 2 experts", "model.experts_per_token between 1 and model.num_experts"],
    ),
    "gemma3_softcapping": ({**GEMMA3, "final_logit_softcapping": 30.0}, [], 1, ["sets final_logit_softcapping=30.0"]),
    "phi3": ({"model_type": "phi3"}, [], 1, ["is a 'phi3' model", "longrope"]),
    "random_init_family": (None, ["model.family=gpt2"], 1, ["model.family='gpt2' is a 'gpt2' model"]),
    "attention_dropout": (
        {"model_type": "qwen2", "attention_dropout": 0.1},
        [],
        1,
        ["sets attention_dropout=0.1", "USP attention has no dropout", "set attention_dropout to 0"],
    ),
    "quantized": (
        {"model_type": "llama", "quantization_config": {"quant_method": "awq", "bits": 4}},
        [],
        1,
        ["holds quantized weights", "use the unquantized checkpoint"],
    ),
    "longrope": (
        {
            "model_type": "llama",
            "rope_scaling": {
                "rope_type": "longrope",
                "factor": 2.0,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 64,
            },
        },
        [],
        1,
        ["uses RoPE type 'longrope'", "default, linear, dynamic, yarn, llama3"],
    ),
    "layer_type": (
        {"model_type": "qwen3", "layer_types": ["chunked_attention", "full_attention", "full_attention"]},
        [],
        1,
        ["has layer_types ['chunked_attention']"],
    ),
    "window_on_llama": (
        {"model_type": "llama"},
        ["model.sliding_window=16"],
        1,
        [
            "model.sliding_window=16 for model.path=",
            "llama attention has no sliding window",
            "Set model.sliding_window to null",
        ],
    ),
    "window_on_random_init_llama": (
        None,
        ["model.sliding_window=16"],
        1,
        ["model.sliding_window=16 for model.family='llama'", "has no sliding window"],
    ),
    "window_on_qwen_without_windowed_layers": (
        QWEN25,
        ["model.sliding_window=16"],
        1,
        ["has no sliding-window layers", "set use_sliding_window, sliding_window and max_window_layers"],
    ),
    "negative_window": (MISTRAL_V01, ["model.sliding_window=-1"], 1, ["model.sliding_window=-1 must be null"]),
    "dynamic_rope_of_the_checkpoint": (
        {"model_type": "llama", "max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        ["parallel.ring=2", "data.seq_len=128"],
        2,
        ["RoPE type dynamic", "differs between the 2 context-parallel ranks", "model.max_position_embeddings >= 128"],
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_lctrain_cannot_run_exactly_is_refused_with_the_reason(case: str, tmp_path: Path) -> None:
    fields, overrides, world_size, expected = REFUSED[case]
    model = ["model=hf", f"model.path={checkpoint(tmp_path, fields)}"] if fields is not None else []
    with pytest.raises(ValueError) as error:  # the config refuses a family, model_config a checkpoint's type
        cfg = job([*model, *overrides])
        check_model_job(cfg, world_size, model_config(cfg.model, VOCAB), VOCAB)
    for text in expected:
        assert text in str(error.value), f"{text!r} not in {str(error.value)!r}"


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_export_of_each_family_keeps_the_default_tokenizer(family: str, tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """For model type qwen2, transformers' AutoTokenizer builds a Qwen2Tokenizer from the exported vocabulary (another
    pre-tokenizer, one more token): ``load_tokenizer`` (next stages, eval) still reads the tokenizer trained with, and
    the export warns that AutoTokenizer would not."""
    tokenizer = load_tokenizer(None)
    config = model_config(job([f"model.family={family}", "model.num_heads=4", "model.num_kv_heads=2"]).model, 8192)
    with caplog.at_level(logging.WARNING, logger="lctrain"):
        export_hf(AutoModelForCausalLM.from_config(config), config, tmp_path, tokenizer)
    text = Path(logging.__file__).read_text()[:4000]
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    substituted = AutoTokenizer.from_pretrained(tmp_path)
    differs = substituted(text)["input_ids"] != tokenizer(text)["input_ids"] or len(substituted) != len(tokenizer)
    assert differs == (family == "qwen2")
    warned = [r.getMessage() for r in caplog.records if "AutoTokenizer loads" in r.getMessage()]
    assert len(warned) == (family == "qwen2")
    if warned:
        assert "Qwen2Tokenizer of 8193 tokens" in warned[0] and "PreTrainedTokenizerFast.from_pretrained" in warned[0]
