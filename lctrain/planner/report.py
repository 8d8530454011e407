"""Output: the plan table, and a plan written as a recipe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from lctrain.planner.presets import GIB, Hardware, ModelSpec, Workload
from lctrain.planner.search import Plan

# the GPUs per node scripts/slurm/train.sbatch asks for (its #SBATCH --gpus-per-node; a test keeps the two equal)
SBATCH_GPUS_PER_NODE = 8


def describe(model: ModelSpec, hw: Hardware, work: Workload) -> str:
    dtype = {2: "bf16", 4: "fp32"}[work.dtype_bytes]
    if work.lora_rank:
        trained = f" (+ {', '.join(work.lora_trainable)})" if work.lora_trainable else ""
        experts = " and the experts" if work.lora_experts else ""
        dtype += f", LoRA rank {work.lora_rank}{experts}{trained} on a frozen base"
    experts = ""
    if model.moe:
        experts = (
            f" ({_count(model.active_params)} active: {model.experts_per_token} of {model.experts} experts per token)"
        )
    layers = f"{model.layers} layers"
    if any(model.linear_layers):
        key_heads, value_heads = model.linear_heads
        layers += f" ({sum(model.linear_layers)} gated delta: {key_heads}/{value_heads} linear heads)"
    if work.reference != "none":
        dtype += ", a reference model's forward" + (" and frozen copy" if work.reference == "copy" else "")
    return (
        f"{model.name}: {_count(model.num_params)} parameters{experts}, {layers}, {model.heads}/"
        f"{model.kv_heads} heads, vocab {model.vocab}; seq_len {work.seq_len:,}, {work.batch} row(s) per dp rank "
        f"per step, {dtype}\n{work.nodes} node(s) x {work.gpus_per_node} {hw.name}: {hw.tflops:g} TFLOP/s peak at "
        f"MFU {work.mfu:g}, {hw.mem_gib:g} GiB ({work.headroom:.0%} kept free), intra-node {hw.intra_gbps:g} "
        f"GB/s, inter-node {hw.inter_gbps:g} GB/s per GPU (x{work.link_efficiency:g} achieved)"
        + _measured(hw)
        + (f"\nweights: {model.path}, {model.layout}" if model.layout else "")
    )


def _measured(hw: Hardware) -> str:
    """What a hardware file measured (achieved: no efficiency applied), for ``describe``."""
    if not hw.measured:
        return ""
    rates = [f"{name} {getattr(hw, name):.4g}" for name in hw.measured]
    return f"\nmeasured by lctrain probe ({hw.dtype}; used as achieved, the rest from the preset): {', '.join(rates)}"


PHASES = {"forward": "fwd", "backward": "bwd", "grads": "grads"}  # the table's "at" column


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def table(plans: Sequence[Plan], chosen: Plan | None, *, top: int, show_refused: bool) -> str:
    header = (
        f"{'':2}{'pp':>3}{'dp':>4}{'ring':>5}{'uly':>4}{'ep':>4}  {'AC':<12}{'mem GiB':>8} {'states':>7}{'gath':>6}"
        f"{'act':>7}"
        f"{'recomp':>7}{'bwd':>6}{'loss':>6} {'at':<5} {'link':<6}{'S/R':>9}{'S/R min':>9}  {'ring step ms: comp':>18}"
        f"{'comm':>9}  {'hidden':<6}{'step s':>9}{'tok/s':>10}{'MFU':>6}"
    )
    lines = [header]
    shown = [p for p in plans if p.feasible][:top]
    refused = [p for p in plans if not p.feasible] if show_refused else []
    for plan in shown + refused:
        lay, mem, ring, time = plan.layout, plan.memory, plan.ring, plan.time
        gib = {k: v / GIB for k, v in asdict(mem).items() if isinstance(v, float)}
        mark = "* " if plan is chosen else ("x " if not plan.feasible else "  ")
        ring_cols = (
            f"{ring.link:<6}{ring.tokens_per_rank:>9}{ring.threshold_tokens:>9.0f}  "
            f"{_ms(ring.compute_fwd_s + ring.compute_bwd_s):>18}{_ms(ring.comm_fwd_s + ring.comm_bwd_s):>9}  "
            f"{'yes' if ring.hidden else 'NO':<6}"
            if lay.ring > 1
            else f"{'-':<6}{'-':>9}{'-':>9}  {'-':>18}{'-':>9}  {'-':<6}"
        )
        lines.append(
            f"{mark}{lay.pp:>3}{lay.dp:>4}{lay.ring:>5}{lay.ulysses:>4}{lay.ep:>4}  {lay.ac_label():<12}"
            f"{mem.total / GIB:>8.1f} "
            f"{gib['states']:>7.1f}{gib['gathered']:>6.1f}{gib['activations']:>7.1f}{gib['recompute']:>7.1f}"
            f"{gib['backward']:>6.1f}{gib['loss']:>6.1f} {PHASES[mem.phase]:<5} {ring_cols}{time.total_s:>9.3g}"
            f"{time.tokens_per_s:>10.4g}{time.mfu:>6.2f}"
        )
        if not plan.feasible:
            lines.append(f"{'':8}refused: {'; '.join(plan.problems)}")
    return "\n".join(lines)


def recipe_text(model: ModelSpec, plan: Plan, hw: Hardware, work: Workload, *, name: str, command: str) -> str:
    """A recipe (``recipes/<name>.yaml`` in the working directory) for this plan: Hydra's package line, the
    exact launch line, a header with the hardware and the estimates, then the model, mesh and data settings."""
    lay, mem, ring = plan.layout, plan.memory, plan.ring
    if work.nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node {work.gpus_per_node} -m lctrain train recipe={name}"
    else:  # the script asks slurm for its own number of GPUs per node unless told otherwise
        gpus = "" if work.gpus_per_node == SBATCH_GPUS_PER_NODE else f" --gpus-per-node={work.gpus_per_node}"
        launch = f"sbatch --nodes={work.nodes}{gpus} scripts/slurm/train.sbatch recipe={name}"
    gib = mem.gib()
    ring_line = (
        f"# Ring step per layer: {(ring.compute_fwd_s + ring.compute_bwd_s) * 1e3:.3g} ms attention vs "
        f"{(ring.comm_fwd_s + ring.comm_bwd_s) * 1e3:.3g} ms {ring.link}-node transfer ("
        + (f"hidden: S/R {ring.tokens_per_rank} >= {ring.threshold_tokens:.0f})." if ring.hidden else "NOT hidden).")
        if lay.ring > 1
        else "# No ring (ring = 1)."
    )
    lines = [
        "# @package _global_",
        f"# {launch}",
        f"# Planned by: {command}",
        f"# Hardware: {work.nodes} node(s) x {work.gpus_per_node} {hw.name} ({hw.tflops:g} TFLOP/s, {hw.mem_gib:g} GiB,"
        f" intra-node {hw.intra_gbps:g} GB/s, inter-node {hw.inter_gbps:g} GB/s per GPU).",
        f"# Predicted (not measured) peak memory per GPU: {gib['total']:.1f} GiB of {hw.mem_gib:g} (states "
        f"{gib['states']:.1f}, "
        f"gathered params {gib['gathered']:.1f},",
        f"#   activations {gib['activations']:.1f}, recompute {gib['recompute']:.1f}, backward {gib['backward']:.1f}, "
        f"loss {gib['loss']:.1f}).",
        ring_line,
        f"# About {plan.time.tokens_per_s:.3g} tokens/s at MFU {work.mfu:g} ({plan.time.total_s:.3g} s per step of "
        f"{plan.time.tokens_per_step:,} tokens).",
        "# How these are predicted, and their error against measured peaks: docs/planner.md.",
    ]
    if model.moe:
        lines.insert(
            -1,
            f"# Experts: {model.experts} per layer, {model.experts // lay.ep} per GPU (ep {lay.ep}); "
            f"{_count(model.active_params)} of {_count(model.num_params)} parameters active; all-to-alls "
            f"{plan.time.expert_s:.3g} s/step.",
        )
    if model.path is not None:
        lines += ["defaults:", "  - override /model: hf", "", "model:", f"  path: {model.path}"]
    else:
        lines += [
            "",
            "model:",
            f"  family: {model.family}",
            f"  hidden_size: {model.hidden}",
            # a mixture of experts: each expert's width
            f"  intermediate_size: {model.expert_intermediate if model.moe else model.intermediate}",
            f"  num_layers: {model.layers}",
            f"  num_heads: {model.heads}",
            f"  num_kv_heads: {model.kv_heads}",
            f"  vocab_size: {model.vocab}",
            f"  tie_word_embeddings: {str(model.tied).lower()}",
        ]
        if model.moe:
            lines += [f"  num_experts: {model.experts}", f"  experts_per_token: {model.experts_per_token}"]
        if model.rope_theta is not None:
            lines.append(f"  rope_theta: {model.rope_theta}")
    if work.lora_rank:
        lines += ["  lora:", f"    rank: {work.lora_rank}", f"    alpha: {2.0 * work.lora_rank}"]
        if work.lora_trainable:
            lines.append(f"    trainable: [{', '.join(work.lora_trainable)}]")
        if work.lora_experts:
            lines.append("    target_parameters: [experts.gate_up_proj, experts.down_proj]")
    lines += [
        "",
        "parallel:",
        *(f"  {axis}: {degree}" for axis, degree in lay.degrees().items()),
        *([f"  ep: {lay.ep}"] if lay.ep > 1 else []),
        f"  activation_checkpointing: {lay.ac}",
    ]
    if lay.ac == "selective":
        lines.append(f"  ac_every: {lay.ac_every}")
    if lay.pp > 1:
        lines.append("  pp_schedule: 1F1B")
    if work.offload:
        lines.append("  activation_offload: true")
    if work.cpu_offload:
        lines.append("  cpu_offload: true")
    if work.mlp_chunk_tokens:
        lines.append(f"  mlp_chunk_tokens: {work.mlp_chunk_tokens}")
    default_bytes = 2 if hw.device == "cuda" else 4  # param_dtype auto: bf16 on CUDA, fp32 on CPU
    if work.dtype_bytes != default_bytes:
        lines.append(f"  param_dtype: {'bfloat16' if work.dtype_bytes == 2 else 'float32'}")
    lines += ["", "data:", f"  seq_len: {work.seq_len}", f"  batch_size: {work.batch}", "", "train:"]
    lines.append(f"  run_dir: runs/{name}")
    if work.loss_chunk_tokens != 1024:
        lines.append(f"  loss_chunk_tokens: {work.loss_chunk_tokens}")
    if hw.name not in ("h100", "h200", "a100"):  # the trainer knows these GPUs' peaks for its MFU
        lines.append(f"  peak_tflops: {hw.tflops:g}")
    return "\n".join(lines) + "\n"
