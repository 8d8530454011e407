"""Hugging Face Llama-style models: attention patching (loading, meta init and export arrive with the trainer)."""

from lctrain.models.patch import patch_attention

__all__ = ["patch_attention"]
