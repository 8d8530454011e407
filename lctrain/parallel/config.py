"""The ``parallel`` section of a job's config: the mesh's degrees, the sequence layout, and the memory and precision
policy, each field checked when the section is made. Importing this module loads neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

from lctrain.parallel.dims import ParallelDims
from lctrain.rules import check_activation_offload, check_kernel_choice

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ParallelConfig:
    """Degrees of the 4D mesh (their product is the world size), the sequence layout, and memory/precision policy."""

    pp: int = 1  # pipeline-parallel ranks (each holds pp_stages_per_rank stages of consecutive layers)
    dp: int = 1  # data parallel: different batches
    ring: int = 1  # ring attention: sequence chunks passed peer to peer (spans nodes)
    ulysses: int = 1  # Ulysses all-to-all: heads <-> sequence (inside a node)
    ulysses_across_nodes: str = "error"  # a Ulysses group spanning two nodes: error (refuse the mesh) or warn
    layout: str = "zigzag"  # zigzag (balanced causal work) or contiguous
    # attention kernel: auto (per device and case) or cudnn, flash_attn3, flash_attn, torch_cuda_flash,
    # torch_cpu_flash, reference (first choice; cases it cannot do fall back)
    attention_kernel: str = "auto"
    activation_checkpointing: str = "none"  # none, full (every decoder layer) or selective (every ac_every-th)
    ac_every: int = 2  # selective: checkpoint layers 0, ac_every, 2·ac_every, ...
    activation_offload: bool = False  # checkpointed layers keep their input in host memory (needs checkpointing)
    mlp_chunk_tokens: int = 0  # MLP over this many tokens at a time, each chunk recomputed in backward; 0 = off
    # FSDP2's CPU offload: sharded fp32 parameters, gradients and AdamW states in (pinned) host memory, the optimizer
    # step on the CPU; the device holds only the gathered parameters and the activations
    cpu_offload: bool = False
    param_dtype: str = "auto"  # compute dtype of the FSDP all-gathered params; auto = bfloat16 on CUDA, float32 on CPU
    reduce_dtype: str = "float32"  # dtype of the gradient reduce-scatter
    # pp > 1: a step's rows (data.batch_size x train.grad_accum) are the micro-batches of one schedule run
    # GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 1  # 1 (GPipe, 1F1B), >= 2 (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble), 2 (V)
    pp_split_points: list[str] = field(default_factory=list)  # first layer of each later stage; [] = balanced

    def dims(self) -> ParallelDims:
        """The mesh's degrees and the sequence layout, as one checked object."""
        return ParallelDims(self.pp, self.dp, self.ring, self.ulysses, layout=self.layout)

    def __post_init__(self) -> None:
        self.dims()  # degrees >= 1, a known layout
        check_kernel_choice(self.attention_kernel, setting="parallel.attention_kernel")
        if self.ulysses_across_nodes not in ("error", "warn"):
            raise ValueError(f"parallel.ulysses_across_nodes={self.ulysses_across_nodes!r} must be error or warn")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(
                f"parallel.activation_checkpointing={self.activation_checkpointing!r} must be one of "
                f"{ACTIVATION_CHECKPOINTING}"
            )
        if self.ac_every < 1:
            raise ValueError(f"parallel.ac_every={self.ac_every} must be >= 1")
        check_activation_offload(self.activation_offload, self.activation_checkpointing)
        if self.mlp_chunk_tokens < 0:
            raise ValueError(f"parallel.mlp_chunk_tokens={self.mlp_chunk_tokens} must be >= 0 (0 = no chunking)")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"parallel.{name}={getattr(self, name)!r} must be one of {DTYPES}")
