"""The chunked cross-entropy on CUDA in bf16: its matmuls on tensor cores with fp32 outputs, the head's gradient
accumulated in fp32, against the float64 reference on the same (bf16-rounded) inputs. Skipped without CUDA.

Tolerances: the loss within 1e-4 relative (fp32 logits of bf16 inputs: only the summation order differs); the
gradients within 1e-2 relative Frobenius error (the softmax gradient is rounded to bf16 as the matmuls' input); the
head's gradient from 128 chunks within 1e-2 of the one from a single chunk (one bf16 rounding at the end, none
between chunks). No fp32 SIMT GEMM (``*simt*sgemm*``, the kernel that took 23 % of a step before) runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lctrain.data import IGNORE_INDEX
from lctrain.train.loss import chunked_cross_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOKENS, HIDDEN, VOCAB = 4096, 256, 32000


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda").bfloat16()
    weight = (0.05 * torch.randn(VOCAB, HIDDEN, generator=gen, device="cuda")).bfloat16()
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen, device="cuda")
    labels[::11] = IGNORE_INDEX
    return hidden, weight, labels


def run(chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight, labels = inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    loss, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_bf16_loss_matches_the_float64_reference() -> None:
    loss, grad_hidden, grad_weight = run(256)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    hidden, weight, labels = inputs()
    hidden, weight = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-4 * abs(expected.item())
    assert relative_error(grad_hidden, hidden.grad) <= 1e-2
    assert relative_error(grad_weight, weight.grad) <= 1e-2


def test_head_gradient_is_not_rounded_between_chunks() -> None:
    _, _, one_chunk = run(TOKENS)
    _, _, many_chunks = run(TOKENS // 128)
    assert relative_error(many_chunks, one_chunk) <= 1e-2


def test_no_fp32_simt_gemm() -> None:
    run(1024)  # warm-up: cuBLAS handles and heuristics
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(1024)
        torch.cuda.synchronize()
    kernels = [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels, "the profiler saw no CUDA kernel"
    slow = [name for name in kernels if "simt" in name.lower() or "sgemm" in name.lower()]
    assert not slow, f"fp32 GEMMs in the bf16 loss: {sorted(set(slow))}"
