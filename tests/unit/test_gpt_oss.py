"""gpt-oss checkpoints as published: MXFP4 experts (``*_blocks`` and ``*_scales`` in the published layout, a
``quantization_config`` of ``quant_method: mxfp4``) load dequantized through transformers' own MXFP4 dequantization,
to the same weights and logits as ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``; the
job's config then holds no quantization (training and export are unquantized); any other quantization is refused in
one line. (Training parity of gpt-oss: ``tests/distributed/test_published_checkpoints.py``; its experts:
``tests/unit/test_expert_parallel.py``; its sinks: ``tests/unit/test_sinks.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from lctrain.config import check_model_job, load_config
from lctrain.models import build_empty_model, materialize, model_config, safetensors_source
from lctrain.models.hf import checkpoint_layout
from lctrain.models.layouts import LAYOUT_WORDS
from tests.helpers.checkpoints import hf_model, save_checkpoint


def mxfp4_checkpoint(directory: Path) -> Path:
    """A tiny gpt-oss checkpoint whose experts are MXFP4 in the published layout: for each ``[E, in, out]``
    projection, ``_blocks`` ``[E, out, in / 32, 16]`` (two 4-bit values a byte) and ``_scales`` ``[E, out, in / 32]``
    (biased exponents), random; the rest as ``save_pretrained`` wrote it."""
    save_checkpoint(hf_model("gpt_oss"), directory)
    tensors = load_file(directory / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = (experts, outputs, inputs // 32)
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (*blocks, 16), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(120, 130, blocks, generator=gen, dtype=torch.uint8)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    path = mxfp4_checkpoint(tmp_path)
    cfg = load_config([f"model.path={path}"])
    config = model_config(cfg.model, 0)
    check_model_job(cfg, 1, config, config.vocab_size)
    assert getattr(config, "quantization_config", None) is None  # trained and exported unquantized
    model = build_empty_model(config)
    materialize(model, safetensors_source(path, config), torch.device("cpu"))
    expected = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    reference = expected.state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(param, reference[name]), name
    assert model.model.layers[0].mlp.experts.down_proj.abs().max() > 0.5  # the MXFP4 values, not the init's
    input_ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids).logits, expected(input_ids).logits, atol=0, rtol=0)
    assert checkpoint_layout(path) == LAYOUT_WORDS["published"]  # the MXFP4 tensors converted


def test_another_quantization_is_refused_in_one_line(tmp_path: Path) -> None:
    save_checkpoint(hf_model("gpt_oss"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config([f"model.path={tmp_path}"])
    with pytest.raises(ValueError, match="holds quantized weights") as error:
        config = model_config(cfg.model, 0)
        check_model_job(cfg, 1, config, config.vocab_size)
    assert "\n" not in str(error.value)
