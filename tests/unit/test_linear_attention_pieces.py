"""The gated delta rule and its causal convolution on pieces of a sequence, in one process: pieces run, their maps
composed in global order and finished from their true entering states equal the unsplit recurrence (transformers'
token-by-token reference, run on each document alone, a document with a prefix after its prefix), outputs and
gradients, for arbitrary cuts, zigzag order, documents crossing pieces or starting exactly at one, and preference
pairs ``[prompt | chosen | rejected]`` whose answers continue their prompt, among plain documents."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from lctrain.linear_attention.conv import causal_conv_pieces
from lctrain.linear_attention.delta_rule import compose, delta_rule_pieces
from lctrain.linear_attention.plan import Documents, row_plan

LENGTH = 48
# (pieces in local order, document starts, each document's prefix or None)
CASES = {
    "one piece, one document": ([(0, 48)], [0], None),
    "uneven cuts": ([(0, 7), (7, 20), (20, 21), (21, 48)], [0], None),
    "zigzag of 3, one document": ([(0, 8), (40, 48), (8, 16), (32, 40), (16, 24), (24, 32)], [0], None),
    "zigzag of 2, documents": ([(0, 12), (36, 48), (12, 24), (24, 36)], [0, 5, 12, 13, 30, 47], None),
    "documents at and inside pieces": ([(0, 16), (16, 32), (32, 48)], [0, 3, 16, 17, 40], None),
    # preference pairs [prompt | chosen | rejected] (the answers' prefix the prompt) among plain documents
    "pairs, zigzag of 2": (
        [(0, 12), (36, 48), (12, 24), (24, 36)],
        [0, 10, 14, 19, 20, 30, 33, 36],
        [-1, 0, 0, -1, -1, 4, 4, -1],
    ),
    "pairs, a prompt ending at a piece's end, short pieces": (
        [(0, 12), (12, 13), (13, 14), (14, 15), (15, 30), (30, 48)],
        [0, 12, 14, 30, 31, 33, 34, 40],
        [-1, 0, 0, -1, 3, 3, -1, -1],
    ),
    "three answers and a document between, one-token prefix": (
        [(0, 5), (5, 18), (18, 19), (19, 31), (31, 48)],
        [0, 6, 9, 15, 17, 21, 22, 23, 30],
        [-1, 0, -1, 0, 0, -1, 5, 5, -1],
    ),
}
for seed in range(3):  # random cuts, held in a random order, and random document starts
    rng = random.Random(seed)
    cuts = sorted({0, *rng.sample(range(1, LENGTH), 5), LENGTH})
    pieces = list(zip(cuts, cuts[1:]))
    CASES[f"random {seed}"] = (rng.sample(pieces, len(pieces)), sorted({0, *rng.sample(range(1, LENGTH), 6)}), None)


def _random_row(rng: random.Random) -> tuple[list[int], list[int]]:
    """Document starts and prefixes: pairs (70%: three documents of 1 to 7 tokens, the answers' prefix the prompt)
    and plain documents, until the row is full."""
    starts, prefixes = [0], []
    while starts[-1] < LENGTH:
        pair = rng.random() < 0.7
        first = len(prefixes)
        for i, size in enumerate([rng.randint(1, 7) for _ in range(3)] if pair else [rng.randint(1, 9)]):
            if starts[-1] < LENGTH:
                prefixes.append(first if i else -1)
                starts.append(min(starts[-1] + size, LENGTH))
    return starts[:-1], prefixes


for seed in range(4):  # random cuts in a random order, rows of random pairs and plain documents
    rng = random.Random(10 + seed)
    cuts = sorted({0, *rng.sample(range(1, LENGTH), 6), LENGTH})
    pieces = list(zip(cuts, cuts[1:]))
    CASES[f"random pairs {seed}"] = (rng.sample(pieces, len(pieces)), *_random_row(rng))


def _plan(pieces, doc_starts, prefixes):  # noqa: ANN001, ANN202
    docs = Documents.of([*doc_starts, LENGTH], prefixes)
    return row_plan(docs, (tuple(pieces),), 0, 4, torch.device("cpu"))


def _documents(doc_starts, prefixes) -> list[tuple[slice | None, slice]]:  # noqa: ANN001
    """Each document's tokens and its prefix's (None without one)."""
    bounds = [*doc_starts, LENGTH]
    spans = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    return [(spans[p] if p >= 0 else None, span) for p, span in zip(prefixes or [-1] * len(spans), spans)]


def _each_alone(run, t: torch.Tensor, doc_starts, prefixes, dim: int = 1) -> torch.Tensor:  # noqa: ANN001
    """``run`` on each document alone (after its prefix: the prefix's part of the result dropped), concatenated."""
    outs = []
    for prefix, span in _documents(doc_starts, prefixes):
        tokens = t[:, span] if prefix is None else torch.cat([t[:, prefix], t[:, span]], dim=1)
        outs.append(run(tokens)[:, -(span.stop - span.start) :])
    return torch.cat(outs, dim=1)


def _inputs(seed: int, heads_k: int = 2, heads_v: int = 4, dk: int = 8, dv: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, LENGTH, heads_k, dk, generator=gen) for _ in range(2))
    v = torch.randn(2, LENGTH, heads_v, dv, generator=gen)
    g = -F.softplus(torch.randn(2, LENGTH, heads_v, generator=gen))
    beta = torch.rand(2, LENGTH, heads_v, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _reference(q, k, v, g, beta, doc_starts, prefixes):  # noqa: ANN001, ANN202
    """Each document run alone (after its prefix) by transformers' token-by-token recurrence."""
    channels = [t.shape[2] * (t.shape[3] if t.dim() == 4 else 1) for t in (q, k, v, g, beta)]
    packed = torch.cat([t.flatten(2) for t in (q, k, v, g, beta)], dim=-1)

    def run(tokens: torch.Tensor) -> torch.Tensor:
        qs, ks, vs, gs, bs = (
            part.reshape(*tokens.shape[:2], *t.shape[2:])
            for part, t in zip(tokens.split(channels, -1), (q, k, v, g, beta))
        )
        return torch_recurrent_gated_delta_rule(qs, ks, vs, g=gs, beta=bs, use_qk_l2norm_in_kernel=True)[0]

    return _each_alone(run, packed, doc_starts, prefixes)


def _local(t: torch.Tensor, pieces) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([t[:, a:b] for a, b in pieces], dim=1)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pieces_composed_equal_the_unsplit_recurrence(case: str) -> None:
    pieces, doc_starts, prefixes = CASES[case]
    inputs = _inputs(0)
    weight = torch.randn(2, LENGTH, 4, 6, generator=torch.Generator().manual_seed(1))
    plan = _plan(pieces, doc_starts, prefixes)
    out, _ = delta_rule_pieces(*(_local(t, pieces) for t in inputs), plan, lambda t: t[None])
    grads = torch.autograd.grad((out * _local(weight, pieces)).sum(), inputs)
    expected = _reference(*inputs, doc_starts, prefixes)
    expected_grads = torch.autograd.grad((expected * weight).sum(), inputs)
    torch.testing.assert_close(out, _local(expected, pieces), atol=2e-5, rtol=1e-4)
    for name, grad, reference in zip("q k v g beta".split(), grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=5e-5, rtol=1e-4, msg=lambda m, n=name: f"d{n}: {m}")


def test_a_rejected_answer_starts_from_its_prompt_not_from_the_chosen_one() -> None:
    """The plan of a pair whose answers cross pieces: the rejected answer's first segment starts from the state
    leaving the prompt, a node exported by the prompt's piece; the chosen answer continues the prompt."""
    pieces, doc_starts, prefixes = CASES["pairs, zigzag of 2"]
    plan = _plan(pieces, doc_starts, prefixes)
    by_start = {seg.start + p.start - p.at: seg for p in plan.pieces for seg in p.segments}
    # the first pair (prompt [0, 10), chosen [10, 14), rejected [14, 19)): the rejected answer, in piece 1, starts
    # from the state leaving the prompt, which piece 0 exports; the chosen answer continues into piece 1
    assert by_start[14].source == by_start[14].symbol == ("prefix", 0)
    assert by_start[12].source == ("enter", 1) and by_start[10].source == ("segment", 0)
    # the second (prompt [20, 30), chosen [30, 33), rejected [33, 36)): both answers start where the prompt's
    # segment of piece 2 ends, affine in the state entering piece 2
    for start in (30, 33):
        assert by_start[start].source == ("segment", 0) and by_start[start].symbol == ("enter", 2)
    assert [link[2:] for link in plan.links] == [
        (("prefix", 0), None),
        (("enter", 1), None),
        (("enter", 2), None),
        (("enter", 3), ("enter", 2)),
        (("enter", 4), None),  # the last piece's, unused
    ]


def test_composition_is_the_affine_chain() -> None:
    gen = torch.Generator().manual_seed(2)
    maps = [torch.randn(1, 2, 3, 5, generator=gen) for _ in range(3)]
    links = [(("enter", 1), None), (("prefix", 0), ("enter", 1)), (("enter", 2), ("prefix", 0))]
    states = compose(maps, links)
    a = [m[..., :3] for m in maps]
    b = [m[..., 3:] for m in maps]
    torch.testing.assert_close(states["enter", 1], b[0])
    torch.testing.assert_close(states["prefix", 0], a[1] @ b[0] + b[1])
    torch.testing.assert_close(states["enter", 2], a[2] @ (a[1] @ b[0] + b[1]) + b[2])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_convolution_on_pieces_sees_no_other_document(case: str) -> None:
    pieces, doc_starts, prefixes = CASES[case]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, LENGTH, 5, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, requires_grad=True)
    out, _ = causal_conv_pieces(_local(x, pieces), weight, _plan(pieces, doc_starts, prefixes), lambda t: t[None])

    def conv(tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        return F.silu(F.conv1d(tokens.transpose(1, 2), weight[:, None], padding=3, groups=5)[..., :length]).transpose(
            1, 2
        )

    expected = _each_alone(conv, x, doc_starts, prefixes)
    torch.testing.assert_close(out, _local(expected, pieces), atol=1e-6, rtol=1e-5)
    cotangent = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * cotangent).sum(), (x, weight))
    expected_grads = torch.autograd.grad((_local(expected, pieces) * cotangent).sum(), (x, weight))
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5)


def test_the_linear_layer_refuses_a_bad_doc_prefix_in_one_line() -> None:
    """The attention functions' checks, run by the gated delta layer before any exchange."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from lctrain.linear_attention.gated_deltanet import patch_linear_attention

    config = AutoConfig.for_model(
        "qwen3_5_text", hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    module = Qwen3_5GatedDeltaNet(config, 0)
    patch_linear_attention([module], ring_group=None, ulysses_group=None, layout="zigzag")
    bounds = torch.tensor([0, 10, 20, LENGTH])
    with pytest.raises(ValueError, match=r"^doc_prefix\[1\]=2: a document's prefix must be an earlier document") as e:
        module(torch.randn(1, LENGTH, 32), cu_seq_lens_q=bounds, doc_prefix=torch.tensor([-1, 2, -1]))
    assert "\n" not in str(e.value)
