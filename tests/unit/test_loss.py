"""The chunked cross-entropy equals cross-entropy on the full logits, in value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from lctrain.data import IGNORE_INDEX
from lctrain.train.loss import chunked_cross_entropy


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 10_000])
def test_matches_full_logits(chunk_tokens: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 40), generator=gen)
    labels[0, 5] = labels[1, :3] = IGNORE_INDEX
    loss, count = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)
    loss.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    expected = F.cross_entropy((hidden @ weight.t()).reshape(-1, 50), labels.reshape(-1), reduction="sum")
    expected.backward()
    assert count.item() == 76
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0)  # logits are computed in fp32
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-6)


def test_zero_chunk_size_and_mismatched_token_dims_are_refused() -> None:
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="disagree on the token dims"):
        chunked_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(5, dtype=torch.long))


def test_backward_scales_the_stored_gradients_and_no_grad_computes_none() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    labels = torch.randint(0, 20, (30,), generator=gen)
    loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    (loss * 3.0).backward()
    expected = 3.0 * F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(hidden.grad, grads[0])
    torch.testing.assert_close(weight.grad, grads[1])
    with torch.no_grad():
        value, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    torch.testing.assert_close(value, loss.detach())
    assert not value.requires_grad


def test_bf16_inputs_give_an_fp32_loss_and_bf16_gradients() -> None:
    """The logits are the bf16 matmul's (rounded to bf16, as the LM head computes them), then reduced in fp32."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 16, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(40, 16, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 40, (64,), generator=gen)
    loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    h, w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    expected = F.cross_entropy(h @ w.t(), labels, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=0)
    for got, want in ((hidden.grad, h.grad), (weight.grad, w.grad)):
        assert (got.float() - want).norm() <= 1e-2 * want.norm()  # bf16 rounding of logits and gradients


def test_tensor_core_path_accumulates_the_head_gradient_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 path that CUDA takes (fp32-output matmuls, the head's gradient added into an fp32 accumulator), run on
    CPU with the two CUDA-only matmuls emulated in fp32 (exact products of the bf16 inputs). Many chunks give the
    gradient of one chunk up to fp32 summation order: nothing is rounded to bf16 between chunks. Against the fp32
    reference the errors are those of rounding the softmax gradient to bf16 (``tests/gpu/test_cuda_loss.py`` runs
    the real kernels)."""
    from lctrain.train import loss as loss_module

    monkeypatch.setattr(loss_module, "_tensor_cores", lambda hidden, weight: True)
    monkeypatch.setattr(loss_module, "_mm_fp32", lambda a, b: a.float() @ b.float())
    monkeypatch.setattr(loss_module, "_addmm_fp32_", lambda acc, a, b: acc.addmm_(a.float(), b.float()))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(512, 32, generator=gen).bfloat16()
    weight = (0.3 * torch.randn(300, 32, generator=gen)).bfloat16()
    labels = torch.randint(0, 300, (512,), generator=gen)
    labels[::7] = IGNORE_INDEX

    def run(chunk_tokens: int) -> tuple[torch.Tensor, ...]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = chunked_cross_entropy(h, w, labels, chunk_tokens=chunk_tokens)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    one_chunk, many_chunks = run(512), run(8)
    assert many_chunks[2].dtype == torch.bfloat16 and many_chunks[0].dtype == torch.float32
    torch.testing.assert_close(many_chunks[0], one_chunk[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(many_chunks[1], one_chunk[1], rtol=0, atol=0)  # per-token rows: the same products
    torch.testing.assert_close(many_chunks[2], one_chunk[2], rtol=8e-3, atol=0)  # one bf16 rounding, at the end
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    expected = F.cross_entropy(h @ w.t(), labels, reduction="sum")
    expected.backward()
    torch.testing.assert_close(many_chunks[0], expected, rtol=1e-6, atol=0)  # fp32 logits: no bf16 rounding
    for got, want in ((many_chunks[1], h.grad), (many_chunks[2], w.grad)):
        assert (got.float() - want).norm() <= 5e-3 * want.norm()
