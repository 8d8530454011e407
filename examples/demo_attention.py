"""The default job until the trainer lands: hybrid USP attention over a (ring × ulysses) mesh, checked and timed.

Launch with torchrun (one process per rank; CPU + gloo here, CUDA + NCCL when GPUs are present):

    torchrun --standalone --nproc-per-node 4 examples/demo_attention.py --ring 2 --ulysses 2

Every rank builds the same full-length q, k, v, takes its zigzag shard, runs ``usp_attention`` forward and
backward, and rank 0 compares the gathered output and gradients with PyTorch's single-device SDPA on the whole
sequence, then prints the error and the time per step of both.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lctrain.attention import SequencePlace, unshard_sequence, usp_attention


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring", type=int, default=2, help="ring (cross-node) degree R")
    parser.add_argument("--ulysses", type=int, default=2, help="Ulysses (intra-node) degree U")
    parser.add_argument("--seq-len", type=int, default=8192, help="global sequence length (multiple of 2·R·U)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="bf16 is emulated (slow) on most CPUs"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed forward+backward steps after one warm-up")
    return parser.parse_args()


def fwd_bwd(fn, inputs: list[torch.Tensor], dout: torch.Tensor) -> tuple[list[torch.Tensor], float]:  # noqa: ANN001
    """One forward+backward of ``fn`` on fresh leaves; returns (out, dq, dk, dv) and the seconds it took."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    start = time.perf_counter()
    out = fn(*leaves)
    out.backward(dout)
    seconds = time.perf_counter() - start
    return [out.detach()] + [t.grad for t in leaves], seconds


def main() -> None:
    args = parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    dist.init_process_group("nccl" if device is not None else "gloo")
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    if args.ring * args.ulysses != world:
        raise SystemExit(f"--ring {args.ring} x --ulysses {args.ulysses} must equal the number of processes ({world})")
    mesh = init_device_mesh(device.type, (args.ring, args.ulysses), mesh_dim_names=("ring", "ulysses"))
    place = SequencePlace.from_mesh(mesh, layout="zigzag")
    dtype = getattr(torch, args.dtype)

    gen = torch.Generator().manual_seed(0)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    full = [torch.randn(1, args.seq_len, h, args.head_dim, generator=gen).to(device, dtype) for h in heads]
    local = [place.shard(t, dim=1) for t in full]

    def distributed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return usp_attention(q, k, v, ulysses_group=mesh.get_group("ulysses"), ring_group=mesh.get_group("ring"))

    times = []
    for _ in range(args.steps + 1):
        dist.barrier()
        results, seconds = fwd_bwd(distributed, local[:3], local[3])
        times.append(seconds)
    gathered = []
    for t in results:
        shards = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(shards, t.contiguous())
        gathered.append(unshard_sequence(shards, dim=1, ring_size=args.ring, ulysses_size=args.ulysses))

    if dist.get_rank() == 0:

        def single_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, S, H, D] -> [B, H, S, D]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

        reference, single_seconds = fwd_bwd(single_device, full[:3], full[3])
        print(
            f"USP attention  S={args.seq_len}  ring={args.ring} x ulysses={args.ulysses}  heads={args.heads}/"
            f"{args.kv_heads}  head_dim={args.head_dim}  {args.dtype}  device={device.type}"
        )
        print(f"{'tensor':>6}  {'max |distributed - single-device SDPA|':>40}")
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), gathered, reference):
            print(f"{name:>6}  {(ours.float() - theirs.float()).abs().max().item():>40.3e}")
        step = sorted(times[1:])[len(times[1:]) // 2]
        print(
            f"fwd+bwd per step: distributed {step * 1e3:.1f} ms on {world} ranks, "
            f"single device {single_seconds * 1e3:.1f} ms (one run; threads={torch.get_num_threads()})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
