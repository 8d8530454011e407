"""Every blockwise kernel against float64 math attention: out, lse, and gradients given the final out/lse."""

from dataclasses import replace

import pytest
import torch

from lctrain.attention import kernels
from lctrain.attention.kernels import bands, reference_attention, resolve_kernel, torch_cpu
from lctrain.attention.kernels.base import visible_keys
from lctrain.attention.kernels.cudnn import CUDNN
from lctrain.attention.kernels.flash import varlen_window
from lctrain.attention.kernels.reference import REFERENCE
from lctrain.attention.kernels.torch_cpu import TORCH_CPU_FLASH
from lctrain.attention.kernels.torch_cuda import TORCH_CUDA_FLASH
from lctrain.attention.kernels.varlen import looped_varlen, segment_offsets
from lctrain.attention.merge import merge_block
from tests.helpers import fake_attention_ops

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


@pytest.fixture
def fresh_cpu_dtypes():  # noqa: ANN201
    """The CPU's bf16 compute dtypes chosen anew (they are chosen once per process) before and after a test."""
    torch_cpu.cpu_bf16_dtypes.cache_clear()
    yield
    torch_cpu.cpu_bf16_dtypes.cache_clear()


@pytest.mark.parametrize(
    "capability,avx512_bf16,amx,expected,reason",
    [
        ("AVX512", True, False, (torch.float32, torch.bfloat16), "this CPU has AVX-512 BF16"),
        ("AVX512", False, True, (torch.float32, torch.bfloat16), "this CPU has AMX"),
        ("AVX512", False, False, (torch.float32, torch.float32), "this CPU has neither AVX-512 BF16 nor AMX"),
        ("AVX2", True, False, (torch.float32, torch.float32), "PyTorch's CPU kernels run at AVX2 here"),
    ],
)
def test_cpu_bf16_compute_dtypes_follow_the_capability(
    monkeypatch: pytest.MonkeyPatch,
    fresh_cpu_dtypes: None,
    capability: str,
    avx512_bf16: bool,
    amx: bool,
    expected: tuple[torch.dtype, torch.dtype],
    reason: str,
) -> None:
    """On x86 the flags, and the level PyTorch's kernels run at, decide; nothing is measured. The kernel computes
    each pass in the chosen dtype, stays exact to bf16 precision, and the job's kernel line says what was chosen
    and why."""
    monkeypatch.setattr(torch_cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch_cpu, "_pass_seconds", lambda dtype: pytest.fail("measured although flags decide"))
    assert kernels.cpu_bf16_dtypes() == kernels.PassDtypes(*expected, reason)
    assert TORCH_CPU_FLASH.backward_dtype(torch.bfloat16) == expected[1]
    assert TORCH_CPU_FLASH.backward_dtype(torch.float16) == torch.float32  # fp16: always fp32
    computed = []
    operands = torch_cpu._cpu_operands

    def recording(*tensors: torch.Tensor, pass_name: str) -> tuple[torch.Tensor, ...]:
        result = operands(*tensors, pass_name=pass_name)
        computed.append((pass_name, result[0].dtype))
        return result

    monkeypatch.setattr(torch_cpu, "_cpu_operands", recording)
    q, k, v, dout = make(32, 32, 8, 2, 80, torch.bfloat16)
    out, lse = TORCH_CPU_FLASH.forward(q, k, v, causal=True, scale=SCALE)
    grads = TORCH_CPU_FLASH.backward(dout, q, k, v, out.bfloat16(), lse, causal=True, scale=SCALE)
    assert computed == [("forward", expected[0]), ("backward", expected[1])]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    expected_out = reference_attention(q64, k64, v64, causal=True, scale=SCALE)
    expected_out.backward(dout.double())
    torch.testing.assert_close(out.double(), expected_out.detach(), atol=2e-2, rtol=2e-2)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    line = kernels.resolve(torch.device("cpu"), kernels.KernelCase(torch.bfloat16, 64, 8, 8)).describe()
    assert f"; bf16 blocks computed in {names[expected[0]]} forward, {names[expected[1]]} backward ({reason})" in line


@pytest.mark.parametrize(
    "seconds,expected",
    [
        ({torch.float32: (1.0, 2.0), torch.bfloat16: (1.2, 1.5)}, (torch.float32, torch.bfloat16)),
        ({torch.float32: (1.0, 2.0), torch.bfloat16: (0.8, 3.0)}, (torch.bfloat16, torch.float32)),
    ],
)
def test_cpu_bf16_compute_dtypes_are_measured_where_flags_say_nothing(
    monkeypatch,
    fresh_cpu_dtypes,
    seconds,
    expected,  # noqa: ANN001
) -> None:
    """On another architecture each pass takes the dtype that ran it faster, measured once per process."""
    measured = []
    monkeypatch.setattr(torch_cpu.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(torch_cpu, "_pass_seconds", lambda dtype: measured.append(dtype) or seconds[dtype])
    chosen = kernels.cpu_bf16_dtypes()
    assert (chosen.forward, chosen.backward) == expected and "measured" in chosen.reason
    kernels.cpu_bf16_dtypes()
    assert sorted(measured, key=str) == [torch.bfloat16, torch.float32]  # once each, not again


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


def test_resolver_picks_the_cpu_flash_kernel_for_every_dtype() -> None:
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
    monkeypatch.setattr(bands, "BAND_TILE_ROWS", tile_rows)  # band_tiles looks it up in kernels.bands
    q_len, k_len, hq, hkv, dim, causal, window_left = band
    assert len(bands.band_tiles(q_len, k_len, causal=causal, window_left=window_left)) == -(-q_len // tile_rows)
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
    monkeypatch.setattr(bands, "BAND_TILE_ROWS", 4)
    tiles = bands.band_tiles(10, 10, causal=True, window_left=2)
    assert tiles == [(slice(0, 4), slice(0, 4)), (slice(4, 8), slice(2, 8)), (slice(8, 10), slice(6, 10))]
    assert bands.band_tiles(6, 9, causal=False, window_left=5)[1] == (slice(4, 6), slice(0, 9))


# ---------------------------------------------------------------------------------------------------------------
# The CUDA kernels' own code (layouts, windows, lse shapes, varlen packing) on CPU, through stand-ins for the CUDA
# ops written from their documented semantics (tests/helpers/fake_attention_ops.py); tests/gpu runs the real ops.
# ---------------------------------------------------------------------------------------------------------------

FAKED_CUDA_KERNELS = [TORCH_CUDA_FLASH, CUDNN]


@pytest.mark.parametrize("kernel", FAKED_CUDA_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_kernel_code_matches_reference_through_fake_ops(kernel, shape) -> None:  # noqa: ANN001
    q_len, k_len, hq, hkv, dim, causal = shape
    q, k, v, dout = make(q_len, k_len, hq, hkv, dim, torch.float64)
    with fake_attention_ops.patched() as calls:
        out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE)
        grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE)
    assert sum(calls.values()) == 2  # one forward, one backward op: GQA without repeating K/V
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    expected = reference_attention(q64, k64, v64, causal=causal, scale=SCALE)
    expected.backward(dout)
    assert out.shape == q.shape and lse.shape == (2, hq, q_len)
    torch.testing.assert_close(out, expected.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal), atol=1e-5, rtol=0)  # fp32 lse
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_torch_cuda_flash_window_through_fake_ops(band) -> None:  # noqa: ANN001
    """Our top-left band as flash-attn's bottom-right window_size, forward and backward."""
    q_len, k_len, hq, hkv, dim, causal, window_left = band
    q, k, v, dout = make(q_len, k_len, hq, hkv, dim, torch.float64)
    with fake_attention_ops.patched():
        out, lse = TORCH_CUDA_FLASH.forward(q, k, v, causal=causal, scale=SCALE, window_left=window_left)
        grads = TORCH_CUDA_FLASH.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, window_left=window_left)
    expected, expected_lse, q64, k64, v64 = band_reference(q, k, v, causal, window_left)
    expected.backward(dout)
    torch.testing.assert_close(out, expected.detach(), atol=1e-10, rtol=0)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=0)


GROUPS = [  # (segments, causal, window_left): one varlen call; every segment is its own block
    (((3, 3), (5, 5), (1, 1), (7, 7)), True, None),
    (((3, 3), (5, 5), (1, 1), (7, 7)), True, 4),  # a band of 4 cuts the 7-row document only
    (((3, 5), (4, 2), (2, 2)), False, None),
]


@pytest.mark.parametrize("kernel", [TORCH_CUDA_FLASH, looped_varlen(REFERENCE)], ids=lambda k: k.name)
@pytest.mark.parametrize("group", GROUPS, ids=str)
def test_varlen_group_equals_one_call_per_rectangle(kernel, group) -> None:  # noqa: ANN001
    segments, causal, window_left = group
    q_len, k_len = sum(s[0] for s in segments), sum(s[1] for s in segments)
    q, k, v, dout = make(q_len, k_len, 8, 2, 16, torch.float64)
    options = dict(causal=causal, scale=SCALE, window_left=window_left)
    with fake_attention_ops.patched() as calls:
        out, lse = kernel.varlen_forward(q, k, v, segments, **options)
        grads = kernel.varlen_backward(dout, q, k, v, out, lse, segments, **options)
    if kernel is TORCH_CUDA_FLASH:
        assert calls == {"_flash_attention_forward": 1, "_flash_attention_backward": 1}
    rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
    expected_grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i in range(len(segments)):
        r, c = slice(rows[i], rows[i + 1]), slice(cols[i], cols[i + 1])
        band = window_left if window_left is not None and segments[i][0] - 1 > window_left else None
        o, m = REFERENCE.forward(q[:, r], k[:, c], v[:, c], causal=causal, scale=SCALE, window_left=band)
        torch.testing.assert_close(out[:, r], o, atol=1e-10, rtol=0)
        torch.testing.assert_close(lse[:, :, r].double(), m, atol=1e-5, rtol=0)
        g = REFERENCE.backward(
            dout[:, r], q[:, r], k[:, c], v[:, c], o, m, causal=causal, scale=SCALE, window_left=band
        )
        for acc, grad, index in zip(expected_grads, g, (r, c, c)):
            acc[:, index] += grad
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "bounds,window,expected_calls",
    [
        (None, None, {"_scaled_dot_product_cudnn_attention": 1, "_scaled_dot_product_cudnn_attention_backward": 1}),
        ([0, 3, 4, 17, 30, 41, 48], None, {"_flash_attention_forward": 1, "_flash_attention_backward": 1}),
        ([0, 3, 4, 17, 30, 41, 48], 6, {"_flash_attention_forward": 1, "_flash_attention_backward": 1}),
        (None, 6, {"_flash_attention_forward": 1, "_flash_attention_backward": 1}),
    ],
    ids=["one_document", "documents", "documents_window", "window"],
)
def test_ring_of_one_with_the_h200_kernels_equals_reference(bounds, window, expected_calls, monkeypatch) -> None:  # noqa: ANN001
    """ring_attention on one rank with auto's H200 choice, through the fake ops: six documents are one varlen call
    per pass (not six), with and without a window; exact against float64 attention per document."""
    from lctrain.attention import ring, ring_attention
    from tests.helpers.reference import reference_grads

    monkeypatch.setattr(ring, "resolve_kernel", lambda *args, **kwargs: fake_attention_ops.h200_auto_kernel())
    q, k, v, dout = make(48, 48, 8, 2, 16, torch.float64)
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with fake_attention_ops.patched() as calls:
        out = ring_attention(*leaves, cu_seqlens=cu, window=window)
        out.backward(dout)
    assert dict(calls) == expected_calls
    expected = reference_grads(q, k, v, dout, causal=True, bounds=bounds, window=window)
    for got, reference in zip((out.detach(), *(t.grad for t in leaves)), expected):
        torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def _pairs(blocks, piece_len: int) -> torch.Tensor:  # noqa: ANN001
    """How many times ``blocks`` compute each (query row, key column) pair (segments: each its own block)."""
    count = torch.zeros(piece_len, piece_len, dtype=torch.int64)
    for block in blocks:
        parts = block.segments or ((block.rows.stop - block.rows.start, block.cols.stop - block.cols.start),)
        rows, cols = segment_offsets(p[0] for p in parts), segment_offsets(p[1] for p in parts)
        for i, (q_len, k_len) in enumerate(parts):
            band = block.window_left if block.window_left is not None and q_len - 1 > block.window_left else None
            visible = visible_keys(q_len, k_len, causal=block.causal, window_left=band, device="cpu")
            visible = torch.ones(q_len, k_len, dtype=torch.bool) if visible is None else visible
            r0, c0 = block.rows.start + rows[i], block.cols.start + cols[i]
            count[r0 : r0 + q_len, c0 : c0 + k_len] += visible.long()
    return count


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_group_documents_computes_the_same_pairs_in_fewer_calls(layout: str, window: int | None) -> None:
    """Over random packed rows, every ring step's grouped calls compute exactly the plan's pairs (each once); a
    step's diagonal documents become one call, and every group needs one flash-attn window."""
    import random

    from lctrain.attention.ring_blocks import group_documents, plan_ring

    rng = random.Random(0)
    size, piece = 4, 32
    before = after = 0
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, size * piece), rng.randint(1, 24)))
        bounds = (0, *cuts, size * piece)
        for rank in range(size):
            for step in plan_ring(rank, size, piece, causal=True, layout=layout, cu_seqlens=bounds, window=window):
                grouped = group_documents(step.blocks)
                assert torch.equal(_pairs(grouped, piece), _pairs(step.blocks, piece))
                for block in grouped:
                    if block.segments is not None:
                        varlen_window(block.segments, causal=block.causal, window_left=block.window_left)
                diagonal = [b for b in grouped if b.causal]
                assert len(diagonal) <= (2 if layout == "zigzag" else 1)  # chunks of one rank's piece that meet
                before, after = before + len(step.blocks), after + len(grouped)
    assert after <= before / 2, (before, after)


def test_group_documents_leaves_single_blocks_alone() -> None:
    from lctrain.attention.ring_blocks import Block, group_documents

    square, rectangle = Block(slice(0, 4), slice(0, 4), True), Block(slice(4, 8), slice(0, 4), False)
    assert group_documents([square, rectangle]) == (rectangle, square)
    merged = group_documents([Block(slice(0, 4), slice(0, 4), True), Block(slice(4, 9), slice(4, 9), True, 3)])
    assert merged == (Block(slice(0, 9), slice(0, 9), True, 3, ((4, 4), (5, 5))),)
    # a band that would cut an earlier document (5 rows, band 3) keeps them apart
    apart = group_documents([Block(slice(0, 5), slice(0, 5), True), Block(slice(5, 10), slice(5, 10), True, 3)])
    assert len(apart) == 2


H200 = kernels.Platform("cuda", (9, 0), 91900)  # as seen there: torch 2.11, cuDNN 9.19, no flash-attn
RESOLUTIONS = [  # (platform, dtype, head_dim, choice) -> (plain, banded, documents)
    (H200, torch.bfloat16, 128, "auto", ("cudnn", "torch_cuda_flash", "torch_cuda_flash")),
    (H200, torch.float16, 64, "auto", ("cudnn", "torch_cuda_flash", "torch_cuda_flash")),
    (H200, torch.bfloat16, 256, "auto", ("torch_cuda_flash", "torch_cuda_flash", "torch_cuda_flash")),
    (H200, torch.bfloat16, 72, "auto", ("cudnn", "torch_cuda_flash", "torch_cuda_flash")),
    (H200, torch.bfloat16, 100, "auto", ("reference", "reference", None)),  # not a multiple of 8
    (H200, torch.float32, 128, "auto", ("reference", "reference", None)),
    (H200, torch.bfloat16, 128, "torch_cuda_flash", ("torch_cuda_flash", "torch_cuda_flash", "torch_cuda_flash")),
    (H200, torch.bfloat16, 128, "reference", ("reference", "reference", None)),
    (H200, torch.bfloat16, 256, "cudnn", ("torch_cuda_flash", "torch_cuda_flash", "torch_cuda_flash")),
    (replace(H200, flash_attn_version=(2, 7, 4)), torch.bfloat16, 128, "auto", ("cudnn", "flash_attn", "flash_attn")),
    (
        replace(H200, flash_attn_version=(2, 5, 8)),
        torch.bfloat16,
        128,
        "auto",
        ("cudnn", "flash_attn", "torch_cuda_flash"),
    ),
    (replace(H200, flash_attn3=True), torch.bfloat16, 128, "auto", ("cudnn", "flash_attn3", "flash_attn3")),
    (
        replace(H200, flash_attn3=True),
        torch.bfloat16,
        128,
        "flash_attn3",
        ("flash_attn3", "flash_attn3", "flash_attn3"),
    ),
    (replace(H200, torch_flash_window=False), torch.bfloat16, 128, "auto", ("cudnn", "reference", None)),
    (replace(H200, cudnn_version=8907), torch.bfloat16, 128, "auto", ("torch_cuda_flash",) * 3),
    (kernels.Platform("cpu"), torch.bfloat16, 80, "auto", ("torch_cpu_flash", "torch_cpu_flash", None)),
    (kernels.Platform("cpu"), torch.float64, 80, "reference", ("reference", "reference", None)),
]


@pytest.mark.parametrize("platform,dtype,head_dim,choice,expected", RESOLUTIONS)
def test_resolver_picks_per_device_and_case(platform, dtype, head_dim: int, choice: str, expected) -> None:  # noqa: ANN001
    device = torch.device(platform.device_type)
    resolution = kernels.resolve(device, kernels.KernelCase(dtype, head_dim, 32, 8), choice=choice, platform=platform)
    documents = resolution.documents.name if resolution.documents is not None else None
    assert (resolution.plain.name, resolution.banded.name, documents) == expected
    line = resolution.describe()
    assert f"parallel.attention_kernel={choice}" in line and f"plain blocks {expected[0]}" in line
    kernel = resolution.kernel()
    assert (kernel.varlen_forward is None) == (expected[2] is None)


def test_resolver_says_why_it_passed_a_kernel_over() -> None:
    line = kernels.resolve(
        torch.device("cuda"), kernels.KernelCase(torch.bfloat16, 256, 32, 8), platform=H200
    ).describe()
    assert "plain blocks torch_cuda_flash (not cudnn: head_dim 256 is not a multiple of 8 up to 128)" in line
    line = kernels.resolve(
        torch.device("cuda"), kernels.KernelCase(torch.bfloat16, 128, 32, 8), platform=H200
    ).describe()
    assert "banded blocks torch_cuda_flash (not cudnn: PyTorch's cuDNN op takes no sliding window)" in line
    assert "the first of cudnn > flash_attn3 > flash_attn > torch_cuda_flash > reference" in line


@pytest.mark.parametrize(
    "platform,choice,message",
    [
        (kernels.Platform("cpu"), "cudnn", "cannot run on this cpu device: it needs a CUDA GPU"),
        (H200, "flash_attn", "flash_attn is not installed"),
        (H200, "flash_attn3", "flash_attn_interface (flash-attn 3"),
        (replace(H200, flash_attn3=True, capability=(8, 0)), "flash_attn3", "built for Hopper"),
        (H200, "torch_cpu_flash", "it runs on CPU only"),
        (replace(H200, capability=(7, 5)), "torch_cuda_flash", "compute capability 8.0 or newer"),
        (H200, "flash", "must be one of"),
    ],
)
def test_a_named_kernel_that_cannot_run_is_refused(platform, choice: str, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as error:
        kernels.resolve(
            torch.device(platform.device_type),
            kernels.KernelCase(torch.bfloat16, 128, 8, 8),
            choice=choice,
            platform=platform,
        )
    assert message in str(error.value)


def test_config_refuses_an_unknown_kernel_and_lists_the_choices() -> None:
    from lctrain.attention.kernels import KERNELS
    from lctrain.config.checks import check_job
    from lctrain.config.schema import JobConfig, ParallelConfig
    from lctrain.rules import KERNEL_CHOICES

    assert KERNEL_CHOICES == ("auto", *KERNELS)  # the config's choices name every kernel, in the resolver's order
    with pytest.raises(ValueError) as error:
        ParallelConfig(attention_kernel="flash2")
    assert "parallel.attention_kernel='flash2' must be one of auto, cudnn, flash_attn3, flash_attn" in str(error.value)
    cfg = JobConfig(parallel=ParallelConfig(attention_kernel="cudnn"))  # valid; whether it runs is the device's
    check_job(cfg, 1, num_heads=8, num_kv_heads=4, num_layers=4, tied_embeddings=False, vocab_size=100)


@pytest.mark.parametrize("attend", ["ring_attention", "ulysses_attention", "usp_attention"])
def test_attention_functions_refuse_an_unknown_kernel_as_the_config_does(attend: str) -> None:
    from lctrain import attention

    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match=r"^kernel='flash2' must be one of auto, cudnn, .* \(auto picks per device"):
        getattr(attention, attend)(q, q, q, kernel="flash2")


def test_patch_attention_logs_the_kernel_at_job_start(caplog) -> None:  # noqa: ANN001
    import logging

    from transformers import LlamaConfig, LlamaForCausalLM

    from lctrain.models.patch import patch_attention

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
    )
    cpu = torch.device("cpu")
    with caplog.at_level(logging.INFO, logger="lctrain"):
        patch_attention(LlamaForCausalLM(config), ulysses_group=None, ring_group=None, device=cpu, dtype=torch.float32)
    assert "attention kernel: plain blocks torch_cpu_flash, banded blocks torch_cpu_flash" in caplog.text
    with pytest.raises(ValueError, match="parallel.attention_kernel=cudnn cannot run on this cpu device"):
        patch_attention(
            LlamaForCausalLM(config),
            ulysses_group=None,
            ring_group=None,
            kernel="cudnn",
            device=cpu,
            dtype=torch.float32,
        )
