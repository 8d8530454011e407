"""Hugging Face Llama-style models: the ``model`` config section, build empty, load weights shard by shard, export; USP
attention patching; LoRA adapters (``lctrain.models.lora``).

The names below are imported from their modules when first used (``lctrain.lazy``): ``lctrain.models.config``, the
``model`` section of a job's config, imports without torch or transformers.
"""

from lctrain.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "config": ("LoraConfig", "ModelConfig", "RopeScalingConfig"),
        "hf": (
            "build_empty_model",
            "export_hf",
            "materialize",
            "model_config",
            "random_init_source",
            "safetensors_source",
        ),
        "patch": ("patch_attention",),
    },
)
