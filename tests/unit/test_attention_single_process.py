"""The public attention functions with no process group (ring of one, Ulysses of one) and their input checks."""

import pytest
import torch

from lctrain.attention import ring_attention, ulysses_attention, usp_attention
from lctrain.attention.kernels import reference_attention


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


def test_custom_scale() -> None:
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
def test_bad_inputs(shapes, dtypes, message: str) -> None:  # noqa: ANN001
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.randn(*s).to(d) for s, d in zip(shapes, dtypes))
    for fn in (ring_attention, ulysses_attention, usp_attention):
        with pytest.raises(ValueError, match=message):
            fn(q, k, v)


def test_document_masking_is_not_there_yet() -> None:
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        ring_attention(q, q, q, cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32))
