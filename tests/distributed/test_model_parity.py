"""A Hugging Face model of each family with USP attention on a (ring × ulysses) mesh reproduces the
single-process model.

Every rank holds the full model (same seed) and its zigzag shard of one packed row (input ids, global position
ids, labels shifted on the global row); ``cu_seq_lens_q`` carries the document boundaries. The loss is the
token-summed cross-entropy (``chunked_cross_entropy``) divided by the number of valid tokens over the
context-parallel group, and the
gradients are summed over that group (each rank's are partial sums over its tokens). The reference runs the plain
model (sdpa attention) on each document separately. Tolerances (fp32): loss within 1e-5 relative; every parameter
gradient within 1e-5 absolute + 1e-4 relative. The families, each on (ring 2), (ulysses 2) and (ring 2 × ulysses 2)
(Llama on three more meshes): Llama; Llama 3.2's form (tied embeddings, the ``llama3`` RoPE type); Mistral with a
sliding window of 5 tokens on every layer (as Mistral-7B-v0.1 declares one); Qwen2 (q/k/v biases) and Qwen3 (q/k
RMSNorm) with ``use_sliding_window`` and ``max_window_layers=1``: layer 0 full, layer 1 windowed. In the reference
the windows are transformers' own sliding-window masks, in the sharded model the window USP attention receives
from each layer; the row holds documents longer than the window.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from lctrain.families import layer_windows
from lctrain.models import patch_attention
from lctrain.parallel.dims import ParallelDims
from lctrain.parallel.mesh import JobMesh
from lctrain.testing import run_distributed
from lctrain.train.loss import chunked_cross_entropy

VOCAB = 97
WINDOW = 5
SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
}
LLAMA3_ROPE = {  # Llama 3.1/3.2's RoPE type, its original context shrunk so it changes these positions' frequencies
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}  # layer 1 slides
FAMILIES = {  # name: (transformers config fields beyond SIZES, the window of each layer)
    "llama": ({"model_type": "llama"}, [None, None]),
    "llama3.2": ({"model_type": "llama", "tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}, [None, None]),
    "mistral": ({"model_type": "mistral", "sliding_window": WINDOW}, [WINDOW, WINDOW]),  # as Mistral-7B-v0.1
    "qwen2": ({"model_type": "qwen2", **QWEN_WINDOW}, [None, WINDOW]),
    "qwen3": ({"model_type": "qwen3", "head_dim": 16, **QWEN_WINDOW}, [None, WINDOW]),  # q/k norms
}
MESHES = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)], 8: [(4, 2), (2, 4)]}  # (ring, ulysses) per world size
CASES = [(world, ring, ulysses, "llama") for world, meshes in MESHES.items() for ring, ulysses in meshes] + [
    (world, ring, ulysses, family)
    for family in FAMILIES
    if family != "llama"
    for world, ring, ulysses in [(2, 2, 1), (2, 1, 2), (4, 2, 2)]
]


def build_model(family: str) -> torch.nn.Module:
    fields, windows = FAMILIES[family]
    config = AutoConfig.for_model(**fields, **SIZES)
    assert layer_windows(config) == windows
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def packed_row(seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """input_ids, position_ids, labels ``[1, S]`` of a row of several documents, and its cu_seqlens."""
    rng = random.Random(seq_len)
    bounds = sorted({0, 1, *rng.sample(range(2, seq_len), 4), seq_len})  # a length-1 document first
    gen = torch.Generator().manual_seed(seq_len)
    input_ids = torch.randint(0, VOCAB, (1, seq_len), generator=gen)
    position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])[None]
    labels = torch.full_like(input_ids, -100)
    for a, b in zip(bounds, bounds[1:]):
        labels[0, a : b - 1] = input_ids[0, a + 1 : b]  # the last token of a document predicts nothing
    return input_ids, position_ids, labels, bounds


def loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum")


def sharded_step(
    ring: int, ulysses: int, family: str, build: Callable[[str], torch.nn.Module] | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and context-parallel-summed gradients of one forward+backward on this rank's shard of the model
    ``build`` (default ``build_model``) makes of ``family``."""
    mesh = JobMesh.build(ParallelDims(ring=ring, ulysses=ulysses), "cpu")
    model = (build or build_model)(family)
    patch_attention(model, ulysses_group=mesh.group("ulysses"), ring_group=mesh.group("ring"))
    input_ids, position_ids, labels, bounds = packed_row(seq_len=16 * ring * ulysses)
    shard = functools.partial(mesh.place.shard, dim=1)
    hidden = model.model(
        input_ids=shard(input_ids),
        position_ids=shard(position_ids),
        cu_seq_lens_q=torch.tensor(bounds, dtype=torch.int32),
    ).last_hidden_state
    # the chunked loss on this rank's tokens (5 at a time), divided by the valid tokens of the whole row
    local_sum, tokens = chunked_cross_entropy(hidden, model.lm_head.weight, shard(labels), chunk_tokens=5)
    cp_group = mesh.cp
    dist.all_reduce(tokens, group=cp_group)
    loss = local_sum / tokens
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=cp_group)
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=cp_group)
        grads[name] = param.grad
    return reported.item(), grads


def world_job(world: int) -> dict:
    return {
        (ring, ulysses, family): sharded_step(ring, ulysses, family) for w, ring, ulysses, family in CASES if w == world
    }


@functools.cache
def results_for(world: int) -> dict:
    return run_distributed(world_job, world, world)[0]


@pytest.mark.parametrize("world,ring,ulysses,family", CASES, ids=lambda x: str(x))
def test_sharded_model_matches_single_process_model(world: int, ring: int, ulysses: int, family: str) -> None:
    loss, grads = results_for(world)[(ring, ulysses, family)]
    _, _, _, bounds = packed_row(seq_len=16 * ring * ulysses)
    assert len(bounds) > 3 and max(b - a for a, b in zip(bounds, bounds[1:])) > WINDOW  # the window matters
    assert_documents_alone_match(build_model(family), 16 * ring * ulysses, loss, grads)


def assert_documents_alone_match(
    model: torch.nn.Module, seq_len: int, loss: float, grads: dict[str, torch.Tensor]
) -> None:
    """``loss`` and ``grads`` (a sharded step's) equal ``model``'s on each document of the packed row run alone."""
    input_ids, _, labels, bounds = packed_row(seq_len=seq_len)
    total = sum(loss_sum(model(input_ids=input_ids[:, a:b]).logits, labels[:, a:b]) for a, b in zip(bounds, bounds[1:]))
    expected = total / (labels != -100).sum()
    expected.backward()
    assert abs(loss - expected.item()) <= 1e-5 * abs(expected.item())
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
