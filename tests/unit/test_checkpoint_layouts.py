"""Checkpoints as users have them: every family's tiny model written by transformers' ``save_pretrained`` (the
published layout: a mixture of experts' experts one tensor each), in its fused in-memory layout
(``save_original_format=False``) and sharded with an index, read by lctrain's loader into exactly the tensors
``from_pretrained`` loads; lctrain's export in each layout has the names, shapes and values ``save_pretrained``
writes and reloads with the same logits; a checkpoint that cannot make the model is refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from lctrain.models import build_empty_model, materialize, safetensors_source
from lctrain.models.hf import export_hf
from lctrain.models.layouts import CheckpointLayoutError, checkpoint_files, checkpoint_source, conversions
from tests.helpers.checkpoints import FAMILIES, PER_EXPERT_FAMILIES, hf_model, save_checkpoint


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, by name."""
    tensors = {}
    for name, file in checkpoint_files(directory).items():
        with safe_open(file, "pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout,shards", [("published", 1), ("published", 3), ("fused", 1)])
def test_a_saved_checkpoint_loads_the_tensors_from_pretrained_loads(
    family: str, layout: str, shards: int, tmp_path: Path
) -> None:
    original = hf_model(family)
    save_checkpoint(original, tmp_path, layout=layout, shards=shards)
    if shards > 1:
        assert len(set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    if family in PER_EXPERT_FAMILIES:  # the two layouts differ: one tensor per expert, or the fused ones
        names = set(checkpoint_files(tmp_path))
        assert any(".experts.0." in name for name in names) == (layout == "published")
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    loaded = build_empty_model(original.config)
    materialize(loaded, safetensors_source(tmp_path, original.config), torch.device("cpu"))
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name
    empty = build_empty_model(original.config)
    _, plan = checkpoint_source(checkpoint_files(tmp_path), empty, "x")
    # a dense family's two layouts are the same names: "single", or "fused" where transformers declares renames that
    # a text-only checkpoint does not need (Qwen3.5's language_model prefix)
    dense = "fused" if conversions(empty, legacy=False) else "single"
    assert plan.layout == (layout if family in PER_EXPERT_FAMILIES else dense) and plan.unused == []


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["published", "fused"])
def test_the_export_is_what_save_pretrained_writes(family: str, layout: str, tmp_path: Path) -> None:
    model = hf_model(family, seed=1)
    save_checkpoint(model, tmp_path / "saved", layout=layout)
    tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
    export_hf(tensors, model.config, tmp_path / "exported", layout=layout)
    saved, exported = _saved(tmp_path / "saved"), _saved(tmp_path / "exported")
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    input_ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model.eval()(input_ids).logits, rtol=0, atol=0)


def test_a_checkpoint_of_another_family_names_the_first_missing_tensor_and_the_layouts_tried(tmp_path: Path) -> None:
    save_checkpoint(hf_model("qwen3"), tmp_path)
    moe = hf_model("qwen3_moe").config
    with pytest.raises(CheckpointLayoutError) as error:
        safetensors_source(tmp_path, moe)
    message = str(error.value)
    assert "\n" not in message
    assert (
        f"model.path={str(tmp_path)!r}: no tensor of the checkpoint makes 'model.layers.0.mlp.experts.gate_up_proj'"
        in (message)
    )
    assert "mlp.experts.*.gate_proj.weight + mlp.experts.*.up_proj.weight -> mlp.experts.gate_up_proj" in message
    assert "its fused in-memory layout" in message
    assert "the nearest it has is 'model.layers.0.mlp.gate_proj.weight'" in message
    assert "is it a qwen3_moe checkpoint written by transformers' save_pretrained, as its config.json says?" in message
    # a family without conversions: one layout tried
    save_checkpoint(hf_model("qwen3_moe"), tmp_path / "moe")
    with pytest.raises(
        CheckpointLayoutError, match="makes 'model.layers.0.mlp.gate_proj.weight' .tried the one layout of qwen3 "
    ):
        safetensors_source(tmp_path / "moe", hf_model("qwen3").config)


def test_a_checkpoint_missing_one_expert_or_with_wrong_shapes_is_named(tmp_path: Path) -> None:
    model = hf_model("mixtral")
    save_checkpoint(model, tmp_path)
    tensors = _saved(tmp_path)
    from safetensors.torch import save_file

    # one expert's tensor gone: the fused tensor it makes has 3 experts, not 4
    del tensors["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    read = safetensors_source(tmp_path, model.config)
    with pytest.raises(CheckpointLayoutError) as error:
        read("model.layers.1.mlp.experts.gate_up_proj", model.model.layers[1].mlp.experts.gate_up_proj.shape)
    assert "model.layers.1.mlp.experts.gate_up_proj (made from model.layers.1.block_sparse_moe.experts.0.w1.weight" in (
        str(error.value)
    )
    assert "cannot be made (Sizes of tensors must match" in str(error.value)
    assert "does not describe its weights" in str(error.value)
    # a fused checkpoint whose experts are wider than its config.json says
    save_checkpoint(model, tmp_path / "fused", layout="fused")
    tensors = _saved(tmp_path / "fused")
    name = "model.layers.0.mlp.experts.down_proj"
    tensors[name] = torch.cat([tensors[name], tensors[name]], dim=-1)
    save_file(tensors, tmp_path / "fused" / "model.safetensors")
    shape = model.model.layers[0].mlp.experts.down_proj.shape
    wider = (*shape[:-1], 2 * shape[-1])
    with pytest.raises(CheckpointLayoutError, match=re.escape(f"{name} has shape {wider}, the model {tuple(shape)}")):
        safetensors_source(tmp_path / "fused", model.config)(name, shape)


def test_a_corrupted_or_incomplete_checkpoint_is_named(tmp_path: Path) -> None:
    model = hf_model("qwen3_moe")
    save_checkpoint(model, tmp_path / "one")
    file = tmp_path / "one" / "model.safetensors"
    file.write_bytes(file.read_bytes()[:1000])  # truncated inside the header
    with pytest.raises(CheckpointLayoutError, match=f"{file} is not a readable safetensors file"):
        safetensors_source(tmp_path / "one", model.config)
    save_checkpoint(model, tmp_path / "sharded", shards=3)
    (tmp_path / "sharded" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json names model-00002-of-00003.safetensors"):
        safetensors_source(tmp_path / "sharded", model.config)
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointLayoutError, match="is not a safetensors index"):
        safetensors_source(tmp_path / "sharded", model.config)
