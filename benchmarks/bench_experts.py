"""Mixture-of-experts layers: lctrain's experts implementation against transformers' own at world size 1, and expert
parallelism against none on 4 ranks, on CPU; the first on one GPU too."""

from __future__ import annotations

import argparse
import copy
import functools
from datetime import date

import torch
import torch.distributed as dist

from benchmarks.report import MIB, OnDevice, arguments, heading, save_json, table
from benchmarks.sides import lm_step
from benchmarks.timing import gathered_slowest, median, rounds
from lctrain.parallel.expert import apply_expert_parallel, expert_kernel
from lctrain.testing import run_distributed

VOCAB = 1024
EP_DEGREES = (1, 2, 4)
# the single part's model on CPU and on CUDA
SHAPES = {"seq": OnDevice(2048, 16384, "tokens a row"), "hidden": OnDevice(256, 2048, "width")}
SHAPES |= {"experts": OnDevice(16, 128, "experts"), "expert_width": OnDevice(256, 768, "an expert's width")}
SHAPES["top_k"] = OnDevice(4, 8, "experts per token")


def build(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "head_dim": args.hidden // 4}
    sizes |= {"num_experts": args.experts, "num_experts_per_tok": args.top_k}
    sizes["moe_intermediate_size"] = args.expert_width
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2}
    config = AutoConfig.for_model("qwen3_moe", **sizes, **heads, vocab_size=VOCAB, norm_topk_prob=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def single(args: argparse.Namespace) -> tuple[str, dict[str, list[float]]]:
    """The table of the single part, and each side's step times in seconds."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = build(args).to(device, dtype)
    sides = {}
    for name in ("grouped_mm", "eager"):
        model = copy.deepcopy(reference)
        model.set_experts_implementation(name)
        sides[f"transformers {name}"] = model
    chosen = expert_kernel(device, dtype)
    for kernel in ("loop", "grouped_mm"):
        model = copy.deepcopy(reference)
        apply_expert_parallel(model, None, kernel)
        sides[f"lctrain {kernel}" + (" (chosen here)" if kernel == chosen else "")] = model
    input_ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    steps = {name: functools.partial(lm_step, model, input_ids) for name, model in sides.items()}
    measured = rounds(steps, args.warmup, args.steps, alternate=False, device=device)
    base = median(measured["transformers grouped_mm"], "wall")
    rows = [[name, f"{median(r, 'wall') * 1e3:.0f}", f"{median(r, 'wall') / base:.2f}"] for name, r in measured.items()]
    times = {name: [r["wall"] for r in records] for name, records in measured.items()}
    return table(["experts implementation", "fwd+bwd ms (median)", "vs transformers' default"], rows), times


def ep_rank(args: argparse.Namespace) -> str:
    """On each of the 4 ranks: the model with its experts spread over 1, 2 and 4 ranks, side by side, their steps
    taken in turn; the table of the median step time and the step's memory growth (the slowest and the largest
    rank's) and the expert weights held here, per ep."""
    from torch.distributed.device_mesh import init_device_mesh

    world, models, held = dist.get_world_size(), {}, {}
    for ep in EP_DEGREES:
        models[ep] = model = build(args)
        mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("same", "ep"))["ep"] if ep > 1 else None
        apply_expert_parallel(model, mesh, expert_kernel(torch.device("cpu"), torch.float32))
        weights = [p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))]
        held[ep] = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in weights)
    input_ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    steps = {ep: functools.partial(lm_step, model, input_ids) for ep, model in models.items()}
    measured = gathered_slowest(rounds(steps, args.warmup, args.steps, alternate=False, memory=True, barrier=True))
    rows, base = [], median(measured[EP_DEGREES[0]], "wall")
    for ep in EP_DEGREES:
        step_s, growth = median(measured[ep], "wall"), max(r["growth"] for r in measured[ep]) / MIB
        rows.append([str(ep), f"{step_s * 1e3:.0f}", f"{step_s / base:.2f}", f"{held[ep] / MIB:.1f}", f"{growth:.0f}"])
    header = ["ep", "step ms (slowest rank)", "vs ep 1", "expert weights per rank MiB", "step's peak growth MiB"]
    return table(header, rows)


def main() -> None:
    p = arguments(__doc__, device="cpu", warmup=1, steps=5, json=None, layers=2, **SHAPES)
    p.add_argument("--part", choices=("single", "ep", "all"), default="all")
    args = p.parse_args()
    if args.device == "cuda" and args.part != "single":
        p.error("--device cuda runs --part single only: add --part single")
    torch.set_num_threads(1)
    dtype = "bf16 on one GPU" if args.device == "cuda" else "fp32, one thread per process"
    print(f"{heading()}, {date.today()}")
    print(
        f"Qwen3-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.expert_width}, "
        f"top {args.top_k}; {args.seq} tokens a row, {dtype}\n"
    )
    if args.part in ("single", "all"):
        report, times = single(args)
        print(report + "\n")
        save_json(args.json, device=args.device, times=times)
    if args.part in ("ep", "all"):
        print("4 ranks, one row each:\n" + run_distributed(ep_rank, 4, args)[0])


if __name__ == "__main__":
    main()
