"""gpt-oss's attention sinks: their cost in one rank's attention forward+backward, and a tiny gpt-oss's forward+backward
as lctrain runs it at world size 1 against transformers' own."""

from __future__ import annotations

import argparse
import copy
import functools

import torch

from benchmarks.report import arguments, heading, table
from benchmarks.rings import random_inputs
from benchmarks.sides import lm_step
from benchmarks.timing import median, median_seconds, rounds
from lctrain.attention import usp_attention
from lctrain.models.patch import patch_attention
from lctrain.parallel.expert import apply_expert_parallel, expert_kernel

VOCAB = 1024


def attention_pass(tensors: list[torch.Tensor], sinks: torch.Tensor | None, window: int | None) -> None:
    """Forward + backward of ``usp_attention`` (no groups: one rank's piece), with ``sinks`` or without."""
    usp_attention(*tensors[:3], causal=True, layout="contiguous", window=window, sinks=sinks).backward(tensors[3])


def sinks_share(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    full = random_inputs(args.tokens, args.heads, args.kv_heads, args.head_dim, torch.float32)
    tensors = [t.to(device, dtype).requires_grad_(i < 3) for i, t in enumerate(full)]
    sinks = torch.randn(args.heads, generator=torch.Generator().manual_seed(1)).to(device, dtype).requires_grad_()
    print(f"attention: {args.tokens} tokens, window {args.window}, forward+backward, median of {args.iters}")
    times = {
        name: median_seconds(functools.partial(attention_pass, tensors, s, args.window), args.iters, device=device)
        for name, s in (("without sinks", None), ("with sinks", sinks))
    }
    rows = [[name, f"{seconds * 1e3:.1f}"] for name, seconds in times.items()]
    rows.append(["the sinks' share", f"{times['with sinks'] / times['without sinks'] - 1:+.1%}"])
    print(table(["attention", "fwd+bwd ms (median)"], rows) + "\n")


def against_transformers(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """The tiny gpt-oss (a sliding layer, window 128, and a full one; 8 experts of width 256, top 2) with the same
    weights on both sides, its rows of ``--model-tokens``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2, "head_dim": args.head_dim}
    sizes |= {"num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "sliding_window": 128}
    sizes |= {"num_local_experts": 8, "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]}
    torch.manual_seed(0)
    config = AutoConfig.for_model("gpt_oss", vocab_size=VOCAB, **sizes)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device, dtype)
    ours = copy.deepcopy(hf)
    patch_attention(ours, ulysses_group=None, ring_group=None, layout="contiguous")
    apply_expert_parallel(ours, None, expert_kernel(device, dtype))
    input_ids = torch.randint(0, VOCAB, (1, args.model_tokens), generator=torch.Generator().manual_seed(0))
    sides = {"transformers (eager)": hf, "lctrain": ours}
    steps = {name: functools.partial(lm_step, model, input_ids.to(device)) for name, model in sides.items()}
    measured = rounds(steps, 1, args.iters, device=device)
    base = median(measured["transformers (eager)"], "wall")
    print(f"tiny gpt-oss, 2 layers, hidden 256, {args.model_tokens} tokens, forward+backward, median of {args.iters}")
    rows = [[name, f"{median(r, 'wall') * 1e3:.0f}", f"{median(r, 'wall') / base:.2f}"] for name, r in measured.items()]
    print(table(["side", "fwd+bwd ms (median)", "vs transformers"], rows))


def main() -> None:
    sizes = {"tokens": (4096, "the attention part's tokens"), "model_tokens": (2048, "the model part's tokens")}
    parser = arguments(__doc__, heads=8, kv_heads=2, head_dim=64, iters=5, device="cpu", **sizes)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(heading())
    print(
        f"{args.device}, {args.threads} thread(s), {args.dtype}, {args.heads}/{args.kv_heads} heads x {args.head_dim}\n"
    )
    sinks_share(args, device, dtype)
    against_transformers(args, device, dtype)


if __name__ == "__main__":
    main()
