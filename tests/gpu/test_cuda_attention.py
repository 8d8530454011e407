"""The CUDA kernels and the attention functions on one GPU, against float64 math attention. Skipped without CUDA.

Multi-rank runs need one GPU per rank (NCCL refuses two ranks on one device); the distributed algorithms are
covered on CPU by tests/distributed, and these tests cover the CUDA kernels they call: every kernel that can run
on this machine (cuDNN and PyTorch's flash kernels always; flash-attn 2 and 3 when installed) on GQA, causal
diagonal blocks, off-diagonal rectangles, banded blocks, document groups (varlen), the lse and the backward from
the final (out, lse).

    python -m pytest tests/gpu/test_cuda_attention.py -v
"""

import pytest
import torch

from lctrain.attention import ring_attention, ulysses_attention, usp_attention
from lctrain.attention.kernels import KERNELS, KernelCase, reference_attention, resolve, resolve_kernel
from lctrain.attention.kernels.abilities import BANDED, DOCUMENTS, PLAIN
from lctrain.attention.kernels.reference import REFERENCE
from lctrain.attention.kernels.resolver import detect_platform
from lctrain.attention.kernels.varlen import segment_offsets

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


def runnable(need: str) -> list:
    """The kernels that can do ``need`` blocks (bf16, head_dim 64, GQA) on this machine."""
    if not torch.cuda.is_available():
        return []
    platform, case = detect_platform(CUDA), KernelCase(torch.bfloat16, 64, 8, 2)
    return [k for k in KERNELS.values() if k.abilities.cannot(platform, case, need) is None]


def cuda_kernels() -> list:
    return runnable(PLAIN)


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
    torch.testing.assert_close(lse.double(), reference_lse(q, k, causal), atol=1e-3, rtol=1e-3)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE)
    for grad, reference in zip(grads, (q64.grad, k64.grad, v64.grad)):
        assert grad.shape == reference.shape
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


def reference_lse(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    groups = q.shape[2] // k.shape[2]
    scores = q.double().transpose(1, 2) @ k.double().transpose(1, 2).repeat_interleave(groups, 1).transpose(-1, -2)
    scores = scores * SCALE
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores.logsumexp(-1)


def test_resolver_on_cuda() -> None:
    """On an sm80+ GPU with cuDNN 9, auto runs cuDNN on plain blocks and a flash kernel on windows and documents."""
    resolution = resolve(CUDA, KernelCase(torch.bfloat16, 128, 32, 8))
    print("\nattention kernel:", resolution.describe())
    assert resolution.plain.name == "cudnn"
    assert resolution.banded.name in ("flash_attn3", "flash_attn", "torch_cuda_flash")
    assert resolution.documents is not None
    assert resolve_kernel(CUDA, torch.float32) is REFERENCE


GROUPS = [  # (segments, causal, window_left)
    (((100, 100), (37, 37), (1, 1), (250, 250)), True, None),
    (((100, 100), (37, 37), (1, 1), (250, 250)), True, 99),  # the band cuts the 250-token document only
    (((64, 128), (80, 8)), False, None),
]


@pytest.mark.parametrize("kernel", runnable(DOCUMENTS), ids=lambda k: k.name)
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"{len(g[0])}docs-causal{g[1]}-band{g[2]}")
@pytest.mark.parametrize("batch", [1, 2])
def test_varlen_kernel_equals_one_call_per_document(kernel, group: tuple, batch: int) -> None:  # noqa: ANN001
    """A document group in one varlen call (flash-attn's varlen interface) against float64 math per document."""
    segments, causal, window_left = group
    q_len, k_len = sum(s[0] for s in segments), sum(s[1] for s in segments)
    q, k, v, dout = make((q_len, k_len, 8, 2, 64, causal), torch.bfloat16)
    q, k, v, dout = (t[:batch] for t in (q, k, v, dout))
    options = dict(causal=causal, scale=SCALE, window_left=window_left)
    out, lse = kernel.varlen_forward(q, k, v, segments, **options)
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, segments, **options)
    assert out.shape == q.shape and lse.shape == (batch, 8, q_len) and lse.dtype == torch.float32
    rows, cols = segment_offsets(s[0] for s in segments), segment_offsets(s[1] for s in segments)
    expected_grads = [torch.zeros(t.shape, dtype=torch.float64, device=CUDA) for t in (q, k, v)]
    for i in range(len(segments)):
        r, c = slice(rows[i], rows[i + 1]), slice(cols[i], cols[i + 1])
        band = window_left if window_left is not None and segments[i][0] - 1 > window_left else None
        o, m = REFERENCE.forward(
            *(t.double() for t in (q[:, r], k[:, c], v[:, c])), causal=causal, scale=SCALE, window_left=band
        )
        torch.testing.assert_close(out[:, r].double(), o, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[:, :, r].double(), m, atol=1e-3, rtol=1e-3)
        g = REFERENCE.backward(
            *(t.double() for t in (dout[:, r], q[:, r], k[:, c], v[:, c])),
            o,
            m,
            causal=causal,
            scale=SCALE,
            window_left=band,
        )
        for acc, grad, index in zip(expected_grads, g, (r, c, c)):
            acc[:, index] += grad
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kernel", ["auto", *(k.name for k in cuda_kernels())])
def test_ring_of_one_with_documents_and_window_equals_reference(kernel: str) -> None:
    """ring_attention with each kernel choice on a packed row (documents, a window): plain, banded and document
    groups each go to the kernel the resolver picks, and the result matches float64 math per document."""
    from tests.helpers.reference import reference_grads

    bounds, window = [0, 1, 100, 137, 400, 512], 64
    q, k, v, dout = make((512, 512, 8, 2, 64, True), torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *leaves, cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=CUDA), window=window, kernel=kernel
    )
    out.backward(dout)
    expected = reference_grads(q, k, v, dout, causal=True, bounds=bounds, window=window)
    torch.testing.assert_close(out.double(), expected[0], atol=2e-2, rtol=2e-2)
    for grad, reference in zip((t.grad for t in leaves), expected[1:]):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("kernel", ["auto", *(k.name for k in cuda_kernels())])
def test_ring_of_one_with_shared_prompts_equals_reference(kernel: str, window: int | None) -> None:
    """ring_attention with each kernel choice on a row of two preference pairs [prompt | chosen | rejected] and a
    plain document: the answers' rectangles against their prompt (banded by the window, counted in positions) go
    to the kernels like any block, and the result matches float64 math with the mask written out."""
    from tests.helpers.reference import masked_reference_grads, visible_mask

    bounds, doc_prefix = [0, 200, 240, 300, 301, 400, 450, 512], [-1, 0, 0, -1, -1, 4, 4]
    q, k, v, dout = make((512, 512, 8, 2, 64, True), torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    documents = dict(
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=CUDA), doc_prefix=torch.tensor(doc_prefix)
    )
    out = ring_attention(*leaves, window=window, kernel=kernel, **documents)
    out.backward(dout)
    mask = visible_mask(512, causal=True, bounds=bounds, doc_prefix=doc_prefix, window=window).to(CUDA)
    expected = masked_reference_grads(q, k, v, dout, mask)
    torch.testing.assert_close(out.double(), expected[0], atol=2e-2, rtol=2e-2)
    for grad, reference in zip((t.grad for t in leaves), expected[1:]):
        torch.testing.assert_close(grad.double(), reference, atol=5e-2, rtol=5e-2)


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


@pytest.mark.parametrize("kernel", runnable(BANDED), ids=lambda k: k.name)
@pytest.mark.parametrize("band", BANDS, ids=str)
def test_cuda_kernel_applies_the_window_band(kernel, band: tuple) -> None:  # noqa: ANN001
    """flash-attn's window_size (flash-attn 2 and 3, PyTorch's flash kernels) and the reference's row tiles."""
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
