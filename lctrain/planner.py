"""``python -m lctrain plan``: choose a (pp, dp, ring, ulysses) layout for a model, a sequence length and a cluster.

For every layout whose degrees multiply to the number of GPUs and that lctrain accepts (the checks of
``lctrain.config.check_job``, mirrored in ``layout_problems``), the planner estimates

- the peak memory per GPU, term by term (``MemoryEstimate``): sharded parameters, gradients and AdamW states; the
  parameters FSDP gathers; the activations kept for the backward; the recomputed layer; one layer's backward
  working set; the chunked loss;
- one ring step (``RingStep``): the attention a GPU computes while K/V (in the backward also dK/dV) travel one
  hop, and whether the transfer hides behind it, the design's S/P ≥ C/W: compute per step grows with (S/R)²,
  bytes with S/R, so it hides once S/R ≥ ``threshold_tokens`` (a constant of the model times C/W);
- the time of one optimizer step (``StepTime``): FLOPs at an assumed fraction of peak, plus what communication
  cannot hide.

It recommends one layout (``recommend``) and can write it as a recipe (``recipe_text``). ``docs/planner.md`` derives
every term, lists the assumptions and the estimate's error against peaks measured on CPU
(``benchmarks/validate_planner.py``). Pure arithmetic: importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

GIB = 2**30
FP32 = 4  # bytes of the fp32 master weights, gradients, optimizer states, accumulators and logits
STATE_BYTES = 4 + 4 + 8  # per parameter, FSDP-sharded: fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
BACKWARD_FLOPS_RATIO = 2.5  # attention backward / forward FLOPs (flash backward: 5 matmuls vs 2, scores recomputed)
NEAR_BEST = 0.03  # layouts within this fraction of the best estimated throughput count as equally fast
AC_CHOICES = ("auto", "none", "selective", "full")
# activation checkpointing tried by --activation-checkpointing auto, least recomputation first: (mode, ac_every)
AUTO_AC = (("none", 1), ("selective", 4), ("selective", 2), ("full", 1))


# ---------------------------------------------------------------------------------------------------------------
# Inputs: the model, the hardware, the workload, a layout
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a Llama-style decoder (Llama, Mistral, Qwen2) that memory, FLOPs and bytes depend on."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int
    tied: bool = False  # the LM head shares the input embedding
    family: str = "llama"
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2; Llama with attention_bias)
    o_bias: bool = False  # the output projection has a bias (Llama with attention_bias)
    mlp_bias: bool = False
    rope_theta: float | None = None
    path: str | None = None  # a Hugging Face model directory (the recipe then uses model=hf)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q, k, v, o projections, gate/up/down MLP, two RMSNorm weights."""
        h, q, kv, inter = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attention = 2 * h * q + 2 * h * kv + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * inter + (2 * inter + h) * self.mlp_bias
        return attention + mlp + 2 * h

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head (none of its own when tied to the embeddings)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        """All parameters, as ``sum(p.numel() for p in model.parameters())`` counts them (tied ones once)."""
        return self.embed_params + self.layers * self.layer_params + self.hidden + self.head_params

    @classmethod
    def from_hf_config(cls, config: dict, *, name: str, path: str | None = None) -> ModelSpec:
        """From a Hugging Face ``config.json`` (Llama, Mistral or Qwen2 field names)."""
        missing = [
            key
            for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if key not in config
        ]
        if missing:
            raise ValueError(f"{name}: config.json has no {', '.join(missing)}: is it a Llama-style decoder?")
        heads = config["num_attention_heads"]
        family = config.get("model_type", "llama")
        attention_bias = bool(config.get("attention_bias", False))
        return cls(
            name=name,
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            vocab=config["vocab_size"],
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            tied=bool(config.get("tie_word_embeddings", False)),
            family=family,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(config.get("mlp_bias", False)),
            rope_theta=config.get("rope_theta"),
            path=path,
        )


def _named(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw) -> ModelSpec:
    return ModelSpec(name, hidden, inter, layers, heads, kv, vocab, hidden // heads, **kw)


# Published sizes (the models' config.json files). `tiny` is recipes/tiny_cpu.yaml with the default tokenizer.
NAMED_MODELS = {
    model.name: model
    for model in (
        _named("tiny", 128, 352, 4, 4, 2, 8192, rope_theta=10000.0),
        _named("llama3.2-1b", 2048, 8192, 16, 32, 8, 128256, tied=True, rope_theta=500000.0),
        _named("llama3.2-3b", 3072, 8192, 28, 24, 8, 128256, tied=True, rope_theta=500000.0),
        _named("llama3-8b", 4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0),
        _named("llama3-70b", 8192, 28672, 80, 64, 8, 128256, rope_theta=500000.0),
        _named("llama2-7b", 4096, 11008, 32, 32, 32, 32000, rope_theta=10000.0),
        _named("llama2-13b", 5120, 13824, 40, 40, 40, 32000, rope_theta=10000.0),
    )
}


def load_model(spec: str) -> ModelSpec:
    """A named size (``NAMED_MODELS``), a Hugging Face model directory, or the path of its ``config.json``."""
    if spec in NAMED_MODELS:
        return NAMED_MODELS[spec]
    path = Path(spec)
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise ValueError(
            f"--model {spec!r} is neither a named size ({', '.join(NAMED_MODELS)}) nor a Hugging Face model "
            f"directory with a config.json"
        )
    model_dir = config_file.parent.resolve()
    return ModelSpec.from_hf_config(json.loads(config_file.read_text()), name=model_dir.name, path=str(model_dir))


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are per GPU and per direction, in GB/s (1e9 bytes)."""

    name: str
    tflops: float  # dense peak for the compute dtype (bf16 on GPUs)
    mem_gib: float  # device memory
    intra_gbps: float  # inside a node (NVLink)
    inter_gbps: float  # between nodes (InfiniBand/RoCE, the NIC share of one GPU)
    device: str = "cuda"


# Vendor figures: H100/H200 SXM 989 TFLOP/s dense bf16, NVLink 4 900 GB/s both directions (450 each), one 400 Gb/s
# NIC per GPU (50 GB/s); A100 SXM 312 TFLOP/s, NVLink 3 600 GB/s (300 each), 200 Gb/s per GPU (25 GB/s). Memory as
# the driver reports it (81559 MiB for H100 80GB, 143771 MiB for H200, 81920 MiB for A100 80GB). `cpu` only sizes
# memory (the validation on this machine); its speeds are placeholders.
HARDWARE = {
    hw.name: hw
    for hw in (
        Hardware("h100", 989.0, 79.6, 450.0, 50.0),
        Hardware("h200", 989.0, 140.4, 450.0, 50.0),
        Hardware("a100", 312.0, 80.0, 300.0, 25.0),
        Hardware("cpu", 0.1, 24.0, 2.0, 1.0, device="cpu"),
    )
}


@dataclass(frozen=True)
class Workload:
    """What one optimizer step runs, and the efficiency assumptions of the time model."""

    seq_len: int
    gpus_per_node: int
    nodes: int = 1
    batch: int = 1  # rows per dp rank per step (data.batch_size x train.grad_accum; pipeline micro-batches)
    dtype_bytes: int = 2  # compute dtype of gathered parameters and activations: 2 (bf16) or 4 (fp32)
    loss_chunk_tokens: int = 1024  # train.loss_chunk_tokens
    mlp_chunk_tokens: int = 0  # parallel.mlp_chunk_tokens (0 = off)
    offload: bool = False  # parallel.activation_offload (checkpointed layers' inputs in host memory)
    mfu: float = 0.4  # achieved fraction of peak FLOP/s, for matmuls and attention alike
    link_efficiency: float = 0.8  # achieved fraction of the nominal link bandwidths
    headroom: float = 0.15  # fraction of device memory kept free (allocator fragmentation, CUDA context, NCCL)
    device: str = "cuda"  # cuda or cpu (offload is a no-op on cpu: activations already live in host memory)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Layout:
    """A mesh (its degrees multiply to the world size) and the activation checkpointing that goes with it."""

    pp: int
    dp: int
    ring: int
    ulysses: int
    ac: str = "none"  # parallel.activation_checkpointing: none, selective or full
    ac_every: int = 2  # parallel.ac_every (selective)

    @property
    def shard(self) -> int:
        """The FSDP mesh dp × ring × ulysses (parameters are sharded over it)."""
        return self.dp * self.ring * self.ulysses

    def checkpointed(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) is checkpointed (``apply_activation_checkpointing``)."""
        if self.ac == "none":
            return False
        return layer % (1 if self.ac == "full" else self.ac_every) == 0

    def mesh(self) -> str:
        return f"pp={self.pp} dp={self.dp} ring={self.ring} ulysses={self.ulysses}"

    def ac_label(self) -> str:
        return f"selective/{self.ac_every}" if self.ac == "selective" else self.ac


def stage_layer_ranges(layers: int, pp: int) -> list[range]:
    """Decoder layers of each pipeline stage, balanced by count, earlier stages taking the remainder (as
    ``lctrain.parallel.pipeline.stage_layers`` without split points)."""
    sizes = [layers // pp + (stage < layers % pp) for stage in range(pp)]
    starts = [sum(sizes[:stage]) for stage in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


def kv_width(model: ModelSpec, ulysses: int) -> int:
    """K (or V) elements per local token that attention keeps and the ring sends: after the Ulysses all-to-all a GPU
    holds S/R tokens of max(Hkv/U, 1) heads, i.e. max(Hkv, U)·D per local token (KV heads are replicated U/Hkv
    times when U > Hkv, never expanded to Hq)."""
    return model.head_dim * (max(model.kv_heads, ulysses) if ulysses > 1 else model.kv_heads)


def layer_activation_bytes(model: ModelSpec, e: int, ulysses: int, *, mlp_chunked: bool = False) -> int:
    """Bytes per local token that one decoder layer keeps for its backward when it is not checkpointed.

    Counted from what autograd saves in the Hugging Face Llama layer patched with USP attention:
    - each RMSNorm: its input in fp32 (a copy for bf16), the normalized value and its output (kept by the next
      matmuls) in the compute dtype, and the fp32 rsqrt;
    - attention: q, k, v and the output (plus the output after the all-to-all back when U > 1, a separate tensor
      that o_proj keeps), and the fp32 log-sum-exp per head;
    - MLP: gate, SiLU(gate), up and their product, each [tokens, intermediate] (none with a chunked MLP, which
      keeps only its input, the norm's output).
    """
    h, q, inter = model.hidden, model.q_dim, model.intermediate
    norms = 2 * (h * (FP32 + 2 * e) + FP32)
    attention = q * e * (3 if ulysses > 1 else 2) + 2 * kv_width(model, ulysses) * e + model.heads * FP32
    mlp = 0 if mlp_chunked else 4 * inter * e
    return norms + attention + mlp


def layer_backward_bytes(model: ModelSpec, e: int, ring: int, ulysses: int, *, mlp_chunked: bool = False) -> int:
    """Bytes per local token one layer's backward allocates beyond what the layer kept, besides the incoming
    gradient: the larger of the MLP part (at the product's backward: the gradients of SiLU(gate) and of up, while
    the product's gradient replaces the freed product) and the attention part (the gradient of the output, the
    dq/dk/dv blocks, the fp32 dq accumulator, with a ring the double-buffered K/V and fp32 dK/dV in flight, with
    Ulysses the all-to-all send/receive buffers)."""
    h, q = model.hidden, model.q_dim
    kv = kv_width(model, ulysses)
    mlp = h * e + (0 if mlp_chunked else 2 * model.intermediate * e)
    attention = h * e + q * e + (q + 2 * kv) * e + (q * FP32 if e != FP32 else 0)
    if ring > 1:
        attention += 2 * (2 * kv) * e + 2 * (2 * kv) * FP32
    if ulysses > 1:
        attention += 2 * q * e
    return max(mlp, attention)


@dataclass
class MemoryEstimate:
    """Peak bytes per GPU on the stage that needs the most, split into terms that coexist at that peak."""

    states: float  # FSDP-sharded fp32 weights and AdamW states (and the gradients, at the end of the step)
    gathered: float  # parameters FSDP holds unsharded (compute dtype), and unsharded gradients in the backward
    activations: float  # what the layers (and the final norm) keep for the backward, for every micro-batch in flight
    recompute: float  # one checkpointed layer's activations, rebuilt in the backward
    backward: float  # one layer's backward working set (gradients, ring buffers, all-to-all buffers)
    loss: float  # the chunked loss: logits of one chunk, the LM head's gradient
    phase: str  # where the peak is: forward (in the loss), backward (the last layer's), grads or optimizer (the end)
    stage: int  # the pipeline stage (0 when pp = 1)

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.recompute + self.backward + self.loss

    def gib(self) -> dict[str, float | str | int]:
        terms = {k: v / GIB for k, v in asdict(self).items() if isinstance(v, float)}
        return {**terms, "total": self.total / GIB, "phase": self.phase, "stage": self.stage}


def stage_memory(model: ModelSpec, layout: Layout, work: Workload) -> list[MemoryEstimate]:
    """The peak memory per GPU (bytes) of each pipeline stage: the largest of three moments of a step (see
    ``docs/planner.md``):

    - forward, in the loss: weights and AdamW states, gathered parameters, every kept activation, the loss's buffers;
    - backward, in the last layer's backward: the same less the loss's forward buffers, plus the recomputed layer,
      the layer's backward working set and the LM head's gradient;
    - grads, the end of the backward: activations are gone, the sharded gradients exist, the unsharded gradients
      of the root (embeddings, head; with pp > 1 all the stage's layers) are reduce-scattered;
    - optimizer: AdamW's step (on CUDA its foreach implementation holds one fp32 temporary per parameter).

    Sharded gradients exist only from the reduce-scatters on (``zero_grad(set_to_none=True)`` frees them every
    step), so the first two moments count 12 of the 16 bytes of state per parameter.
    """
    e = work.dtype_bytes
    tokens = work.seq_len // (layout.ring * layout.ulysses)  # local tokens of one row on one GPU
    chunked = work.mlp_chunk_tokens > 0
    full = layer_activation_bytes(model, e, layout.ulysses, mlp_chunked=chunked)
    kept_input = 0 if (work.offload and work.device == "cuda") else model.hidden * e  # a checkpointed layer's input
    h, vocab, layer = model.hidden, model.vocab, model.layer_params
    cast = FP32 if e != FP32 else 0  # an unsharded gradient cast to fp32 for the reduce-scatter
    estimates = []
    for index, layers in enumerate(stage_layer_ranges(model.layers, layout.pp)):
        first, last = index == 0, index == layout.pp - 1
        root = (model.embed_params if first else 0) + ((model.head_params + h) if last else 0)
        stage_params = len(layers) * layer + root
        live_states = stage_params * (STATE_BYTES - FP32) / layout.shard  # fp32 weights, AdamW exp_avg, exp_avg_sq
        if layout.pp == 1:  # layers resharded after forward: the current and the prefetched one are gathered
            gathered_fwd = root * e + 2 * layer * e
            gathered_bwd = gathered_fwd + layer * (e + cast)  # + a layer's unsharded gradient
            unsharded_grads = root * (e + cast)
        else:  # a stage keeps its layers gathered, and their gradients unsharded, for the whole step
            gathered_fwd = (root + len(layers) * layer) * e
            gathered_bwd = gathered_fwd + len(layers) * layer * e + layer * cast
            unsharded_grads = stage_params * e + max(root, layer) * cast
        in_flight = 1 if layout.pp == 1 else min(work.batch, layout.pp - index)  # 1F1B warm-up depth
        per_token = sum(kept_input if layout.checkpointed(i) else full for i in layers)
        per_token += 2 * model.head_dim * e + 3 * 8  # RoPE cos/sin, shared by the layers; ids, labels, positions
        final_norm = h * (FP32 + e) + FP32 if last else 0  # the final norm's fp32 input, normalized value, rsqrt
        per_token += final_norm
        if not first:
            per_token += h * e  # the activations received from the previous stage
        activations = in_flight * tokens * per_token
        activations_bwd = activations - tokens * final_norm  # its backward ran before the last layer's
        # the rebuilt layer; in fp32 its first norm keeps the layer's input itself, which the checkpoint holds already
        rebuilt = full - (h * FP32 if e == FP32 else 0)
        recompute = tokens * rebuilt if any(layout.checkpointed(i) for i in layers) else 0
        backward = tokens * layer_backward_bytes(model, e, layout.ring, layout.ulysses, mlp_chunked=chunked)
        if chunked:  # one MLP chunk rebuilt in the backward (gate, SiLU, up, product) with two gradients
            backward += min(work.mlp_chunk_tokens, tokens) * 6 * model.intermediate * e
        loss_fwd = loss_bwd = 0
        if last:
            chunk = min(work.loss_chunk_tokens, tokens)
            # fp32 logits of a chunk and logsumexp's temporary, plus the previous chunk's logits (still referenced
            # while the next are computed) when there are several chunks; beside them the fp32 accumulator of the
            # head's gradient, later cast to the compute dtype; the loss's input and its gradient
            logits = (3 if tokens > chunk else 2) * chunk * vocab * FP32
            head_grad = vocab * h * (FP32 + (e if e != FP32 else 0))
            loss_fwd = max(logits + vocab * h * FP32, head_grad) + 2 * tokens * h * e
            loss_bwd = vocab * h * e  # the head's unsharded gradient, until the root's reduce-scatter
        states = stage_params * STATE_BYTES / layout.shard
        optimizer_temp = FP32 if work.device == "cuda" else 0  # foreach AdamW: one fp32 temporary per parameter
        phases = {
            "forward": (live_states, gathered_fwd, activations, 0, 0, loss_fwd),
            "backward": (live_states, gathered_bwd, activations_bwd, recompute, backward, loss_bwd),
            "grads": (states, gathered_fwd + unsharded_grads, 0, 0, 0, 0),
            "optimizer": (states + stage_params * optimizer_temp / layout.shard, 0, 0, 0, 0, 0),
        }
        phase = max(phases, key=lambda name: sum(phases[name]))
        estimates.append(MemoryEstimate(*(float(term) for term in phases[phase]), phase, index))
    return estimates


def estimate_memory(model: ModelSpec, layout: Layout, work: Workload) -> MemoryEstimate:
    """The peak memory per GPU: that of the pipeline stage that needs the most."""
    return max(stage_memory(model, layout, work), key=lambda estimate: estimate.total)


# ---------------------------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------------------------


def _inside_nodes(group_size: int, gpus_per_node: int) -> bool:
    """Whether every group of ``group_size`` consecutive ranks lies inside one node."""
    return group_size <= gpus_per_node and gpus_per_node % group_size == 0


@dataclass
class RingStep:
    """One ring step of one layer on one GPU: compute (attention of half an (S/R)² block for its heads) against
    the transfer of the next K/V piece (forward) and of K/V plus the fp32 dK/dV accumulators (backward)."""

    link: str  # "intra" (the ring lies inside a node: NVLink), "inter" (it spans nodes: network) or "none"
    tokens_per_rank: int  # S/R: the piece a ring rank holds after the Ulysses all-to-all
    threshold_tokens: float  # S/R from which communication hides (forward and backward)
    compute_fwd_s: float
    comm_fwd_s: float
    compute_bwd_s: float
    comm_bwd_s: float

    @property
    def hidden(self) -> bool:
        return self.compute_fwd_s >= self.comm_fwd_s and self.compute_bwd_s >= self.comm_bwd_s


def flops_rate(hw: Hardware, work: Workload) -> float:
    return hw.tflops * 1e12 * work.mfu


def ring_step(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload) -> RingStep:
    """Compute vs communication of one ring step (see the module doc and ``docs/planner.md``)."""
    ring, ulysses, e = layout.ring, layout.ulysses, work.dtype_bytes
    piece = work.seq_len // ring
    if ring == 1:
        return RingStep("none", piece, 0.0, 0.0, 0.0, 0.0, 0.0)
    inside = _inside_nodes(ring * ulysses, work.gpus_per_node)
    link = "intra" if inside else "inter"
    bandwidth = (hw.intra_gbps if inside else hw.inter_gbps) * 1e9 * work.link_efficiency
    rate = flops_rate(hw, work)
    kv_elements = piece * kv_width(model, ulysses) / ulysses  # S/R tokens × max(Hkv/U, 1) heads × D
    pairs = piece * piece / 2  # zigzag: every step is the same half (S/R)² block
    flops_fwd = 4 * model.head_dim * (model.heads / ulysses) * pairs
    # hides when S/R ≥ max(Hkv, U)/Hq · max(e, (e + 4)/2.5) · C/W (forward: K, V in e; backward adds fp32 dK, dV)
    threshold = (
        max(model.kv_heads, ulysses) / model.heads * max(e, (e + FP32) / BACKWARD_FLOPS_RATIO) * rate / bandwidth
    )
    return RingStep(
        link=link,
        tokens_per_rank=piece,
        threshold_tokens=threshold,
        compute_fwd_s=flops_fwd / rate,
        comm_fwd_s=2 * kv_elements * e / bandwidth,
        compute_bwd_s=BACKWARD_FLOPS_RATIO * flops_fwd / rate,
        comm_bwd_s=2 * kv_elements * (e + FP32) / bandwidth,
    )


def flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token, as ``lctrain.train.metrics.flops_per_token`` counts them for MFU."""
    return 6 * model.num_params + 6 * model.layers * model.hidden * seq_len


@dataclass
class StepTime:
    """One optimizer step on the busiest GPU, in seconds."""

    compute_s: float  # FLOPs (with recomputation) at mfu × peak
    ring_exposed_s: float  # ring transfers longer than the attention they overlap
    ulysses_s: float  # the all-to-alls (not overlapped: attention waits for them)
    fsdp_exposed_s: float  # parameter all-gathers and gradient reduce-scatters beyond the compute they overlap
    bubble_s: float  # pipeline idle time, (pp − 1)/m of the stage's work (1F1B)
    tokens_per_step: int  # dp × batch × seq_len
    model_flops: float  # per GPU per step, ``flops_per_token`` (no recomputation), as the trainer's MFU counts
    peak_flops: float  # per GPU, FLOP/s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.ring_exposed_s + self.ulysses_s + self.fsdp_exposed_s + self.bubble_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        """The MFU the trainer would report at this step time."""
        return self.model_flops / (self.total_s * self.peak_flops)


def step_time(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload, ring: RingStep) -> StepTime:
    e, rows = work.dtype_bytes, work.batch
    cp = layout.ring * layout.ulysses
    layers = max(len(r) for r in stage_layer_ranges(model.layers, layout.pp))
    recomputed = sum(layout.checkpointed(i) for i in range(model.layers)) / model.layers
    model_flops = rows * work.seq_len * flops_per_token(model, work.seq_len) / (layout.pp * cp)
    compute = model_flops * (1 + recomputed / 3) / flops_rate(hw, work)  # a recomputed forward is 1/3 of the FLOPs
    ring_exposed = 0.0
    if layout.ring > 1:
        fwd = max(0.0, ring.comm_fwd_s - ring.compute_fwd_s) * (1 + recomputed)
        bwd = max(0.0, ring.comm_bwd_s - ring.compute_bwd_s)
        ring_exposed = rows * layers * (layout.ring - 1) * (fwd + bwd)
    ulysses = 0.0
    if layout.ulysses > 1:
        tokens = work.seq_len // cp
        moved = (layout.ulysses - 1) / layout.ulysses
        per_layer = moved * tokens * e * (2 * model.q_dim + 2 * kv_width(model, layout.ulysses))  # q, k, v, out
        ulysses = rows * layers * per_layer * (2 + recomputed) / (hw.intra_gbps * 1e9 * work.link_efficiency)
    fsdp_exposed = 0.0
    if layout.shard > 1:
        stage_params = model.num_params / layout.pp
        gathers = 2 if layout.pp == 1 else 1  # resharded after forward: gathered again for the backward
        volume = stage_params * (gathers * e + FP32) * (layout.shard - 1) / layout.shard
        inside = _inside_nodes(layout.shard, work.gpus_per_node)
        bandwidth = (hw.intra_gbps if inside else hw.inter_gbps) * 1e9 * work.link_efficiency
        fsdp_exposed = max(0.0, volume / bandwidth - compute)
    busy = compute + ring_exposed + ulysses
    bubble = busy * (layout.pp - 1) / rows
    tokens = layout.dp * rows * work.seq_len
    return StepTime(compute, ring_exposed, ulysses, fsdp_exposed, bubble, tokens, model_flops, hw.tflops * 1e12)


# ---------------------------------------------------------------------------------------------------------------
# Layouts: the checks, the estimates, the recommendation
# ---------------------------------------------------------------------------------------------------------------


def layout_problems(model: ModelSpec, layout: Layout, work: Workload) -> list[str]:
    """Why lctrain would refuse this layout (``check_job`` with the default zigzag layout and 1F1B schedule); empty
    if it runs. Memory is judged separately."""
    problems = []
    p, u, r = layout.pp, layout.ulysses, layout.ring
    if work.nodes > 1 and work.gpus_per_node % u:
        problems.append(
            f"ulysses={u} does not divide the {work.gpus_per_node} GPUs per node: a Ulysses group would span nodes"
        )
    if model.heads % u:
        problems.append(f"ulysses={u} does not divide the {model.heads} attention heads")
    if model.kv_heads % u and u % model.kv_heads:
        problems.append(f"ulysses={u} and the {model.kv_heads} key/value heads: neither divides the other")
    if work.seq_len % (2 * r * u):
        problems.append(f"seq_len={work.seq_len} is not divisible by 2·ring·ulysses = {2 * r * u}")
    if p > 1:
        if p > model.layers:
            problems.append(f"pp={p} stages but only {model.layers} layers")
        if work.batch < p:
            problems.append(f"pp={p} (1F1B) needs at least {p} micro-batches per step: --batch {p} or more")
        if model.tied:
            problems.append(f"pp={p} with tied input and output embeddings")
    if work.offload and layout.ac == "none":
        problems.append("activation offload needs activation checkpointing")
    return problems


@dataclass
class Plan:
    layout: Layout
    memory: MemoryEstimate
    ring: RingStep
    time: StepTime
    problems: list[str] = field(default_factory=list)  # why it cannot run (memory included); empty = feasible

    @property
    def feasible(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        ring = {**asdict(self.ring), "hidden": self.ring.hidden}
        time = {**asdict(self.time), "total_s": self.time.total_s, "tokens_per_s": self.time.tokens_per_s}
        time["mfu"] = self.time.mfu
        return {
            "layout": asdict(self.layout),
            "feasible": self.feasible,
            "problems": self.problems,
            "memory_gib": self.memory.gib(),
            "ring_step": ring,
            "step": time,
        }


def usable_bytes(hw: Hardware, work: Workload) -> float:
    return hw.mem_gib * (1 - work.headroom) * GIB


def evaluate(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload) -> Plan:
    """The estimates for one layout, with every reason it cannot run (memory last)."""
    memory = estimate_memory(model, layout, work)
    ring = ring_step(model, layout, hw, work)
    plan = Plan(layout, memory, ring, step_time(model, layout, hw, work, ring), layout_problems(model, layout, work))
    if memory.total > usable_bytes(hw, work):
        plan.problems.append(
            f"needs {memory.total / GIB:.1f} GiB per GPU, more than the {usable_bytes(hw, work) / GIB:.1f} GiB "
            f"usable ({hw.mem_gib:g} GiB less {work.headroom:.0%} headroom)"
        )
    return plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(world: int, *, max_pp: int | None = None, max_dp: int | None = None) -> list[tuple[int, int, int, int]]:
    """Every (pp, dp, ring, ulysses) with pp·dp·ring·ulysses = world (pp ≤ max_pp, dp ≤ max_dp when given)."""
    out = []
    for pp in _divisors(world):
        for ulysses in _divisors(world // pp):
            for ring in _divisors(world // (pp * ulysses)):
                out.append((pp, world // (pp * ulysses * ring), ring, ulysses))
    return [m for m in out if (max_pp is None or m[0] <= max_pp) and (max_dp is None or m[1] <= max_dp)]


def plan_layouts(
    model: ModelSpec,
    hw: Hardware,
    work: Workload,
    *,
    ac: str = "auto",
    ac_every: int = 2,
    max_pp: int | None = None,
    max_dp: int | None = None,
    mesh: tuple[int, int, int, int] | None = None,
) -> list[Plan]:
    """One plan per mesh (or only ``mesh``). With ``ac="auto"`` each mesh gets the least recomputation that fits
    (none, selective every 4th, every 2nd, full); otherwise the given mode."""
    choices = AUTO_AC if ac == "auto" else ((ac, ac_every),)
    if work.offload:
        choices = tuple(c for c in choices if c[0] != "none") or choices
    plans = []
    for pp, dp, ring, ulysses in [mesh] if mesh else meshes(work.world, max_pp=max_pp, max_dp=max_dp):
        candidates = [evaluate(model, Layout(pp, dp, ring, ulysses, mode, every), hw, work) for mode, every in choices]
        runnable = [p for p in candidates if not layout_problems(model, p.layout, work)]
        # the first that fits; else the one that needs least memory; a mesh lctrain refuses: the first choice
        fits = [p for p in runnable if p.feasible]
        plans.append(fits[0] if fits else min(runnable, key=lambda p: p.memory.total) if runnable else candidates[0])
    return plans


def recommend(plans: Sequence[Plan]) -> Plan | None:
    """Among feasible plans whose ring communication hides (or all feasible ones if none hides), those within
    ``NEAR_BEST`` of the best estimated throughput; of these the fewest pipeline stages, then the largest Ulysses
    degree, then the smallest ring (so the largest dp), then the least recomputation."""
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        return None
    pool = [p for p in feasible if p.ring.hidden] or feasible
    best = max(p.time.tokens_per_s for p in pool)
    near = [p for p in pool if p.time.tokens_per_s >= (1 - NEAR_BEST) * best]
    return min(near, key=_preference)


def _preference(plan: Plan) -> tuple:
    layout = plan.layout
    recompute = {"none": 0.0, "selective": 1 / layout.ac_every, "full": 1.0}[layout.ac]
    return (layout.pp, -layout.ulysses, layout.ring, recompute)


def ranked(plans: Sequence[Plan], chosen: Plan | None) -> list[Plan]:
    """The recommendation first, then feasible plans (hidden first, fastest first), then the refused ones."""
    rest = sorted(
        (p for p in plans if p is not chosen),
        key=lambda p: (not p.feasible, not p.ring.hidden, -p.time.tokens_per_s, _preference(p)),
    )
    return ([chosen] if chosen else []) + rest


# ---------------------------------------------------------------------------------------------------------------
# Output: table, JSON, recipe
# ---------------------------------------------------------------------------------------------------------------


def describe(model: ModelSpec, hw: Hardware, work: Workload) -> str:
    dtype = {2: "bf16", 4: "fp32"}[work.dtype_bytes]
    return (
        f"{model.name}: {_count(model.num_params)} parameters, {model.layers} layers, {model.heads}/"
        f"{model.kv_heads} heads, vocab {model.vocab}; seq_len {work.seq_len:,}, {work.batch} row(s) per dp rank "
        f"per step, {dtype}\n{work.nodes} node(s) x {work.gpus_per_node} {hw.name}: {hw.tflops:g} TFLOP/s peak at "
        f"MFU {work.mfu:g}, {hw.mem_gib:g} GiB ({work.headroom:.0%} kept free), intra-node {hw.intra_gbps:g} "
        f"GB/s, inter-node {hw.inter_gbps:g} GB/s per GPU (x{work.link_efficiency:g} achieved)"
    )


PHASES = {"forward": "fwd", "backward": "bwd", "grads": "grads", "optimizer": "optim"}  # the table's "at" column


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def table(plans: Sequence[Plan], chosen: Plan | None, *, top: int, show_refused: bool) -> str:
    header = (
        f"{'':2}{'pp':>3}{'dp':>4}{'ring':>5}{'uly':>4}  {'AC':<12}{'mem GiB':>8} {'states':>7}{'gath':>6}{'act':>7}"
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
            f"{mark}{lay.pp:>3}{lay.dp:>4}{lay.ring:>5}{lay.ulysses:>4}  {lay.ac_label():<12}{mem.total / GIB:>8.1f} "
            f"{gib['states']:>7.1f}{gib['gathered']:>6.1f}{gib['activations']:>7.1f}{gib['recompute']:>7.1f}"
            f"{gib['backward']:>6.1f}{gib['loss']:>6.1f} {PHASES[mem.phase]:<5} {ring_cols}{time.total_s:>9.3g}"
            f"{time.tokens_per_s:>10.4g}{time.mfu:>6.2f}"
        )
        if not plan.feasible:
            lines.append(f"{'':8}refused: {'; '.join(plan.problems)}")
    return "\n".join(lines)


def sbatch_gpus_per_node() -> int:
    """The GPUs per node ``scripts/slurm/train.sbatch`` requests (its ``#SBATCH --gpus-per-node``); 8 if unknown."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "slurm" / "train.sbatch"
    if script.is_file():
        for line in script.read_text().splitlines():
            if line.startswith("#SBATCH --gpus-per-node="):
                return int(line.split("=", 1)[1])
    return 8


def recipe_text(model: ModelSpec, plan: Plan, hw: Hardware, work: Workload, *, name: str, command: str) -> str:
    """A recipe (``recipes/<name>.yaml``) for this plan: Hydra's package line, the exact launch line, a header with
    the hardware and the estimates, then the model, mesh and data settings."""
    lay, mem, ring = plan.layout, plan.memory, plan.ring
    if work.nodes == 1:
        launch = f"torchrun --standalone --nproc-per-node {work.gpus_per_node} -m lctrain train recipe={name}"
    else:  # the script asks slurm for its own number of GPUs per node unless told otherwise
        gpus = "" if work.gpus_per_node == sbatch_gpus_per_node() else f" --gpus-per-node={work.gpus_per_node}"
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
        f"# Estimated peak memory per GPU: {gib['total']:.1f} GiB of {hw.mem_gib:g} (states {gib['states']:.1f}, "
        f"gathered params {gib['gathered']:.1f},",
        f"#   activations {gib['activations']:.1f}, recompute {gib['recompute']:.1f}, backward {gib['backward']:.1f}, "
        f"loss {gib['loss']:.1f}).",
        ring_line,
        f"# About {plan.time.tokens_per_s:.3g} tokens/s at MFU {work.mfu:g} ({plan.time.total_s:.3g} s per step of "
        f"{plan.time.tokens_per_step:,} tokens). How these are estimated: docs/planner.md.",
    ]
    if model.path is not None:
        lines += ["defaults:", "  - override /model: hf", "", "model:", f"  path: {model.path}"]
    else:
        lines += [
            "",
            "model:",
            f"  family: {model.family}",
            f"  hidden_size: {model.hidden}",
            f"  intermediate_size: {model.intermediate}",
            f"  num_layers: {model.layers}",
            f"  num_heads: {model.heads}",
            f"  num_kv_heads: {model.kv_heads}",
            f"  vocab_size: {model.vocab}",
            f"  tie_word_embeddings: {str(model.tied).lower()}",
        ]
        if model.rope_theta is not None:
            lines.append(f"  rope_theta: {model.rope_theta}")
    lines += [
        "",
        "parallel:",
        f"  pp: {lay.pp}",
        f"  dp: {lay.dp}",
        f"  ring: {lay.ring}",
        f"  ulysses: {lay.ulysses}",
        f"  activation_checkpointing: {lay.ac}",
    ]
    if lay.ac == "selective":
        lines.append(f"  ac_every: {lay.ac_every}")
    if lay.pp > 1:
        lines.append("  pp_schedule: 1F1B")
    if work.offload:
        lines.append("  activation_offload: true")
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


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------


def _mesh_arg(text: str) -> tuple[int, int, int, int]:
    parts = text.replace("x", ",").split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: give four positive degrees PP,DP,RING,ULYSSES")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lctrain plan",
        description="Feasible (pp, dp, ring, ulysses) layouts with their estimated memory per GPU, ring-step "
        "compute and communication, whether the communication hides (S/R >= the S/R min column), step time; "
        "recommends one and can write it as a recipe. The model behind every figure: docs/planner.md.",
    )
    p.add_argument("--model", required=True, help=f"a named size ({', '.join(NAMED_MODELS)}) or a HF model directory")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per row (data.seq_len)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", choices=sorted(HARDWARE), default="h100", help="hardware preset (default h100)")
    p.add_argument("--tflops", type=float, help="override: dense peak TFLOP/s per GPU")
    p.add_argument("--mem-gib", type=float, help="override: memory per GPU, GiB")
    p.add_argument("--intra-gbps", type=float, help="override: NVLink GB/s per GPU per direction")
    p.add_argument("--inter-gbps", type=float, help="override: network GB/s per GPU per direction")
    p.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak FLOP/s (default 0.4)")
    p.add_argument("--link-efficiency", type=float, default=0.8, help="achieved fraction of link bandwidth (0.8)")
    p.add_argument("--headroom", type=float, default=0.15, help="fraction of memory kept free (default 0.15)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="compute dtype (default: bf16 on GPUs, fp32 on cpu)")
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
    p.add_argument("--loss-chunk-tokens", type=int, default=1024)
    p.add_argument("--mlp-chunk-tokens", type=int, default=0, help="parallel.mlp_chunk_tokens (0 = off)")
    p.add_argument("--offload", action="store_true", help="parallel.activation_offload (needs checkpointing)")
    p.add_argument("--top", type=int, default=12, help="feasible layouts shown (default 12)")
    p.add_argument("--all", action="store_true", help="also show the refused layouts and why")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--write-recipe", metavar="PATH", help="write the recommended (or --mesh) layout as a recipe")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        model = load_model(args.model)
    except ValueError as error:
        raise SystemExit(f"lctrain plan: {error}") from None
    base = HARDWARE[args.gpu]
    overrides = {"tflops": args.tflops, "mem_gib": args.mem_gib, "intra_gbps": args.intra_gbps}
    overrides["inter_gbps"] = args.inter_gbps
    hw = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    dtype = args.dtype or ("bf16" if hw.device == "cuda" else "fp32")
    for name in ("seq_len", "gpus_per_node", "nodes", "batch", "loss_chunk_tokens", "ac_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"lctrain plan: --{name.replace('_', '-')} must be >= 1")
    work = Workload(
        seq_len=args.seq_len,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        batch=args.batch,
        dtype_bytes=2 if dtype == "bf16" else 4,
        loss_chunk_tokens=args.loss_chunk_tokens,
        mlp_chunk_tokens=args.mlp_chunk_tokens,
        offload=args.offload,
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
    )
    chosen = recommend(plans)
    order = ranked(plans, chosen)
    command = "python -m lctrain plan " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    if args.json:
        report = {
            "model": {**asdict(model), "num_params": model.num_params},
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
            print(f"recommended: {chosen.layout.mesh()}, activation_checkpointing={chosen.layout.ac_label()}")
            if not chosen.ring.hidden:
                print("warning: its ring communication is not hidden behind attention (no feasible layout hides it)")
    if args.write_recipe:
        if chosen is None:
            reasons = "; ".join(plans[0].problems) if args.mesh else "see --all"
            raise SystemExit(f"lctrain plan: no feasible layout to write ({reasons})")
        path = Path(args.write_recipe)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(recipe_text(model, chosen, hw, work, name=path.stem, command=command))
        where = "" if path.resolve().parent.name == "recipes" else " (copy it into recipes/ to launch it by name)"
        print(f"wrote {path}{where}", file=sys.stderr if args.json else sys.stdout)
