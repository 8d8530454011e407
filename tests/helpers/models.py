"""A tiny Llama (3 layers, width 32, vocabulary 50) built as the trainer builds it: on the meta device, then
materialized on the CPU from the seeded random init."""

from __future__ import annotations

import torch

from lctrain.config import ModelConfig
from lctrain.models import build_empty_model, materialize, model_config, random_init_source

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    config = model_config(TINY, vocab_size=50)
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed), torch.device("cpu"))
    return model
