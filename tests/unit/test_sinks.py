"""Attention sinks (gpt-oss) on one process: the sink folded into the merged (out, lse) once equals a softmax with
the sink as an extra column, outputs and gradients (the sinks' included), for random inputs and masks.
Tolerances (fp32 against float64): outputs 1e-5, gradients 3e-5 absolute; bf16: 3e-2 absolute + 3e-2 relative."""

import random

import pytest
import torch

from lctrain.attention import usp_attention
from lctrain.attention.merge import fold_sink, merge_block, sink_grad
from tests.helpers.reference import random_pairs, sink_reference_grads, visible_mask

SEQ = 24
MASKS = {  # name: (causal, bounds, doc_prefix, window)
    "causal": (True, None, None, None),
    "full": (False, None, None, None),
    "documents": (True, [0, 1, 7, 16, SEQ], None, None),
    "window": (True, None, None, 5),
    "documents_window": (True, [0, 3, 13, SEQ], None, 4),
    "pairs": (True, *random_pairs(SEQ, random.Random(3)), None),
}


def _inputs(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(2, SEQ, h, 80, generator=gen).to(dtype) for h in (8, 2, 2, 8)]
    return [*tensors, (2 * torch.randn(8, generator=gen)).to(dtype)]  # sinks on the scale of the scores


@pytest.mark.parametrize("kernel", ["auto", "reference"])
@pytest.mark.parametrize("mask", MASKS)
def test_sink_fold_equals_softmax_with_the_sink_column(mask: str, kernel: str) -> None:
    causal, bounds, doc_prefix, window = MASKS[mask]
    q, k, v, dout, sinks = _inputs(len(mask))
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out = usp_attention(
        q,
        k,
        v,
        causal=causal,
        layout="contiguous",
        scale=0.07,
        cu_seqlens=None if bounds is None else torch.tensor(bounds),
        doc_prefix=None if doc_prefix is None else torch.tensor(doc_prefix),
        window=window,
        kernel=kernel,
        sinks=sinks,
    )
    out.backward(dout)
    visible = visible_mask(SEQ, causal=causal, bounds=bounds, doc_prefix=doc_prefix, window=window)
    expected = sink_reference_grads(q, k, v, dout, sinks, visible, scale=0.07)
    tolerances = [dict(atol=1e-5, rtol=0)] + [dict(atol=3e-5, rtol=0)] * 4
    for name, actual, reference, tol in zip(
        ("out", "dq", "dk", "dv", "dsinks"), (out, q.grad, k.grad, v.grad, sinks.grad), expected, tolerances
    ):
        torch.testing.assert_close(actual.double(), reference, **tol, msg=lambda m, n=name: f"{mask} {n}: {m}")


def test_bf16_sinks_keep_their_dtype_and_match() -> None:
    q, k, v, dout, sinks = _inputs(5, torch.bfloat16)
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    out = usp_attention(q, k, v, sinks=sinks)
    out.backward(dout)
    expected = sink_reference_grads(q, k, v, dout, sinks, visible_mask(SEQ, causal=True))
    assert out.dtype == sinks.grad.dtype == torch.bfloat16
    for actual, reference in zip((out, q.grad, k.grad, v.grad, sinks.grad), expected):
        torch.testing.assert_close(actual.double(), reference, atol=3e-2, rtol=3e-2)


def test_the_sink_enters_once_after_blocks_merged_in_any_order() -> None:
    """Two halves of the keys merged (either order), then the sink folded, equal the softmax over all of them
    with the sink; sink_grad equals autograd's through fold_sink."""
    gen = torch.Generator().manual_seed(7)
    scores = torch.randn(1, 3, 4, 10, generator=gen, dtype=torch.float64)  # [B, H, S, keys]
    values = torch.randn(1, 3, 10, 5, generator=gen, dtype=torch.float64)
    sink = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)

    def block(cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(scores[..., cols], -1)
        out = torch.softmax(scores[..., cols], -1) @ values[:, :, cols]  # [B, H, S, D]
        return out.transpose(1, 2), lse

    column = sink.view(1, 3, 1, 1).expand(1, 3, 4, 1)
    expected = (torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ values).transpose(1, 2)
    for first, second in ((slice(0, 6), slice(6, 10)), (slice(6, 10), slice(0, 6))):
        out, lse = (t.clone() for t in block(first))
        merge_block(out, lse, *block(second))
        folded, lse_folded = fold_sink(out, lse, sink)
        torch.testing.assert_close(folded, expected.detach(), atol=1e-12, rtol=0)
        torch.testing.assert_close(lse_folded, torch.logaddexp(torch.logsumexp(scores, -1), sink.view(1, 3, 1)))
    dout = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
    (autograd,) = torch.autograd.grad(expected, sink, dout)
    torch.testing.assert_close(sink_grad(dout, folded.detach(), lse_folded.detach(), sink.detach()), autograd)


@pytest.mark.parametrize("sinks", [torch.zeros(4), torch.zeros(8, dtype=torch.int64)], ids=["heads", "dtype"])
def test_bad_sinks_are_refused(sinks: torch.Tensor) -> None:
    q, k, v, _, _ = _inputs(0)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[query heads\] = \[8\]"):
        usp_attention(q, k, v, sinks=sinks)
