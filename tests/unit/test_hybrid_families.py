"""The hybrid families as users have them: a Qwen3.5 checkpoint with a vision tower trains its language model, and
the settings its linear-attention layers cannot honour are refused in one line each, before any process group."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from lctrain.build import prepare_model
from lctrain.config import load_config
from lctrain.data import load_tokenizer
from lctrain.families import linear_layers
from lctrain.models import build_empty_model, materialize, model_config, safetensors_source
from lctrain.models.config import ModelConfig
from tests.helpers.checkpoints import hf_model, save_checkpoint


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model("qwen3_5_text"), tmp_path_factory.mktemp("qwen3_5_text"))


def test_a_vision_language_checkpoint_trains_its_language_model(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    text = hf_model("qwen3_5_text").config.to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    torch.manual_seed(0)
    full = AutoModelForImageTextToText.from_config(
        AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    )
    save_checkpoint(full, tmp_path)
    with caplog.at_level(logging.INFO, logger="lctrain"):
        config = model_config(ModelConfig(path=str(tmp_path)), len(load_tokenizer(None)))
    assert config.model_type == "qwen3_5_text" and linear_layers(config) == [0]
    lines = [r.getMessage() for r in caplog.records if "language model" in r.getMessage()]
    assert lines == [
        f"model.path={str(tmp_path)!r}: a qwen3_5 checkpoint: training its language model (qwen3_5_text); "
        "left out: its vision tower"
    ]
    model = build_empty_model(config)
    materialize(model, safetensors_source(tmp_path, config), torch.device("cpu"))
    input_ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=input_ids).logits, full(input_ids=input_ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (
            ["parallel.ulysses=4"],
            4,
            "parallel.ulysses=4 does not divide the linear-attention layers' 2 key heads and 4 value heads",
        ),
        (["parallel.ring=2", "data.seq_len=8"], 2, "leaves fewer tokens than the linear layers' convolution halo (3)"),
    ],
)
def test_settings_the_linear_layers_cannot_honour_are_refused(
    hybrid_dir: Path, overrides: list[str], world: int, message: str
) -> None:
    cfg = load_config(["model=hf", f"model.path='{hybrid_dir}'", "data.seq_len=64", *overrides])
    with pytest.raises(ValueError) as error:
        prepare_model(cfg, world)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_rope_scaling_keeps_the_quarter_of_each_head_that_rotates() -> None:
    """``model.rope_scaling`` (YaRN, factor 4) on a Qwen3.5 config whose RoPE rotates a quarter of each head in
    interleaved sections: the scaled RoPE keeps that geometry, and its frequencies are transformers' own for the
    config written that way (what the export holds), not those of the whole head."""
    from transformers import AutoModelForCausalLM

    from lctrain.families import set_rope
    from lctrain.models.config import RopeScalingConfig

    geometry = {"partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    config = hf_model("qwen3_5_text").config
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e7, **geometry}
    scaling = RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=256)
    set_rope(config, ModelConfig(max_position_embeddings=1024, rope_scaling=scaling))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e7}
    assert config.rope_parameters == {**yarn, **geometry}
    written = AutoConfig.for_model(**{**config.to_dict(), "rope_parameters": {**yarn, **geometry}})
    scaled, expected = (AutoModelForCausalLM.from_config(c).model.rotary_emb for c in (config, written))
    assert scaled.inv_freq.numel() == config.head_dim // 8  # a quarter of the head, in pairs
    assert torch.equal(scaled.inv_freq, expected.inv_freq) and scaled.attention_scaling == expected.attention_scaling
