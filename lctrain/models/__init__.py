"""Hugging Face Llama-style models: the ``model`` config section, build empty, load weights shard by shard, export; USP
attention patching; LoRA adapters (``lctrain.models.lora``).

The names below are imported from their modules when first used, so that ``lctrain.models.config`` (the ``model``
section of a job's config) can be imported without torch or transformers.
"""

from importlib import import_module

_MODULES = {
    "LoraConfig": "config",
    "ModelConfig": "config",
    "RopeScalingConfig": "config",
    "build_empty_model": "hf",
    "export_hf": "hf",
    "materialize": "hf",
    "model_config": "hf",
    "random_init_source": "hf",
    "safetensors_source": "hf",
    "set_rope": "hf",
    "patch_attention": "patch",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULES[name]}"), name)
