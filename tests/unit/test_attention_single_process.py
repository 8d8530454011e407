"""The public attention functions with no process group (ring of one, Ulysses of one) and their input checks."""

import pytest
import torch

from lctrain.attention import ring_attention, ulysses_attention, usp_attention
from lctrain.attention.kernels import reference_attention
from tests.helpers.reference import masked_reference_grads, reference_grads, unshared_row, visible_mask


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("causal", [True, False])
def test_one_rank_equals_reference(fn, causal: bool) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 24, h, 80, generator=gen) for h in (8, 2, 2, 8))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal=causal)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, causal=causal)
    expected.backward(dout.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=0)
    for grad, reference in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad.double(), reference, atol=3e-5, rtol=0)


def test_custom_scale_replaces_the_default() -> None:
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    torch.testing.assert_close(
        ring_attention(q, k, v, scale=0.3), reference_attention(q, k, v, scale=0.3), atol=1e-6, rtol=0
    )


def test_output_keeps_input_dtype() -> None:
    q, k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    assert ring_attention(q, k, v).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "shapes,dtypes,message",
    [
        ([(8, 2, 16), (8, 2, 16), (8, 2, 16)], None, r"must be \[batch, seq, heads, head_dim\]"),
        ([(1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 1, 16)], None, "k and v must have the same shape"),
        ([(1, 8, 2, 16), (1, 6, 2, 16), (1, 6, 2, 16)], None, "must agree in batch, local sequence length"),
        ([(1, 8, 3, 16), (1, 8, 2, 16), (1, 8, 2, 16)], None, r"query heads \(3\) must be a multiple"),
        ([(1, 8, 2, 16)] * 3, (torch.float32, torch.bfloat16, torch.float32), "must share one floating dtype"),
    ],
)
def test_bad_shapes_and_dtypes_are_refused_by_every_attention_function(shapes, dtypes, message: str) -> None:  # noqa: ANN001
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.randn(*s).to(d) for s, d in zip(shapes, dtypes))
    for fn in (ring_attention, ulysses_attention, usp_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, k, v)


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_documents_attend_only_inside_their_document(fn, causal: bool) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(2, 40, h, 80, generator=gen) for h in (8, 2, 2, 8))
    bounds = [0, 1, 9, 10, 27, 40]  # includes length-1 documents
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal=causal, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    out.backward(dout)
    expected = reference_grads(q, k, v, dout, causal=causal, bounds=bounds)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=0)
    for grad, reference in zip((q.grad, k.grad, v.grad), expected[1:]):
        torch.testing.assert_close(grad.double(), reference, atol=3e-5, rtol=0)


@pytest.mark.parametrize(
    "cu_seqlens,message",
    [
        (torch.tensor([0, 3, 9]), "cu_seqlens ends at 9 but the sharded sequence has 8 tokens"),
        (torch.tensor([0, 5, 5, 8]), "must start at 0 and strictly increase"),
        (torch.tensor([1, 8]), "must start at 0"),
        (torch.tensor([[0, 8]]), "must be a 1-D integer tensor"),
        (torch.tensor([0.0, 8.0]), "must be a 1-D integer tensor"),
    ],
)
def test_bad_cu_seqlens_are_refused_by_every_attention_function(cu_seqlens: torch.Tensor, message: str) -> None:
    q = torch.randn(1, 8, 2, 16)
    for fn in (ring_attention, ulysses_attention, usp_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, q, q, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("window", [1, 5, 17])
def test_sliding_window_inside_documents(fn, window: int) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(window)
    q, k, v, dout = (torch.randn(2, 40, h, 80, generator=gen) for h in (8, 2, 2, 8))
    bounds = [0, 1, 9, 10, 33, 40]  # a document longer than the window, and shorter ones
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, cu_seqlens=torch.tensor(bounds, dtype=torch.int32), window=window)
    out.backward(dout)
    expected = reference_grads(q, k, v, dout, causal=True, bounds=bounds, window=window)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=0)
    for grad, reference in zip((q.grad, k.grad, v.grad), expected[1:]):
        torch.testing.assert_close(grad.double(), reference, atol=3e-5, rtol=0)


def test_window_of_the_sequence_length_or_more_is_no_window() -> None:
    q, k, v = (torch.randn(1, 12, 2, 16) for _ in range(3))
    plain = ring_attention(q, k, v)
    for window in (12, 13, 1000):
        assert torch.equal(ring_attention(q, k, v, window=window), plain)
    assert not torch.equal(ring_attention(q, k, v, window=11), plain)


def test_window_is_hugging_face_sliding_window() -> None:
    """The keys each query sees equal transformers' sliding_window_causal_mask_function (what its sdpa/eager
    masks use; its flash-attn path passes window_size=(W - 1, W - 1) with causal=True, the same keys)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    seq, window = 12, 4
    positions = torch.arange(seq)
    hf = sliding_window_causal_mask_function(window)(torch.tensor(0), torch.tensor(0), positions[:, None], positions)
    assert hf.sum(dim=1).tolist() == [min(i + 1, window) for i in range(seq)]
    q = k = torch.zeros(1, seq, 1, 4, dtype=torch.float64)  # equal scores: each query averages what it sees
    v = torch.eye(seq, dtype=torch.float64)[None, :, None]  # value j = one-hot j
    seen = reference_attention(q, k, v, window=window)[0, :, 0] > 0
    assert torch.equal(seen, hf)


@pytest.mark.parametrize(
    "window,causal,message",
    [
        (0, True, r"window=0 must be a positive int"),
        (-3, True, r"window=-3 must be a positive int"),
        (2.5, True, r"window=2.5 must be a positive int"),
        (True, True, r"window=True must be a positive int"),
        (4, False, r"window=4 needs causal=True"),
    ],
)
def test_bad_window_is_refused_by_every_attention_function(window, causal: bool, message: str) -> None:  # noqa: ANN001
    q = torch.randn(1, 8, 2, 16)
    for fn in (ring_attention, ulysses_attention, usp_attention, reference_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, q, q, causal=causal, window=window)


# two preference pairs [prompt | chosen | rejected] around a length-1 document: each answer's prefix is its prompt
PAIRS_BOUNDS = [0, 12, 17, 21, 22, 30, 33, 40]
PAIRS_PREFIX = [-1, 0, 0, -1, -1, 4, 4]


def pair_inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 40, h, 80, generator=gen) for h in (8, 2, 2, 8)]


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 1), (True, 4), (True, 14)])
def test_shared_prefix_equals_float64_masked_attention(fn, causal: bool, window: int | None, kernel: str) -> None:  # noqa: ANN001
    """Each answer sees its prompt and itself, never the other answer; a window counts positions, the rejected
    answer's continuing the prompt's. On the CPU's own kernel and on the reference one."""
    q, k, v, dout = pair_inputs(3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    documents = dict(cu_seqlens=torch.tensor(PAIRS_BOUNDS), doc_prefix=torch.tensor(PAIRS_PREFIX))
    out = fn(q, k, v, causal=causal, window=window, kernel=kernel, **documents)
    out.backward(dout)
    mask = visible_mask(40, causal=causal, bounds=PAIRS_BOUNDS, doc_prefix=PAIRS_PREFIX, window=window)
    expected = masked_reference_grads(q, k, v, dout, mask)
    torch.testing.assert_close(out.double(), expected[0], atol=1e-5, rtol=0)
    for grad, reference in zip((q.grad, k.grad, v.grad), expected[1:]):
        torch.testing.assert_close(grad.double(), reference, atol=3e-5, rtol=0)


@pytest.mark.parametrize("window", [None, 3, 9])
def test_shared_prefix_equals_the_prompt_repeated(window: int | None) -> None:
    """The shared row against the same attention on the row with each prompt repeated for each answer (two plain
    documents): the same outputs, and the gradients of each prompt the sum of its two copies'."""
    q, k, v, dout = pair_inputs(4)
    shared = [t.clone().requires_grad_() for t in (q, k, v)]
    documents = dict(cu_seqlens=torch.tensor(PAIRS_BOUNDS), doc_prefix=torch.tensor(PAIRS_PREFIX))
    out = ring_attention(*shared, window=window, **documents)
    out.backward(dout)
    index, plain, first = unshared_row(PAIRS_BOUNDS, PAIRS_PREFIX)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    repeated = ring_attention(*(t[:, index] for t in leaves), window=window, cu_seqlens=torch.tensor(plain))
    repeated[:, first].backward(dout)
    torch.testing.assert_close(out, repeated[:, first], atol=1e-5, rtol=0)
    for grad, reference in zip((t.grad for t in shared), (t.grad for t in leaves)):
        torch.testing.assert_close(grad, reference, atol=3e-5, rtol=0)


@pytest.mark.parametrize(
    "doc_prefix,message",
    [
        (torch.tensor([-1, 0]), r"doc_prefix must be a 1-D integer tensor \[num_docs\] \(3 documents"),
        (torch.tensor([-1.0, 0.0, 0.0]), "doc_prefix must be a 1-D integer tensor"),
        (torch.tensor([-1, 2, 0]), r"doc_prefix\[1\]=2: a document's prefix must be an earlier document"),
        (torch.tensor([-1, 0, 1]), r"doc_prefix\[2\]=1 but document 1 has a prefix itself"),
    ],
)
def test_bad_doc_prefix(doc_prefix: torch.Tensor, message: str) -> None:
    q = torch.randn(1, 8, 2, 16)
    for fn in (ring_attention, ulysses_attention, usp_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, q, q, cu_seqlens=torch.tensor([0, 3, 5, 8]), doc_prefix=doc_prefix)
        with pytest.raises(ValueError, match="doc_prefix needs cu_seqlens"):
            fn(q, q, q, doc_prefix=torch.tensor([-1]))
