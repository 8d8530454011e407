"""Compute efficiency of the ring decomposition on one device (no communication), and kernel throughput."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.report import arguments, listed
from benchmarks.rings import random_inputs
from benchmarks.timing import median_seconds
from lctrain.attention import shard_sequence
from lctrain.attention.kernels import AttentionKernel, default_scale, resolve_kernel
from lctrain.attention.ring import _ring_backward, _ring_forward
from lctrain.attention.ring_blocks import Step, plan_ring
from lctrain.attention.timeline import NoTimeline
from lctrain.attention.transport import Transfer


def sdpa_fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout.transpose(1, 2))


def resolved(q: torch.Tensor, k: torch.Tensor, choice: str) -> AttentionKernel:
    heads = {"head_dim": q.shape[-1], "q_heads": q.shape[2], "kv_heads": k.shape[2]}
    return resolve_kernel(q.device, q.dtype, **heads, choice=choice)


class LocalPeers:
    """Stands in for the ring's transport (``transport.Peers``) on one device: a step's K/V rows are copied from
    their owner's piece (``pieces``: each ring rank's K and V) instead of received; dK/dV returns come back as
    zeros."""

    timeline = NoTimeline()

    def __init__(self, rank: int, plan: tuple[Step, ...], pieces: list[tuple[torch.Tensor, torch.Tensor]]):
        self.rank, self.pieces = rank, pieces
        self.keys = {step.source: step.keys for step in plan}

    def exchange(self, what: str, source: int, send: list, send_offset: int, receive: list, offset: int, cuts: list):
        for store, owned in zip(receive, self.pieces[(self.rank - source) % len(self.pieces)]):
            if what == "kv":  # rows first, as the ring receives them
                store.copy_(owned[:, self.keys[source]].transpose(0, 1))
            else:
                store.zero_()
        return [Transfer([], []) for _ in cuts]


def rank_work(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, rank: int, ring: int, choice: str = "auto"
) -> Callable[[], None]:
    """Returns a closure running ring rank ``rank``'s passes (forward then backward) of a zigzag ring."""
    kernel, scale = resolved(q, k, choice), default_scale(q.shape[-1])
    pieces = [[shard_sequence(t, dim=1, ring_rank=r, ring_size=ring).contiguous() for t in (q, k, v, dout)]
              for r in range(ring)]  # fmt: skip
    q_own, k_own, v_own, dout_own = pieces[rank]
    plan = plan_ring(rank, ring, q_own.shape[1], causal=True, layout="zigzag")
    peers = LocalPeers(rank, plan, [(piece[1], piece[2]) for piece in pieces])

    def run() -> None:
        out, lse, kept = _ring_forward(q_own, k_own, v_own, peers, plan, scale=scale, kernel=kernel, sink=None)
        _ring_backward(q_own, k_own, v_own, (dout_own, out, lse), kept, peers, plan, scale=scale, kernel=kernel)

    return run


def main() -> None:
    cuda = torch.cuda.is_available()
    on_gpu = {"head_dim": 128, "iters": 5, "seq": [32768, 131072], "dtype": "bfloat16"}
    on_cpu = {"head_dim": 64, "iters": 1, "seq": [8192], "dtype": "float32"}
    parser = arguments(__doc__, heads=32, kv_heads=8, ring=[2, 8], **(on_gpu if cuda else on_cpu))
    parser.add_argument("--kernels", type=listed(), default="auto", help="comma-separated parallel.attention_kernel")
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"device: {name}  torch {torch.__version__}  dtype {args.dtype}  heads {args.heads}/{args.kv_heads}  "
        f"head_dim {args.head_dim}\n| S | what | fwd+bwd ms | TFLOP/s | compute efficiency |\n|---|---|---|---|---|"
    )
    for seq in args.seq:
        q, k, v, dout = (t.to(device) for t in random_inputs(seq, args.heads, args.kv_heads, args.head_dim, dtype))
        # causal fwd+bwd: 4·S²·H·D multiply-adds forward (QK, PV) ×2 FLOPs, backward 2.5× forward, halved by the mask
        flops = 2 * 2 * seq * seq * args.heads * args.head_dim * 3.5 / 2

        t_sdpa = median_seconds(functools.partial(sdpa_fwd_bwd, q, k, v, dout), args.iters, device)
        print(f"| {seq} | sdpa (one device) | {t_sdpa * 1e3:.1f} | {flops / t_sdpa / 1e12:.1f} | |")
        t_first = None
        for choice in args.kernels:
            try:
                name = resolved(q, k, choice).name
            except ValueError as error:
                print(f"| {seq} | kernel {choice}: skipped ({error}) | | | |")
                continue
            t_kernel = median_seconds(rank_work(q, k, v, dout, 0, 1, choice), args.iters, device)
            t_first = t_kernel if t_first is None else t_first
            print(f"| {seq} | kernel {choice} = {name}, whole sequence | {t_kernel * 1e3:.1f} | "
                  f"{flops / t_kernel / 1e12:.1f} | {t_sdpa / t_kernel:.3f} (vs sdpa) |")  # fmt: skip
        for ring in [r for r in args.ring if r > 1 and t_first is not None]:
            work = [rank_work(q, k, v, dout, r, ring, args.kernels[0]) for r in range(ring)]
            per_rank = [median_seconds(run, args.iters, device) for run in work]
            slowest = max(per_rank)
            print(
                f"| {seq} | zigzag ring R={ring}: slowest rank (min {min(per_rank) * 1e3:.1f}) | "
                f"{slowest * 1e3:.1f} | {flops / ring / slowest / 1e12:.1f} | {t_first / (ring * slowest):.3f} |"
            )


if __name__ == "__main__":
    main()
