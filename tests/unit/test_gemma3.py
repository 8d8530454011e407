"""Gemma 3 (``gemma3_text``, and the language model of ``gemma3`` image-text checkpoints): RoPE per layer type (the
local layers' base, the global layers' base with its scaling, which ``model.rope_theta`` and ``model.rope_scaling``
set), the language model of an image-text checkpoint read alone to the image-text model's text logits, and what
lctrain cannot run exactly refused in one line. (Training parity: ``tests/distributed/test_published_checkpoints.py``
and ``tests/distributed/test_sink_window_families.py``; windows: ``tests/unit/test_model_families.py``.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Gemma3ForConditionalGeneration

from lctrain.config import check_model_job, load_config
from lctrain.models import build_empty_model, materialize, model_config, safetensors_source
from lctrain.models.hf import checkpoint_layout
from lctrain.models.layouts import LAYOUT_WORDS
from tests.helpers.checkpoints import hf_model, save_checkpoint

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 300,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}
LONGROPE = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}


def test_rope_settings_set_the_global_layers_and_the_local_keep_theirs(tmp_path: Path) -> None:
    save_checkpoint(hf_model("gemma3_text"), tmp_path)
    scaling = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_theta=500000"]
    cfg = load_config([f"model.path={tmp_path}", "model.rope_scaling.original_max_position_embeddings=64", *scaling])
    config = model_config(cfg.model, 0)
    rope = config.rope_parameters
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10_000.0}
    assert rope["full_attention"]["rope_type"] == "yarn" and rope["full_attention"]["rope_theta"] == 500_000
    model = build_empty_model(config)
    local, full = (
        getattr(model.model.rotary_emb, f"{kind}_inv_freq") for kind in ("sliding_attention", "full_attention")
    )
    assert not torch.allclose(local, full)


def test_the_language_model_of_an_image_text_checkpoint_trains_alone(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma3", text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    cfg = load_config([f"model.path={tmp_path}"])
    with caplog.at_level(logging.INFO, logger="lctrain"):
        text = model_config(cfg.model, 0)
    assert (
        text.model_type == "gemma3_text"
        and "training its language model (gemma3_text); left out: its vision tower and projector" in caplog.text
    )
    check_model_job(cfg, 1, text, text.vocab_size)
    model = build_empty_model(text)
    read = safetensors_source(tmp_path, text)
    # the tied LM head: materialize outside FSDP makes it a tensor of its own, the embeddings' (as the trainer's)
    materialize(
        model, lambda name, shape: read(name.replace("lm_head", "model.embed_tokens"), shape), torch.device("cpu")
    )
    assert checkpoint_layout(tmp_path) == LAYOUT_WORDS["published"]  # its language model's tensors renamed
    expected = Gemma3ForConditionalGeneration.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids).logits, expected(input_ids=input_ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("attn_logit_softcapping", 50.0, "sets attn_logit_softcapping=50.0"),
        ("final_logit_softcapping", 30.0, "sets final_logit_softcapping=30.0"),
        ("use_bidirectional_attention", True, "sets use_bidirectional_attention"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_type": "longrope", "rope_theta": 1e4, **LONGROPE}},
            "RoPE type 'longrope'",
        ),
    ],
)
def test_what_lctrain_cannot_run_exactly_is_refused_in_one_line(
    field: str, value: object, message: str, tmp_path: Path
) -> None:
    save_checkpoint(hf_model("gemma3_text"), tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    if field == "rope_parameters":
        value = {**fields["rope_parameters"], **value}
    (tmp_path / "config.json").write_text(json.dumps({**fields, field: value}))
    cfg = load_config([f"model.path={tmp_path}"])
    with pytest.raises(ValueError, match=message) as error:
        config = model_config(cfg.model, 0)
        check_model_job(cfg, 1, config, config.vocab_size)
    assert "\n" not in str(error.value)
