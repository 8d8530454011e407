"""A block the sliding window cuts, on PyTorch's CPU flash op: one masked call, or row tiles (the kernel's way)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from benchmarks.report import arguments
from benchmarks.timing import median_seconds
from lctrain.attention.kernels import bands
from lctrain.attention.kernels.bands import band_tiles
from lctrain.attention.kernels.base import visible_keys
from lctrain.attention.kernels.torch_cpu import TORCH_CPU_FLASH, cpu_attend, cpu_attend_backward


def kernel_pass(tensors: list[torch.Tensor], scale: float, window_left: int | None, visible: Any = None) -> None:
    """Forward + backward of ``TORCH_CPU_FLASH`` on a causal block (row tiles when ``window_left`` is set); with the
    band's mask ``visible``, of the CPU op once over the whole block."""
    q, k, v, dout = tensors
    if visible is not None:
        cpu_attend_backward(dout, q, k, v, *cpu_attend(q, k, v, visible, scale), visible, scale)
        return
    out, lse = TORCH_CPU_FLASH.forward(q, k, v, causal=True, scale=scale, window_left=window_left)
    TORCH_CPU_FLASH.backward(dout, q, k, v, out, lse, causal=True, scale=scale, window_left=window_left)


def main() -> None:
    sizes = {"rows": 4096, "windows": [512, 2048], "tiles": [64, 128, 256, 512, 1024], "threads": 1}
    args = arguments(__doc__, heads=8, head_dim=64, iters=3, **sizes).parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, args.rows, args.heads, args.head_dim, generator=gen) for _ in range(4)]
    scale = args.head_dim**-0.5
    print(f"CPU, {args.threads} thread(s), torch {torch.__version__}, fp32, {args.heads} heads x {args.head_dim}, "
          f"diagonal block of {args.rows} queries, forward+backward, median of {args.iters}")  # fmt: skip
    print("| window | way | ms | pairs computed / pairs seen |\n|---|---|---|---|")
    plain = median_seconds(functools.partial(kernel_pass, tensors, scale, None), args.iters)
    for window in args.windows:
        seen = sum(min(window, row + 1) for row in range(args.rows))
        visible = visible_keys(args.rows, args.rows, causal=True, window_left=window - 1, device=torch.device("cpu"))
        ms = median_seconds(functools.partial(kernel_pass, tensors, scale, None, visible), args.iters) * 1e3
        print(f"| {window} | one masked call | {ms:.0f} | {args.rows**2 / seen:.2f} |")
        for tile in args.tiles:
            bands.BAND_TILE_ROWS = tile  # band_tiles reads it from its own module, kernels.bands
            tiles = band_tiles(args.rows, args.rows, causal=True, window_left=window - 1)
            computed = sum((r.stop - r.start) * (c.stop - c.start) for r, c in tiles)
            ms = median_seconds(functools.partial(kernel_pass, tensors, scale, window - 1), args.iters) * 1e3
            print(f"| {window} | row tiles of {tile} | {ms:.0f} | {computed / seen:.2f} |")
        print(f"| {window} | plain causal block (no window) | {plain * 1e3:.0f} | {args.rows**2 / 2 / seen:.2f} |")


if __name__ == "__main__":
    main()
