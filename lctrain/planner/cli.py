"""``python -m lctrain plan``: the command line."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from lctrain.planner.presets import GIB, HARDWARE, NAMED_MODELS, Workload, load_hardware, load_model
from lctrain.planner.report import describe, recipe_text, table
from lctrain.planner.search import plan_layouts, ranked, recommend, usable_bytes

AC_CHOICES = ("auto", "none", "selective", "full")


def _mesh_arg(text: str) -> tuple[int, int, int, int]:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: give four positive degrees PP,DP,RING,ULYSSES")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def model_parser(command: str, description: str) -> argparse.ArgumentParser:
    """The parser of ``python -m lctrain COMMAND`` (``plan``, ``probe``) with the ``--model`` both take."""
    p = argparse.ArgumentParser(prog=f"python -m lctrain {command}", description=description)
    p.add_argument("--model", required=True, help=f"a named size ({', '.join(NAMED_MODELS)}) or a HF model directory")
    return p


def check_positive(values: object, names: Sequence[str]) -> None:
    """The options ``names`` (attributes of ``values``, spelled ``--name`` on the command line) are at least 1."""
    for name in names:
        value = getattr(values, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 1")


def parser() -> argparse.ArgumentParser:
    p = model_parser(
        "plan",
        "Feasible (pp, dp, ring, ulysses[, ep]) layouts with their estimated memory per GPU, ring-step compute and "
        "communication, whether the communication hides (S/R >= the S/R min column), step time; recommends one and "
        "can write it as a recipe. The model behind every figure: docs/planner.md.",
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row (data.seq_len)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", choices=sorted(HARDWARE), help="hardware preset (default h100)")
    p.add_argument(
        "--hardware",
        metavar="FILE",
        help="a hardware file written by `python -m lctrain probe` on the cluster, in place of the preset (which "
        "supplies only what the file lacks: --gpu, default h100 on cuda, cpu on cpu)",
    )
    p.add_argument("--tflops", type=float, help="override: dense peak TFLOP/s per GPU")
    p.add_argument("--mem-gib", type=float, help="override: memory per GPU, GiB")
    p.add_argument("--intra-gbps", type=float, help="override: NVLink GB/s per GPU per direction")
    p.add_argument("--inter-gbps", type=float, help="override: network GB/s per GPU per direction")
    p.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s (default 0.4)")
    p.add_argument(
        "--link-efficiency", type=float, default=0.8, help="achieved fraction of nominal link bandwidth (0.8)"
    )
    p.add_argument("--headroom", type=float, default=0.15, help="fraction of memory kept free (default 0.15)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        help="compute dtype (default: a hardware file's, else bf16 on GPUs, fp32 on cpu)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=AC_CHOICES,
        default="auto",
        help="auto (default): per layout the least recomputation that fits",
    )
    p.add_argument("--ac-every", type=int, default=2, help="with selective: checkpoint every n-th layer (default 2)")
    p.add_argument("--batch", type=int, default=1, help="rows per dp rank per step = pipeline micro-batches")
    p.add_argument("--max-pp", type=int, help="largest pipeline degree to consider")
    p.add_argument("--max-dp", type=int, help="largest dp degree (it sets the global batch: dp x batch x seq-len)")
    p.add_argument("--mesh", type=_mesh_arg, help="evaluate only this mesh: PP,DP,RING,ULYSSES")
    p.add_argument(
        "--ep", type=int, help="a mixture of experts: only this expert-parallel degree (default: every one allowed)"
    )
    p.add_argument("--loss-chunk-tokens", type=int, default=1024)
    p.add_argument("--mlp-chunk-tokens", type=int, default=0, help="parallel.mlp_chunk_tokens (0 = off)")
    p.add_argument("--offload", action="store_true", help="parallel.activation_offload (needs checkpointing)")
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="parallel.cpu_offload: sharded weights, gradients and AdamW states in host memory",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="model.lora.rank: LoRA adapters on every projection, the base frozen in the compute dtype (0 = off)",
    )
    p.add_argument(
        "--lora-trainable",
        default="",
        help="model.lora.trainable, comma-separated: modules trained in full (embed_tokens, norm, lm_head)",
    )
    p.add_argument(
        "--lora-experts",
        action="store_true",
        help="model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]: adapters on a mixture of "
        "experts' expert weights too (expert parallelism refused)",
    )
    p.add_argument(
        "--reference",
        choices=("none", "adapters", "copy"),
        default="none",
        help="a preference objective's reference model: none (LM, reference-free or precomputed), adapters (LoRA's "
        "base, adapters disabled: one more forward) or copy (a frozen copy or another model: its weights too)",
    )
    p.add_argument("--top", type=int, default=12, help="feasible layouts shown (default 12)")
    p.add_argument("--all", action="store_true", help="also show the refused layouts and why")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--write-recipe", metavar="PATH", help="write the recommended (or --mesh) layout as a recipe")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        model = load_model(args.model)
        base = HARDWARE[args.gpu or "h100"] if args.hardware is None else load_hardware(args.hardware, args.gpu)
        check_positive(args, ("seq_len", "gpus_per_node", "nodes", "batch", "loss_chunk_tokens", "ac_every"))
        check_positive(args, ("ep",) if args.ep is not None else ())
    except ValueError as error:
        raise SystemExit(f"lctrain plan: {error}") from None
    overrides = {"tflops": args.tflops, "mem_gib": args.mem_gib, "intra_gbps": args.intra_gbps}
    overrides["inter_gbps"] = args.inter_gbps
    overrides = {k: v for k, v in overrides.items() if v is not None}  # nominal figures: no longer measured ones
    hw = replace(base, measured=tuple(f for f in base.measured if f not in overrides), **overrides)
    dtype = args.dtype or hw.dtype or ("bf16" if hw.device == "cuda" else "fp32")
    trainable = tuple(name for name in args.lora_trainable.split(",") if name)
    if args.reference == "adapters" and not args.lora_rank:
        raise SystemExit("lctrain plan: --reference adapters is LoRA's base: give --lora-rank (else --reference copy)")
    if args.lora_rank < 0 or ((trainable or args.lora_experts) and not args.lora_rank):
        raise SystemExit(
            "lctrain plan: --lora-rank must be >= 1 for LoRA (0 = full fine-tuning, no --lora-trainable or "
            "--lora-experts)"
        )
    unknown = sorted(set(trainable) - {"embed_tokens", "norm", "lm_head"})
    if unknown:
        raise SystemExit(
            f"lctrain plan: --lora-trainable {','.join(unknown)}: the planner knows embed_tokens, norm, lm_head"
        )
    if args.lora_experts and not model.moe:
        raise SystemExit(
            "lctrain plan: --lora-experts puts adapters on a mixture of experts' experts: this model has none"
        )
    work = Workload(
        seq_len=args.seq_len,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        batch=args.batch,
        dtype_bytes=2 if dtype == "bf16" else 4,
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        offload=args.offload,
        cpu_offload=args.cpu_offload,
        lora_rank=args.lora_rank,
        lora_trainable=trainable,
        lora_experts=args.lora_experts,
        reference=args.reference,
        mfu=args.mfu,
        link_efficiency=args.link_efficiency,
        headroom=args.headroom,
        device=hw.device,
    )
    if args.mesh and math.prod(args.mesh) != work.world:
        raise SystemExit(
            f"lctrain plan: --mesh {','.join(map(str, args.mesh))} multiplies to {math.prod(args.mesh)}, not the "
            f"{work.world} GPUs of --nodes {work.nodes} x --gpus-per-node {work.gpus_per_node}"
        )
    plans = plan_layouts(
        model,
        hw,
        work,
        ac=args.activation_checkpointing,
        ac_every=args.ac_every,
        max_pp=args.max_pp,
        max_dp=args.max_dp,
        mesh=args.mesh,
        ep=args.ep,
    )
    chosen = recommend(plans)
    order = ranked(plans, chosen)
    command = "python -m lctrain plan " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    if args.json:
        report = {
            "model": {**asdict(model), "num_params": model.num_params, "active_params": model.active_params},
            "hardware": asdict(hw),
            "workload": asdict(work),
            "usable_gib": usable_bytes(hw, work) / GIB,
            "recommended": None if chosen is None else chosen.to_dict(),
            "plans": [p.to_dict() for p in order],
        }
        print(json.dumps(report, indent=2))
    else:
        print(describe(model, hw, work))
        print()
        print(table(order, chosen, top=args.top, show_refused=args.all))
        print()
        if chosen is None:
            print("no layout fits: --all shows why (try more GPUs, activation checkpointing or a shorter seq_len)")
        else:
            experts = f" ep={chosen.layout.ep}" if model.moe else ""
            print(f"recommended: {chosen.layout}{experts}, activation_checkpointing={chosen.layout.ac_label()}")
            if not chosen.ring.hidden:
                print("warning: its ring communication is not hidden behind attention (no feasible layout hides it)")
    if args.write_recipe:
        if chosen is None:
            reasons = "; ".join(plans[0].problems) if args.mesh else "see --all"
            raise SystemExit(f"lctrain plan: no feasible layout to write ({reasons})")
        path = Path(args.write_recipe)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(recipe_text(model, chosen, hw, work, name=path.stem, command=command))
        from lctrain.config.load import USER_RECIPE_DIR  # here: the planner itself does not load torch or Hydra

        launchable = path.resolve().parent == USER_RECIPE_DIR.resolve()
        where = "" if launchable else f" (copy it into {USER_RECIPE_DIR}/ to launch it by name)"
        print(f"wrote {path}{where}", file=sys.stderr if args.json else sys.stdout)
