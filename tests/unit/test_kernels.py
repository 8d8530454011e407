"""Every blockwise kernel against float64 math attention: out, lse, and gradients given the final out/lse."""

import pytest
import torch

from lctrain.attention import kernels
from lctrain.attention.kernels import REFERENCE, TORCH_CPU_FLASH, reference_attention, resolve_kernel
from lctrain.attention.merge import merge_block

CPU_KERNELS = [REFERENCE, TORCH_CPU_FLASH]
SCALE = 0.1


def make(q_len: int, k_len: int, q_heads: int, kv_heads: int, dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(q_len * 100 + k_len * 10 + kv_heads)
    return [
        torch.randn(2, n, h, dim, generator=gen).to(dtype)
        for n, h in ((q_len, q_heads), (k_len, kv_heads), (k_len, kv_heads), (q_len, q_heads))
    ]


def reference_lse(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[2] // k.shape[2]
    scores = q.double().transpose(1, 2) @ k.double().transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores * SCALE
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return scores.logsumexp(-1)


SHAPES = [  # (q_len, k_len, q_heads, kv_heads, head_dim, causal); causal blocks are square
    (16, 16, 4, 4, 64, True),
    (16, 16, 8, 2, 80, True),
    (16, 24, 8, 2, 80, False),
    (24, 8, 6, 1, 32, False),
]


@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-6)], ids=["fp64", "fp32"])
def test_kernel_matches_reference(kernel, shape, dtype, atol) -> None:  # noqa: ANN001
    q_len, k_len, hq, hkv, dim, causal = shape
    q, k, v, dout = make(q_len, k_len, hq, hkv, dim, dtype)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, hq, q_len)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, causal=causal, scale=SCALE)
    expected.backward(dout.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal), atol=atol, rtol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert grad.shape == reference.shape and grad.dtype == dtype  # fp32/fp64: no upcast
        torch.testing.assert_close(grad.double(), reference, atol=5 * atol, rtol=0)


def test_fused_cpu_kernel_matches_reference_kernel_in_bf16() -> None:
    q, k, v, dout = make(32, 32, 8, 2, 80, torch.bfloat16)
    fused = TORCH_CPU_FLASH.forward(q, k, v, causal=True, scale=SCALE)
    plain = REFERENCE.forward(q, k, v, causal=True, scale=SCALE)
    torch.testing.assert_close(fused[0], plain[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[1], plain[1], atol=1e-3, rtol=1e-3)


def test_merging_key_blocks_equals_attention_over_all_keys() -> None:
    """Two kernel calls on halves of the keys, merged online, give attention over all keys (and its lse)."""
    q, k, v, _ = make(16, 32, 4, 4, 64, torch.float32)
    whole_out, whole_lse = TORCH_CPU_FLASH.forward(q, k, v, causal=False, scale=SCALE)
    out, lse = TORCH_CPU_FLASH.forward(q, k[:, :16], v[:, :16], causal=False, scale=SCALE)
    out, lse = out.float().clone(), lse.clone()
    merge_block(out, lse, *TORCH_CPU_FLASH.forward(q, k[:, 16:], v[:, 16:], causal=False, scale=SCALE))
    torch.testing.assert_close(out, whole_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, whole_lse, atol=1e-6, rtol=0)


def test_merge_ignores_rows_that_saw_no_key() -> None:
    out = torch.zeros(1, 2, 1, 4)
    lse = torch.full((1, 1, 2), float("-inf"))
    block_out = torch.ones(1, 2, 1, 4)
    block_lse = torch.tensor([[[float("-inf"), 0.5]]])  # row 0 sees nothing in this block either
    merge_block(out, lse, block_out, block_lse)
    assert not out.isnan().any() and not lse.isnan().any()
    assert lse[0, 0, 0] == float("-inf") and lse[0, 0, 1] == 0.5
    torch.testing.assert_close(out[0, 1], torch.ones(1, 4))
    torch.testing.assert_close(out[0, 0], torch.zeros(1, 4))


def test_resolver_on_cpu() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        assert resolve_kernel(torch.device("cpu"), dtype) is TORCH_CPU_FLASH


BANDS = [  # (q_len, k_len, q_heads, kv_heads, head_dim, causal, window_left): every row sees a key
    (16, 16, 4, 4, 64, True, 3),  # a diagonal block cut by a window of 4
    (16, 16, 8, 2, 80, True, 0),  # window 1: each query sees itself only
    (12, 20, 8, 2, 80, False, 2),  # earlier keys, the window's edge crossing the block
    (20, 6, 6, 1, 32, False, 15),  # taller than wide
]


def band_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_left: int) -> list:
    """out, lse of float64 math attention where row a sees columns b with a - window_left <= b (<= a if causal);
    q, k, v come back as float64 leaves for the gradients."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    rows, cols = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    visible = (cols >= rows - window_left) & ((cols <= rows) if causal else True)
    groups = q.shape[2] // k.shape[2]
    scores = q64.transpose(1, 2) @ k64.transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2) * SCALE
    scores = scores.masked_fill(~visible, float("-inf"))
    out = (scores.softmax(-1) @ v64.transpose(1, 2).repeat_interleave(groups, 1)).transpose(1, 2)
    return [out, scores.logsumexp(-1).detach(), q64, k64, v64]


@pytest.mark.parametrize("tile_rows", [4, 256], ids=["tiles_of_4", "one_tile"])
@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-6)], ids=["fp64", "fp32"])
def test_kernel_applies_the_window_band(kernel, band, tile_rows: int, dtype, atol, monkeypatch) -> None:  # noqa: ANN001
    """Banded blocks (kernels without a window split them in row tiles) against float64 masked math."""
    monkeypatch.setattr(kernels, "BAND_TILE_ROWS", tile_rows)
    q_len, k_len, hq, hkv, dim, causal, window_left = band
    q, k, v, dout = make(q_len, k_len, hq, hkv, dim, dtype)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE, window_left=window_left)
    expected, expected_lse, q64, k64, v64 = band_reference(q, k, v, causal, window_left)
    expected.backward(dout.double())
    torch.testing.assert_close(out.double(), expected.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=atol, rtol=0)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, window_left=window_left)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert grad.shape == reference.shape
        torch.testing.assert_close(grad.double(), reference, atol=5 * atol, rtol=0)


def test_band_tiles_cover_only_the_keys_their_rows_see(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(kernels, "BAND_TILE_ROWS", 4)
    tiles = kernels.band_tiles(10, 10, causal=True, window_left=2)
    assert tiles == [(slice(0, 4), slice(0, 4)), (slice(4, 8), slice(2, 8)), (slice(8, 10), slice(6, 10))]
    assert kernels.band_tiles(6, 9, causal=False, window_left=5)[1] == (slice(4, 6), slice(0, 9))
