"""Hugging Face Llama-style models: the ``model`` config section, build empty, load weights shard by shard, export; USP
attention patching; LoRA adapters (``lctrain.models.lora``)."""

from lctrain.models.config import LoraConfig, ModelConfig, RopeScalingConfig
from lctrain.models.hf import (
    build_empty_model,
    export_hf,
    materialize,
    model_config,
    random_init_source,
    safetensors_source,
    set_rope,
)
from lctrain.models.patch import patch_attention

__all__ = [
    "LoraConfig",
    "ModelConfig",
    "RopeScalingConfig",
    "build_empty_model",
    "export_hf",
    "materialize",
    "model_config",
    "patch_attention",
    "random_init_source",
    "safetensors_source",
    "set_rope",
]
