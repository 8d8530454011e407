"""A tiny Llama (3 layers, width 32, vocabulary 50) built as the trainer builds it: on the meta device, then
materialized on the CPU from the seeded random init."""

from __future__ import annotations

from pathlib import Path

import torch

from lctrain.config import ModelConfig, load_config
from lctrain.data import load_tokenizer
from lctrain.models import build_empty_model, export_hf, materialize, model_config, random_init_source

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    config = model_config(TINY, vocab_size=50)
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed), torch.device("cpu"))
    return model


def write_peaked_model(directory: Path) -> None:
    """A tiny random Llama (2 layers, width 64) with the embedded tokenizer, as a Hugging Face directory (weights std
    0.2: peaked predictions, so an argmax is never a near tie)."""
    tokenizer = load_tokenizer(None)
    cfg = load_config(
        ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.init_std=0.2"]
    )  # fmt: skip
    config = model_config(cfg.model, len(tokenizer))
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed=0), torch.device("cpu"))
    export_hf(model, config, directory, tokenizer=tokenizer)


def layer_saved_bytes(model: torch.nn.Module, tokens: int = 256, layer: int = 1) -> int:
    """The bytes of every tensor autograd keeps for the backward of decoder layer ``layer`` of ``model`` (a Hugging
    Face causal LM) on ``tokens`` random tokens, each storage once; parameters and RoPE's cos/sin (shared by all
    layers) left out."""
    positions = torch.arange(tokens)[None]
    x = torch.randn(1, tokens, model.config.hidden_size, requires_grad=True)
    with torch.no_grad():
        cos, sin = model.model.rotary_emb(x, positions)
    shared = {t.untyped_storage().data_ptr() for t in [*model.parameters(), cos, sin]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[layer](x, position_embeddings=(cos, sin), position_ids=positions)
    return sum(saved.values())


def exported_lora_logits(adapter: Path, merged: Path, seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits ``[1, seq, V]`` on seeded random tokens of a LoRA run's merged export ``merged`` loaded with
    ``from_pretrained``, of its ``adapter`` loaded with ``PeftModel.from_pretrained`` on the base model (the seeded
    init of ``train.seed`` 0), and of that base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged).eval()
    base = AutoModelForCausalLM.from_config(model.config)
    materialize(base, random_init_source(model.config, seed=0), torch.device("cpu"))  # the frozen base
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        untrained = base(input_ids=input_ids).logits
        adapted = PeftModel.from_pretrained(base, adapter).eval()(input_ids=input_ids).logits
    return expected, adapted, untrained
