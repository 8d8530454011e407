"""The CUDA kernels and the attention functions on one GPU, against float64 math attention. Skipped without CUDA.

Multi-rank runs need one GPU per rank (NCCL refuses two ranks on one device); the distributed algorithms are
covered on CPU by tests/distributed, and these tests cover the CUDA kernels they call.
"""

import pytest
import torch

from lctrain.attention import ring_attention, ulysses_attention, usp_attention
from lctrain.attention.kernels import FLASH_ATTN, REFERENCE, TORCH_CUDA_FLASH, reference_attention, resolve_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
SCALE = 0.1
SHAPES = [  # (q_len, k_len, q_heads, kv_heads, head_dim, causal); causal blocks are square
    (256, 256, 8, 8, 64, True),
    (256, 256, 8, 2, 80, True),
    (128, 384, 8, 2, 128, False),
    (384, 128, 4, 1, 64, False),
]


def make(shape: tuple, dtype: torch.dtype) -> list[torch.Tensor]:
    q_len, k_len, hq, hkv, dim, _ = shape
    gen = torch.Generator(device=CUDA).manual_seed(q_len + k_len + hkv)
    sizes = [(2, q_len, hq, dim), (2, k_len, hkv, dim), (2, k_len, hkv, dim), (2, q_len, hq, dim)]
    return [torch.randn(size, generator=gen, device=CUDA).to(dtype) for size in sizes]


def cuda_kernels() -> list:
    kernels = [TORCH_CUDA_FLASH, REFERENCE]
    try:
        import flash_attn  # noqa: F401

        kernels.append(FLASH_ATTN)
    except ImportError:
        pass
    return kernels


@pytest.mark.parametrize("kernel", cuda_kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_kernel_matches_reference(kernel, shape: tuple, dtype: torch.dtype) -> None:  # noqa: ANN001
    causal = shape[-1]
    q, k, v, dout = make(shape, dtype)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE)
    assert out.shape == q.shape and lse.shape == (2, shape[2], shape[0]) and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, causal=causal, scale=SCALE)
    expected.backward(dout.double())
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), expected.detach(), **tol)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert grad.shape == reference.shape
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


def test_resolver_on_cuda() -> None:
    fused = resolve_kernel(CUDA, torch.bfloat16)
    assert fused.name in ("flash_attn", "torch_cuda_flash")
    assert resolve_kernel(CUDA, torch.float32) is REFERENCE


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
@pytest.mark.parametrize("causal", [True, False])
def test_one_gpu_equals_reference(fn, causal: bool) -> None:  # noqa: ANN001
    q, k, v, dout = make((512, 512, 8, 2, 80, causal), torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal=causal)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, causal=causal)
    expected.backward(dout.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-2, rtol=2e-2)
    for grad, reference in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


BANDS = [  # (q_len, k_len, q_heads, kv_heads, head_dim, causal, window_left): every row sees a key
    (512, 512, 8, 2, 80, True, 99),  # a diagonal block cut by a window of 100 (several row tiles)
    (256, 384, 8, 8, 64, False, 40),  # earlier keys, the window's edge crossing the block
]


@pytest.mark.parametrize("kernel", cuda_kernels(), ids=lambda k: k.name)
@pytest.mark.parametrize("band", BANDS, ids=str)
def test_cuda_kernel_applies_the_window_band(kernel, band: tuple) -> None:  # noqa: ANN001
    """flash-attn's window_size, the CUDA flash op's fallback (reference math in row tiles) and the reference."""
    q_len, k_len, hq, hkv, dim, causal, window_left = band
    q, k, v, dout = make((q_len, k_len, hq, hkv, dim, causal), torch.bfloat16)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE, window_left=window_left)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    rows, cols = torch.arange(q_len, device=CUDA)[:, None], torch.arange(k_len, device=CUDA)[None, :]
    visible = (cols >= rows - window_left) & ((cols <= rows) if causal else True)
    groups = hq // hkv
    scores = q64.transpose(1, 2) @ k64.transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2) * SCALE
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = (scores.softmax(-1) @ v64.transpose(1, 2).repeat_interleave(groups, 1)).transpose(1, 2)
    expected.backward(dout.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).detach(), atol=2e-2, rtol=2e-2)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, window_left=window_left)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention, usp_attention], ids=lambda f: f.__name__)
def test_one_gpu_sliding_window_equals_reference(fn) -> None:  # noqa: ANN001
    q, k, v, dout = make((512, 512, 8, 2, 80, True), torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, window=100)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, window=100)
    expected.backward(dout.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=2e-2, rtol=2e-2)
    for grad, reference in zip((q.grad, k.grad, v.grad), (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)
