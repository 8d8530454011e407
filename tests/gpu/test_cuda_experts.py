"""lctrain's experts on CUDA in bf16: the grouped GEMM (``torch._grouped_mm``) that ``expert_kernel`` picks on devices
of capability >= 9.0 against the loop over experts, and both against float64 on the same bf16 inputs. Skipped without
CUDA; the grouped GEMM's cases without a device of capability >= 9.0.

Tolerances: outputs and gradients within 2e-2 relative Frobenius error of float64 (bf16 inputs and outputs, fp32
accumulation).
"""

from __future__ import annotations

import pytest
import torch

from lctrain.parallel.expert import expert_kernel, grouped_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
COUNTS = [96, 32, 64, 0, 128, 64, 80, 48]  # uneven, one expert idle


def hopper() -> bool:
    return torch.cuda.get_device_capability() >= (9, 0)


def run(kernel: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(sum(COUNTS), 256, generator=gen, device="cuda").bfloat16().to(dtype).requires_grad_()
    weight = (0.05 * torch.randn(len(COUNTS), 512, 256, generator=gen, device="cuda")).bfloat16().to(dtype)
    weight.requires_grad_()
    out = grouped_linear(x, weight, COUNTS, kernel)
    grad = torch.randn(out.shape, generator=gen, device="cuda").bfloat16().to(dtype)
    out.backward(grad)
    return out.detach(), x.grad, weight.grad


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm() / expected.norm()).item()


def test_the_kernel_picked_on_cuda() -> None:
    device = torch.device("cuda")
    assert expert_kernel(device, torch.float32) == "loop"
    assert expert_kernel(device, torch.bfloat16) == ("grouped_mm" if hopper() else "loop")


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_kernels_in_bf16_against_float64(kernel: str) -> None:
    if kernel == "grouped_mm" and not hopper():
        pytest.skip("torch._grouped_mm needs capability >= 9.0")
    expected = run("loop", torch.float64)
    for got, reference in zip(run(kernel, torch.bfloat16), expected):
        assert relative_error(got, reference) <= 2e-2
