"""transformers' gated delta layers (Qwen3-Next's and Qwen3.5's) run by ``gated_deltanet_forward`` on spawned gloo
groups (ring 2, Ulysses 2, ring 2 x Ulysses 2, ring 4; zigzag and contiguous; packed documents crossing pieces,
starting exactly at a piece's first token, one token long; preference pairs sharing their prompt, ``doc_prefix``)
against the same module run by transformers on each document alone in one process, a pair's answer after its prompt.

One process group per world size runs every case, in fp32. The reference is transformers' module in float64 (its
chunked delta rule computes in fp32 all the same); the output and the gradients (of the input and of every parameter,
summed over the ranks) must each be within 4 x transformers' own fp32 error of that tensor (the largest over its
elements, its fp32 run against its float64 one) + 1e-6. Against transformers' fp32 run with fixed tolerances, one
case's error was as large as 0.995 of them: the two fp32 errors add, and they are the order of the tolerance; an error
of the sharding (a state, a halo, a document boundary) is orders of magnitude larger.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from lctrain.attention import SequencePlace, unshard_sequence
from lctrain.linear_attention.gated_deltanet import patch_linear_attention
from lctrain.rules import check_linear_heads
from lctrain.testing import run_distributed

LENGTH = 48
DOCUMENTS = [0, 5, 12, 13, 30, 47, LENGTH]  # a start at ring 2 zigzag's second chunk; one-token documents
# pairs [prompt | chosen | rejected] (the answers' prefix the prompt) and a plain document: on ring 4 zigzag (chunks
# of 6) each rejected answer starts in another chunk and rank than its prompt ends in; a prompt of 2 tokens (shorter
# than the convolution's halo), a prompt ending at a chunk's end, one-token answers
PAIRS = ([0, 9, 14, 20, 21, 23, 26, 27, 36, 37, LENGTH], [-1, 0, 0, -1, -1, 4, 4, -1, 7, 7])
MODULES = {"qwen3_next": Qwen3NextGatedDeltaNet, "qwen3_5_text": Qwen3_5GatedDeltaNet}


@dataclass(frozen=True)
class Case:
    family: str
    ring: int
    ulysses: int
    layout: str
    packed: bool
    pairs: bool = False


CASES = {
    2: [
        Case("qwen3_5_text", 2, 1, "zigzag", False),
        Case("qwen3_5_text", 2, 1, "zigzag", True),
        Case("qwen3_next", 2, 1, "contiguous", True),
        Case("qwen3_next", 1, 2, "zigzag", True),
        Case("qwen3_next", 2, 1, "zigzag", True, pairs=True),
    ],
    4: [
        Case("qwen3_5_text", 2, 2, "zigzag", True),
        Case("qwen3_next", 2, 2, "zigzag", True),
        Case("qwen3_5_text", 4, 1, "zigzag", True),
        Case("qwen3_5_text", 4, 1, "zigzag", True, pairs=True),
        Case("qwen3_5_text", 4, 1, "contiguous", True, pairs=True),
        Case("qwen3_5_text", 2, 2, "zigzag", True, pairs=True),
    ],
}


def _module(family: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny gated delta layer with every parameter random (seeded: the same on every rank), in ``dtype``."""
    config = AutoConfig.for_model(
        family,
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(0)
    module = MODULES[family](config, 0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return module.to(dtype)


def _data(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2, LENGTH, 32, generator=gen), torch.randn(2, LENGTH, 32, generator=gen)


def _documents(case: Case) -> tuple[list[int], list[int]]:
    if case.pairs:
        return PAIRS
    bounds = DOCUMENTS if case.packed else [0, LENGTH]
    return bounds, [-1] * (len(bounds) - 1)


def reference(case: Case, dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' module in ``dtype`` on each document alone (after its prefix): output, input gradient, parameter
    gradients."""
    module = _module(case.family, dtype)
    hidden, cotangent = (x.to(dtype) for x in _data(case))
    hidden.requires_grad_()
    bounds, prefixes = _documents(case)
    outs = []
    for (a, b), p in zip(zip(bounds, bounds[1:]), prefixes):
        tokens = hidden[:, a:b] if p < 0 else torch.cat([hidden[:, bounds[p] : bounds[p + 1]], hidden[:, a:b]], dim=1)
        outs.append(module(tokens)[:, -(b - a) :])
    out = torch.cat(outs, dim=1)
    (out * cotangent).sum().backward()
    return [out.detach(), hidden.grad, *(p.grad for p in module.parameters())]


def run_case(case: Case) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (case.ring, case.ulysses), mesh_dim_names=("ring", "ulysses"))
    place = SequencePlace.from_mesh(mesh, case.layout)
    module = copy.deepcopy(_module(case.family))
    patch_linear_attention(
        [module], ring_group=mesh.get_group("ring"), ulysses_group=mesh.get_group("ulysses"), layout=case.layout
    )
    hidden, cotangent = _data(case)
    hidden = place.shard(hidden, dim=1).clone().requires_grad_()
    bounds, prefixes = (torch.tensor(t) for t in _documents(case))
    out = module(hidden, cu_seq_lens_q=bounds, doc_prefix=prefixes if case.pairs else None)
    (out * place.shard(cotangent, dim=1)).sum().backward()
    world = dist.get_world_size()
    gathered = []
    for local in (out.detach(), hidden.grad):
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local.contiguous())
        order = unshard_sequence(shards, dim=1, ring_size=case.ring, ulysses_size=case.ulysses, layout=case.layout)
        gathered.append(order)
    grads = [p.grad.clone() for p in module.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
    return gathered + grads


def world_job(world: int) -> list[list[torch.Tensor]]:
    return [run_case(case) for case in CASES[world]]


@pytest.fixture(scope="module")
def results() -> dict[int, list[list[torch.Tensor]]]:
    return {world: run_distributed(world_job, world, world)[0] for world in CASES}


@pytest.mark.parametrize(
    "world,index", [(w, i) for w, cases in CASES.items() for i in range(len(cases))], ids=lambda x: str(x)
)
def test_sharded_layer_equals_documents_run_alone(results, world: int, index: int) -> None:  # noqa: ANN001
    case = CASES[world][index]
    got, exact, theirs = results[world][index], reference(case, torch.float64), reference(case, torch.float32)
    names = ["output", "input grad", *(f"grad {n}" for n, _ in _module(case.family).named_parameters())]
    for name, value, want, fp32 in zip(names, got, exact, theirs, strict=True):
        error, their_error = ((x.double() - want).abs().max().item() for x in (value, fp32))
        assert error <= 4 * their_error + 1e-6, f"{case} {name}: {error:.2e} > 4 x transformers' {their_error:.2e}"


def test_ulysses_must_divide_the_linear_heads() -> None:
    with pytest.raises(ValueError, match=r"parallel.ulysses=4 does not divide the linear-attention layers' 2 key"):
        check_linear_heads(2, 4, 4)
