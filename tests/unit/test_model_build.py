"""The model as the trainer builds it: the seeded random init, weights read from safetensors files (and what is
wrong with them named), activation checkpointing on the chosen layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from lctrain.config import ModelConfig
from lctrain.models import build_empty_model, materialize, model_config, safetensors_source
from lctrain.models.hf import hf_name
from lctrain.parallel.activation_checkpointing import apply_activation_checkpointing
from tests.helpers.models import TINY, tiny_model


def test_random_init_is_seeded_per_tensor_and_like_hugging_face() -> None:
    a, b, c = tiny_model(0), tiny_model(0), tiny_model(1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
    weight = a.model.embed_tokens.weight
    assert weight.std().item() == pytest.approx(TINY.init_std, rel=0.1)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, a.model.layers[1].self_attn.q_proj.weight)
    # RoPE buffers survive the meta build and materialize
    rotary = a.model.rotary_emb
    expected = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))  # the default base
    torch.testing.assert_close(rotary.inv_freq, expected)


def test_safetensors_source_reads_a_saved_model_and_names_what_is_wrong(tmp_path: Path) -> None:
    model = tiny_model(3)
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, tmp_path / "model.safetensors")
    loaded = build_empty_model(model.config)
    materialize(loaded, safetensors_source(tmp_path, model.config), torch.device("cpu"))
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), name
    read = safetensors_source(tmp_path, model.config)
    with pytest.raises(KeyError, match="model has no tensor 'missing.weight'"):
        read("missing.weight", torch.Size([1]))
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(50, 32\), the model \(2, 2\)"):
        read("model.embed_tokens.weight", torch.Size([2, 2]))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        safetensors_source(tmp_path / "empty", model.config)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_config(ModelConfig(path=str(tmp_path / "nowhere")), vocab_size=50)


@pytest.mark.parametrize("mode,every,wrapped", [("none", 1, []), ("full", 1, [0, 1, 2]), ("selective", 2, [0, 2])])
def test_activation_checkpointing_wraps_the_chosen_layers(mode: str, every: int, wrapped: list[int]) -> None:
    model = tiny_model()
    input_ids = torch.randint(0, 50, (1, 12))
    before = model(input_ids=input_ids).logits
    apply_activation_checkpointing(model.model.layers, mode, every)
    assert [i for i, layer in enumerate(model.model.layers) if isinstance(layer, CheckpointWrapper)] == wrapped
    assert {hf_name(n) for n, _ in model.named_parameters()} == {n for n, _ in tiny_model().named_parameters()}
    torch.testing.assert_close(model(input_ids=input_ids).logits, before)
