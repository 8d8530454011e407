"""The rules a job's sizes must satisfy, one function each, with one wording.

The config check (``lctrain.config.check_job``), the data loader, the attention functions, the evaluator and the
layout planner all call these, so a rule and its message live in one place. Each check raises ``ValueError`` naming
the setting (``setting=`` is how the caller's user spells it: ``data.seq_len`` in a config, ``sequence length`` for
a tensor) and the fix. Plain arithmetic: importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

LAYOUTS = ("zigzag", "contiguous")

# pipeline schedules run here: one stage per rank, several (looped: rank r holds r, r + pp, ...), several in a V
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
LOOPED_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
LAYER_PREFIX = "model.layers."
# parallel.attention_kernel: auto or a kernel's name (lctrain.attention.kernels.KERNELS, in auto's order on CUDA)
KERNEL_CHOICES = ("auto", "cudnn", "flash_attn3", "flash_attn", "torch_cuda_flash", "torch_cpu_flash", "reference")


def check_kernel_choice(choice: str, *, setting: str = "kernel") -> None:
    """``choice`` is ``auto`` or a kernel name; ``setting`` is how the caller's user spells it."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(
            f"{setting}={choice!r} must be one of {', '.join(KERNEL_CHOICES)} (auto picks per device and case; a "
            f"name is tried first: docs/parallelism.md, 'Attention kernels')"
        )


def check_layout(layout: str, *, setting: str = "layout") -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{setting}={layout!r} must be one of {LAYOUTS}")


def sequence_divisor(layout: str, ring: int, ulysses: int) -> int:
    """The number every global sequence length must be a multiple of: 2·R·U (zigzag: two chunks per ring rank) or
    R·U (contiguous)."""
    check_layout(layout)
    return (2 if layout == "zigzag" else 1) * ring * ulysses


def check_sequence_length(length: int, *, layout: str, ring: int, ulysses: int, setting: str = "data.seq_len") -> None:
    """A global sequence is cut whole over the context-parallel ranks: ``length`` must be a positive multiple of
    ``sequence_divisor``."""
    divisor = sequence_divisor(layout, ring, ulysses)
    if length < 1 or length % divisor:
        formula = "2·ring·ulysses" if layout == "zigzag" else "ring·ulysses"
        raise ValueError(
            f"{setting}={length} is not divisible by {divisor} ({formula} with ring={ring}, ulysses={ulysses}, "
            f"layout={layout!r}): use a multiple of {divisor}, e.g. {max(1, round(length / divisor)) * divisor}"
        )


def check_ulysses_heads(num_heads: int, num_kv_heads: int, ulysses: int, *, setting: str = "parallel.ulysses") -> None:
    """Ulysses gives each rank ``num_heads / ulysses`` query heads; key/value heads are split the same way or, when
    there are fewer of them than ranks, replicated (``ulysses % num_kv_heads == 0``)."""
    if num_heads % ulysses:
        raise ValueError(
            f"{setting}={ulysses} does not divide the {num_heads} attention heads: choose a ulysses degree "
            f"that divides {num_heads} and move the rest to the ring"
        )
    if num_kv_heads % ulysses and ulysses % num_kv_heads:
        raise ValueError(
            f"{setting}={ulysses} and the {num_kv_heads} key/value heads: one must divide the other "
            f"(key/value heads are split over the Ulysses ranks, or replicated when fewer); choose another ulysses "
            f"degree"
        )


def check_linear_heads(key_heads: int, value_heads: int, ulysses: int, *, setting: str = "parallel.ulysses") -> None:
    """Ulysses gives each rank ``1/ulysses`` of the linear layers' key heads and of their value heads."""
    if key_heads % ulysses or value_heads % ulysses:
        raise ValueError(
            f"{setting}={ulysses} does not divide the linear-attention layers' {key_heads} key heads and "
            f"{value_heads} value heads (linear_num_key_heads, linear_num_value_heads): choose a ulysses degree that "
            f"divides both and move the rest to the ring"
        )


def groups_inside_nodes(group_size: int, ranks_per_node: int) -> bool:
    """Whether every group of ``group_size`` consecutive ranks (a Ulysses group, the context-parallel ranks, the FSDP
    ranks: the mesh's inner axes) lies inside one node of ``ranks_per_node`` consecutive ranks (launchers number a
    node's ranks consecutively)."""
    return ranks_per_node % group_size == 0


def check_ulysses_inside_nodes(ulysses: int, ranks_per_node: int, *, ranks: str = "processes") -> None:
    """A Ulysses group's all-to-all runs in every attention layer: its ``ulysses`` adjacent ranks must share a node
    of ``ranks_per_node`` (``ranks`` names them in the message: processes, GPUs)."""
    if not groups_inside_nodes(ulysses, ranks_per_node):
        raise ValueError(
            f"parallel.ulysses={ulysses} does not divide the {ranks_per_node} {ranks} per node, so a Ulysses group "
            f"spans two nodes and its all-to-all crosses the inter-node network: choose a ulysses degree that "
            f"divides {ranks_per_node} and move the rest to parallel.ring (or set parallel.ulysses_across_nodes=warn)"
        )


def check_activation_offload(offload: bool, checkpointing: str) -> None:
    """Activation offload moves what checkpointed layers keep to host memory: it needs checkpointed layers."""
    if offload and checkpointing == "none":
        raise ValueError(
            "parallel.activation_offload=true moves the inputs that checkpointed layers keep to host memory, but "
            "parallel.activation_checkpointing=none checkpoints no layer: set parallel.activation_checkpointing=full "
            "(or selective), or parallel.activation_offload=false"
        )


def check_pipeline(
    pp: int,
    schedule: str,
    stages_per_rank: int,
    split_points: Sequence[str],
    num_layers: int,
    microbatches: int,
    *,
    tied_embeddings: bool = False,
) -> None:
    """A pipeline that can run: a known schedule with its number of stages per rank, at least one layer per stage,
    enough micro-batches (``microbatches`` = rows per optimizer step, ``data.batch_size × train.grad_accum``), no
    tied embeddings (first and last stage cannot share a tensor)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} must be one of {SCHEDULES}")
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs one stage per rank, but parallel.pp_stages_per_rank="
            f"{stages_per_rank}: set it to 1, or choose an interleaved schedule ({', '.join(LOOPED_SCHEDULES)})"
        )
    if schedule in LOOPED_SCHEDULES and stages_per_rank < 2:
        raise ValueError(
            f"parallel.pp_schedule={schedule} interleaves several stages per rank: set parallel.pp_stages_per_rank "
            f">= 2 (it is {stages_per_rank})"
        )
    if schedule in V_SCHEDULES and stages_per_rank != 2:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs exactly 2 stages per rank: set parallel.pp_stages_per_rank=2 "
            f"(it is {stages_per_rank})"
        )
    num_stages = pp * stages_per_rank
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages (parallel.pp={pp} x parallel.pp_stages_per_rank={stages_per_rank}) "
            f"but the model has only {num_layers} layers: every stage needs at least one layer; lower parallel.pp "
            f"or parallel.pp_stages_per_rank"
        )
    stage_layers(num_layers, num_stages, split_points)  # raises for bad split points
    if schedule in ("1F1B", "DualPipeV") and microbatches < num_stages:
        raise ValueError(
            f"parallel.pp_schedule={schedule} needs at least as many micro-batches as stages ({num_stages}), but a "
            f"step has {microbatches} (data.batch_size x train.grad_accum rows): raise data.batch_size or "
            f"train.grad_accum, or use GPipe"
        )
    rounds = max(1, microbatches // pp)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and microbatches % rounds:
        raise ValueError(
            f"parallel.pp_schedule={schedule} runs micro-batches in rounds of parallel.pp={pp}: a step's "
            f"{microbatches} micro-batches (data.batch_size x train.grad_accum rows) must be a multiple of "
            f"{rounds}; use a multiple of {pp}"
        )
    if tied_embeddings:
        raise ValueError(
            f"parallel.pp={pp} with tied input and output embeddings: the first stage holds the embeddings and the "
            f"last the LM head, which cannot share one tensor; set parallel.pp=1 (or untie them: "
            f"model.tie_word_embeddings=false)"
        )


def stage_layers(num_layers: int, num_stages: int, split_points: Sequence[str] = ()) -> list[range]:
    """The decoder layers of each pipeline stage. ``split_points`` name the first layer of every stage after the
    first (``["model.layers.6", "model.layers.12"]``); none = balanced by count (earlier stages take the
    remainder)."""
    if not split_points:
        sizes = [num_layers // num_stages + (stage < num_layers % num_stages) for stage in range(num_stages)]
        starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    else:
        if len(split_points) != num_stages - 1:
            raise ValueError(
                f"parallel.pp_split_points has {len(split_points)} entries but {num_stages} stages need "
                f"{num_stages - 1}: name the first layer of every stage after the first, e.g. "
                f"[{LAYER_PREFIX}{num_layers // num_stages}, ...]"
            )
        starts = [0]
        for point in split_points:
            index = point.removeprefix(LAYER_PREFIX)
            if not point.startswith(LAYER_PREFIX) or not index.isdigit() or not 0 < int(index) < num_layers:
                raise ValueError(
                    f"parallel.pp_split_points entry {point!r} is not a decoder layer: use {LAYER_PREFIX}<i> with "
                    f"0 < i < {num_layers}"
                )
            if int(index) <= starts[-1]:
                raise ValueError(
                    f"parallel.pp_split_points {list(split_points)} must name increasing layers (every stage "
                    f"needs at least one layer)"
                )
            starts.append(int(index))
    return [range(start, end) for start, end in zip(starts, [*starts[1:], num_layers])]


def check_expert_adapters(experts: bool, ep: int) -> None:
    """LoRA adapters on the expert weights (``experts``: ``model.lora.target_parameters``) need every expert on each
    rank: peft holds every expert's adapters in one matrix and adds their update to the whole expert weight, which
    expert parallelism splits over ``ep`` ranks."""
    if experts and ep > 1:
        raise ValueError(
            f"model.lora.target_parameters with parallel.ep={ep}: peft holds every expert's adapters in one matrix "
            f"and adds them to the whole expert weight, which expert parallelism splits over ranks; set parallel.ep=1, "
            f"or model.lora.target_parameters=[] (adapters on attention only)"
        )


def check_expert_parallel(ep: int, dp_cp: int, num_experts: int | None = None, *, setting: str = "parallel.ep") -> None:
    """Expert parallelism spreads each MoE layer's ``num_experts`` experts over ``ep`` ranks drawn from the ``dp_cp``
    ranks FSDP shards over (dp × ring × ulysses): ``ep`` divides both; ``num_experts`` 0 is a dense model (no EP);
    None: the model is not known yet."""
    if ep < 1:
        raise ValueError(f"{setting}={ep} must be >= 1 (1 = every rank holds every expert)")
    if dp_cp % ep:
        raise ValueError(
            f"{setting}={ep} does not divide dp x ring x ulysses = {dp_cp}, the ranks EP draws from: choose an ep "
            f"that divides {dp_cp}"
        )
    if num_experts is None or ep == 1:
        return
    if num_experts == 0:
        raise ValueError(
            f"{setting}={ep} needs a mixture-of-experts model, and this one has no experts: set {setting}=1"
        )
    if num_experts % ep:
        raise ValueError(
            f"{setting}={ep} does not divide the model's {num_experts} experts: choose an ep that divides {num_experts}"
        )
