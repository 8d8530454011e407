"""The gated delta rule and its causal convolution on pieces of a sequence, in one process: pieces summarised,
composed in global order and finished from their true entering states equal the unsplit recurrence (transformers'
token-by-token reference, run on each document alone), outputs and gradients, for arbitrary cuts, zigzag order and
documents crossing pieces or starting exactly at one."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from lctrain.linear_attention.conv import causal_conv
from lctrain.linear_attention.delta_rule import compose, delta_rule_pieces

LENGTH = 48
# (pieces in local order, document starts)
CASES = {
    "one piece, one document": ([(0, 48)], [0]),
    "uneven cuts": ([(0, 7), (7, 20), (20, 21), (21, 48)], [0]),
    "zigzag of 3, one document": ([(0, 8), (40, 48), (8, 16), (32, 40), (16, 24), (24, 32)], [0]),
    "zigzag of 2, documents": ([(0, 12), (36, 48), (12, 24), (24, 36)], [0, 5, 12, 13, 30, 47]),
    "documents at and inside pieces": ([(0, 16), (16, 32), (32, 48)], [0, 3, 16, 17, 40]),
}
for seed in range(3):  # random cuts, held in a random order, and random document starts
    rng = random.Random(seed)
    cuts = sorted({0, *rng.sample(range(1, LENGTH), 5), LENGTH})
    pieces = list(zip(cuts, cuts[1:]))
    CASES[f"random {seed}"] = (rng.sample(pieces, len(pieces)), sorted({0, *rng.sample(range(1, LENGTH), 6)}))


def _inputs(seed: int, heads_k: int = 2, heads_v: int = 4, dk: int = 8, dv: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, LENGTH, heads_k, dk, generator=gen) for _ in range(2))
    v = torch.randn(2, LENGTH, heads_v, dv, generator=gen)
    g = -F.softplus(torch.randn(2, LENGTH, heads_v, generator=gen))
    beta = torch.rand(2, LENGTH, heads_v, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _reference(q, k, v, g, beta, doc_starts):  # noqa: ANN001, ANN202
    """Each document run alone by transformers' token-by-token recurrence."""
    bounds = [*doc_starts, LENGTH]
    outs = [
        torch_recurrent_gated_delta_rule(
            *(t[:, a:b] for t in (q, k, v)), g=g[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True
        )[0]
        for a, b in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs, dim=1)


def _local(t: torch.Tensor, pieces) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([t[:, a:b] for a, b in pieces], dim=1)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pieces_composed_equal_the_unsplit_recurrence(case: str) -> None:
    pieces, doc_starts = CASES[case]
    inputs = _inputs(0)
    weight = torch.randn(2, LENGTH, 4, 6, generator=torch.Generator().manual_seed(1))
    out = delta_rule_pieces(*(_local(t, pieces) for t in inputs), pieces, doc_starts)
    grads = torch.autograd.grad((out * _local(weight, pieces)).sum(), inputs)
    expected = _reference(*inputs, doc_starts)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs)
    torch.testing.assert_close(out, _local(expected, pieces), atol=2e-5, rtol=1e-4)
    for name, grad, reference in zip("q k v g beta".split(), grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=5e-5, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def test_composition_is_the_affine_chain() -> None:
    gen = torch.Generator().manual_seed(2)
    summaries = [torch.randn(1, 2, 3, 5, generator=gen) for _ in range(3)]
    states = compose(summaries)
    assert torch.equal(states[0], torch.zeros(1, 2, 3, 2))
    a, b = summaries[0][..., :3], summaries[0][..., 3:]
    torch.testing.assert_close(states[1], b)
    torch.testing.assert_close(states[2], summaries[1][..., :3] @ (a @ states[0] + b) + summaries[1][..., 3:])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_convolution_on_pieces_sees_no_other_document(case: str) -> None:
    pieces, doc_starts = CASES[case]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, LENGTH, 5, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, requires_grad=True)
    starts = torch.tensor(doc_starts)
    outs = []
    for a, b in pieces:
        halo = F.pad(x[:, max(a - 3, 0) : a], (0, 0, 3 - (a - max(a - 3, 0)), 0))
        outs.append(causal_conv(x[:, a:b], halo, weight, a, starts))
    out = torch.cat(outs, dim=1)
    bounds = [*doc_starts, LENGTH]
    expected = torch.cat(
        [
            F.silu(F.conv1d(x[:, a:b].transpose(1, 2), weight[:, None], padding=3, groups=5)[..., : b - a])
            for a, b in zip(bounds, bounds[1:])
        ],
        dim=2,
    ).transpose(1, 2)
    torch.testing.assert_close(out, _local(expected, pieces), atol=1e-6, rtol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * cotangent).sum(), (x, weight))
    expected_grads = torch.autograd.grad((_local(expected, pieces) * cotangent).sum(), (x, weight))
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5)
