"""Compute efficiency of the ring decomposition on one device (no communication), and kernel throughput.

    python -m benchmarks.bench_ring_compute                    # CUDA if present, else CPU (smaller sizes)
    python -m benchmarks.bench_ring_compute --seq 131072 --ring 8
    python -m benchmarks.bench_ring_compute --seq 16384 --ring 1 --head-dim 128 --heads 16 --kv-heads 16 \
        --kernels auto,cudnn,torch_cuda_flash,flash_attn,flash_attn3   # the kernel table of docs/benchmarks.md

For each sequence length it times, forward+backward, causal:
- ``sdpa``: PyTorch's fused SDPA on the whole sequence (the single-device baseline);
- ``kernel``: lctrain's resolved blockwise kernel on the whole sequence (one block), for each ``--kernels`` choice
  (``parallel.attention_kernel``; one that cannot run here is skipped with the reason);
- ``rank r``: the blocks ring rank r of a zigzag ring of size R computes (its kernel calls and online-softmax
  merges, forward and backward, exactly as ``ring_attention`` runs them), with the other ranks' K/V taken from
  the full tensors instead of received.
It prints TFLOP/s (causal attention counted as half the dense FLOPs) and the compute efficiency
T(kernel) / (R × max_r T(rank r)): the parallel efficiency the ring would reach if communication were fully
hidden, with the same kernel on both sides (the kernel row shows T(sdpa) / T(kernel) instead).
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from lctrain.attention import shard_sequence
from lctrain.attention.kernels import accumulation_dtype, default_scale, resolve_kernel
from lctrain.attention.merge import merge_block
from lctrain.attention.ring_blocks import plan_ring


def timed(fn, device: torch.device, iters: int) -> float:  # noqa: ANN001
    """Median seconds of ``fn()`` over ``iters`` runs after one warm-up."""
    times = []
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[iters // 2]


def sdpa_fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.transpose(1, 2))


def resolved(q: torch.Tensor, k: torch.Tensor, choice: str):  # noqa: ANN201
    return resolve_kernel(
        q.device, q.dtype, head_dim=q.shape[-1], q_heads=q.shape[2], kv_heads=k.shape[2], choice=choice
    )


def rank_work(  # noqa: ANN201
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, rank: int, ring: int, choice: str = "auto"
):
    """Returns a closure running ring rank ``rank``'s blocks (forward then backward) of a zigzag ring."""
    kernel = resolved(q, k, choice)
    scale = default_scale(q.shape[-1])

    def piece(x: torch.Tensor, r: int) -> torch.Tensor:
        return shard_sequence(x, dim=1, ring_rank=r, ring_size=ring).contiguous()

    q_local, dout_local = piece(q, rank), piece(dout, rank)
    kv_pieces = [(piece(k, r), piece(v, r)) for r in range(ring)]
    seq_len = q_local.shape[1]
    plan = plan_ring(rank, ring, seq_len, causal=True, layout="zigzag")
    # each step's keys: the rows it fetches of its source's piece
    step_kv = [[t[:, step.keys] for t in kv_pieces[(rank - step.source) % ring]] for step in plan]

    def run() -> None:
        acc = accumulation_dtype(q.dtype)
        out = torch.zeros(q_local.shape, dtype=acc, device=q.device)
        lse = torch.full((q_local.shape[0], q_local.shape[2], seq_len), float("-inf"), dtype=acc, device=q.device)
        for step, (k_piece, v_piece) in zip(plan, step_kv):
            for block in step.blocks:
                o, m = kernel.forward(
                    q_local[:, block.rows],
                    k_piece[:, block.cols],
                    v_piece[:, block.cols],
                    causal=block.causal,
                    scale=scale,
                    window_left=block.window_left,
                )
                merge_block(out[:, block.rows], lse[:, :, block.rows], o, m)
        out = out.to(q.dtype)
        dq = torch.zeros(q_local.shape, dtype=acc, device=q.device)
        for step, (k_piece, v_piece) in zip(plan, step_kv):
            for block in step.blocks:
                grads = kernel.backward(
                    dout_local[:, block.rows],
                    q_local[:, block.rows],
                    k_piece[:, block.cols],
                    v_piece[:, block.cols],
                    out[:, block.rows],
                    lse[:, :, block.rows],
                    causal=block.causal,
                    scale=scale,
                    window_left=block.window_left,
                )
                dq[:, block.rows] += grads[0]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 131072] if cuda else [8192])
    parser.add_argument("--ring", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128 if cuda else 64)
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--iters", type=int, default=5 if cuda else 1)
    parser.add_argument("--kernels", default="auto", help="comma-separated parallel.attention_kernel choices")
    args = parser.parse_args()
    choices = [c.strip() for c in args.kernels.split(",") if c.strip()]
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"device: {name}  torch {torch.__version__}  dtype {args.dtype}  heads {args.heads}/{args.kv_heads}  "
        f"head_dim {args.head_dim}"
    )
    print("| S | what | fwd+bwd ms | TFLOP/s | compute efficiency |")
    print("|---|---|---|---|---|")
    for seq in args.seq:
        gen = torch.Generator(device=device).manual_seed(0)
        shapes = [(1, seq, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
        q, k, v, dout = (torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes)
        # causal fwd+bwd: 4·S²·H·D multiply-adds forward (QK, PV) ×2 FLOPs, backward 2.5× forward, halved by the mask
        flops = 2 * 2 * seq * seq * args.heads * args.head_dim * 3.5 / 2

        t_sdpa = timed(functools.partial(sdpa_fwd_bwd, q, k, v, dout), device, args.iters)
        print(f"| {seq} | sdpa (one device) | {t_sdpa * 1e3:.1f} | {flops / t_sdpa / 1e12:.1f} | |")
        t_first = None
        for choice in choices:
            try:
                name = resolved(q, k, choice).name
            except ValueError as error:
                print(f"| {seq} | kernel {choice}: skipped ({error}) | | | |")
                continue
            t_kernel = timed(rank_work(q, k, v, dout, 0, 1, choice), device, args.iters)
            t_first = t_kernel if t_first is None else t_first
            print(
                f"| {seq} | kernel {choice} = {name}, whole sequence | {t_kernel * 1e3:.1f} | "
                f"{flops / t_kernel / 1e12:.1f} | {t_sdpa / t_kernel:.3f} (vs sdpa) |"
            )
        for ring in [r for r in args.ring if r > 1 and t_first is not None]:
            per_rank = [timed(rank_work(q, k, v, dout, r, ring, choices[0]), device, args.iters) for r in range(ring)]
            slowest = max(per_rank)
            print(
                f"| {seq} | zigzag ring R={ring}: slowest rank (min {min(per_rank) * 1e3:.1f}) | "
                f"{slowest * 1e3:.1f} | {flops / ring / slowest / 1e12:.1f} | {t_first / (ring * slowest):.3f} |"
            )


if __name__ == "__main__":
    main()
