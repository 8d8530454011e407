"""One gated delta layer (Qwen3.5's ``Qwen3_5GatedDeltaNet``), forward + backward on P zigzag ring ranks, fp32 on CPU:
the slowest rank's time, P x that against one rank's, the bytes a layer all-gathers; transformers' own module beside it.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
from transformers import AutoConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from benchmarks.report import arguments
from benchmarks.timing import median_seconds
from lctrain.attention import SequencePlace
from lctrain.linear_attention.gated_deltanet import patch_linear_attention
from lctrain.testing import run_distributed


def layer(args: argparse.Namespace) -> torch.nn.Module:
    heads = {"linear_num_key_heads": args.key_heads, "linear_num_value_heads": args.value_heads}
    dims = {"linear_key_head_dim": args.head_dim, "linear_value_head_dim": args.head_dim}
    layers = {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}
    config = AutoConfig.for_model("qwen3_5_text", hidden_size=args.hidden, **heads, **dims, **layers)
    torch.manual_seed(0)
    return Qwen3_5GatedDeltaNet(config, 0)


def step(module: torch.nn.Module, hidden: torch.Tensor) -> None:
    module(hidden).sum().backward()


def rank_seconds(args: argparse.Namespace, length: int) -> float:
    """Median seconds (each run's slowest rank) of a forward + backward on this rank's zigzag share of ``length``."""
    torch.set_num_threads(1)
    size = dist.get_world_size()
    module = layer(args)
    patch_linear_attention(
        [module], ring_group=dist.group.WORLD if size > 1 else None, ulysses_group=None, layout="zigzag"
    )
    place = SequencePlace(dist.get_rank(), size)
    hidden = place.shard(torch.randn(1, length, args.hidden, generator=torch.Generator().manual_seed(1)), dim=1)
    return median_seconds(functools.partial(step, module, hidden.requires_grad_()), args.iters)


def main() -> None:
    lists = {"lengths": [16384, 65536], "ranks": [1, 2, 4]}
    args = arguments(__doc__, head_dim=64, iters=3, **lists, hidden=512, key_heads=4, value_heads=8).parse_args()
    torch.set_num_threads(1)
    # what one layer all-gathers per rank (its 2 zigzag pieces' conv halos and summaries, fp32), times the ranks
    halo, summary = 3 * args.head_dim * (2 * args.key_heads + args.value_heads), args.value_heads * 2 * args.head_dim**2
    exchanged = 2 * 4 * (halo + summary)
    print(f"Qwen3_5GatedDeltaNet, hidden {args.hidden}, {args.key_heads} key / {args.value_heads} value heads of "
          f"{args.head_dim}, fp32, CPU, one thread per rank, forward + backward, median of {args.iters}")  # fmt: skip
    print("| tokens | ranks | slowest rank ms | ranks x ms / one rank's | bytes all-gathered per layer |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        module, hidden = layer(args), torch.randn(1, length, args.hidden, requires_grad=True)
        own = median_seconds(functools.partial(step, module, hidden), args.iters)
        one = None
        for ranks in args.ranks:
            seconds = run_distributed(rank_seconds, ranks, args, length)[0]
            one = one or seconds
            sent = exchanged * ranks if ranks > 1 else 0
            print(f"| {length} | {ranks} | {seconds * 1e3:.0f} | {ranks * seconds / one:.2f} | {sent} |")
        print(f"| {length} | transformers' module, 1 | {own * 1e3:.0f} | lctrain / transformers: {one / own:.2f} | |")


if __name__ == "__main__":
    main()
