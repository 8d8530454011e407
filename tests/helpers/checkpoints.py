"""Tiny Hugging Face checkpoints of every family lctrain trains, as users have them: a model made by transformers
(its own seeded init) and written by its ``save_pretrained`` in the published layout (the default: a mixture of
experts' experts one tensor each), in transformers' fused in-memory layout (``save_original_format=False``), or
sharded over several files with an index; with lctrain's embedded tokenizer beside it, so a job can take the
directory as ``model.path`` alone."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lctrain.data import load_tokenizer
from lctrain.families import FAMILIES as RECORDS

FAMILIES = tuple(RECORDS)
MOE_FAMILIES = tuple(name for name, record in RECORDS.items() if record.moe)
# the mixtures whose published checkpoints hold one tensor per expert, unlike the model (gpt-oss's hold them fused)
PER_EXPERT_FAMILIES = tuple(name for name in MOE_FAMILIES if name != "gpt_oss")


def layouts(family: str) -> tuple[str, ...]:
    """The checkpoint layouts of ``family`` that differ: published and fused for ``PER_EXPERT_FAMILIES``, else one."""
    return ("published", "fused") if family in PER_EXPERT_FAMILIES else ("published",)


_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
# a hybrid's gated delta layer first, its full-attention layer second; a mixture of experts' shared expert
_LINEAR = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
}


def hf_model(family: str, seed: int = 0) -> PreTrainedModel:
    """A tiny ``family`` model with transformers' own random init (seeded), fp32, the embedded tokenizer's vocab; a
    mixture of experts with 4 experts of width 32, 2 per token (and a shared expert of width 32 where it has one);
    a hybrid with a gated delta layer (2 key heads, 4 value heads of 8) before its full-attention layer; gpt-oss's
    and Gemma 3's layers a sliding one (a window of 8) and a full one; Gemma 3's RoPE bases and scaling as in its 27B
    model (``query_pre_attn_scalar`` 256, its config's default: not the head dim)."""
    record = RECORDS[family]
    experts = record.experts
    sizes = _SIZES if experts is None else {**_SIZES, experts.count: 4, experts.width: 32, "num_experts_per_tok": 2}
    if record.window == "pattern":  # a sliding and a full layer, the window shorter than the tests' rows
        sizes = {**sizes, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    if family == "gemma3_text":  # Gemma 3 27B's RoPE: the local layers' base, the global layers' base scaled x8
        sizes["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        }
    if record.linear_mixer is not None:
        sizes = {**sizes, **_LINEAR} | ({"shared_expert_intermediate_size": 32} if experts is not None else {})
    config = AutoConfig.for_model(family, vocab_size=len(load_tokenizer(None)), **sizes)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_checkpoint(model: PreTrainedModel, directory: Path, *, layout: str = "published", shards: int = 1) -> Path:
    """``model`` written by ``save_pretrained`` into ``directory`` with the embedded tokenizer: ``layout``
    ``published`` (its default) or ``fused`` (``save_original_format=False``), in ``shards`` files (> 1: with
    ``model.safetensors.index.json``)."""
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(
        directory,
        save_original_format=layout == "published",
        max_shard_size=size // shards + 1 if shards > 1 else "50GB",
    )
    load_tokenizer(None).save_pretrained(directory)
    return directory
