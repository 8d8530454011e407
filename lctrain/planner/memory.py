"""Peak memory per GPU, term by term (``docs/planner.md`` derives every term)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lctrain.planner.presets import FP32, GIB, Layout, ModelSpec, Workload
from lctrain.rules import stage_layers

STATE_BYTES = 4 + 4 + 8  # per parameter, FSDP-sharded: fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq


def kv_width(model: ModelSpec, ulysses: int) -> int:
    """K (or V) elements per local token that attention keeps and the ring sends: after the Ulysses all-to-all a GPU
    holds S/R tokens of max(Hkv/U, 1) heads, i.e. max(Hkv, U)·D per local token (KV heads are replicated U/Hkv
    times when U > Hkv, never expanded to Hq)."""
    return model.head_dim * (max(model.kv_heads, ulysses) if ulysses > 1 else model.kv_heads)


def layer_activation_bytes(model: ModelSpec, e: int, ulysses: int, *, mlp_chunked: bool = False, ring: int = 1) -> int:
    """Bytes per local token that one decoder layer keeps for its backward when it is not checkpointed.

    Counted from what autograd saves in the Hugging Face Llama layer patched with USP attention:
    - each RMSNorm: its input in fp32 (a copy for bf16), the normalized value and its output (kept by the next
      matmuls) in the compute dtype, and the fp32 rsqrt;
    - attention: q, k, v and the output (plus the output after the all-to-all back when U > 1, a separate tensor
      that o_proj keeps), and the fp32 log-sum-exp per head; with a ring, the K/V of its last step (up to a
      whole piece), which the backward starts with;
    - MLP: gate, SiLU(gate), up and their product, each [tokens, intermediate] (none with a chunked MLP, which
      keeps only its input, the norm's output);
    - Qwen3's q/k RMSNorms (on this rank's tokens, every head, before any all-to-all): each its input in fp32 (a
      copy for bf16) and the normalized value in the compute dtype, and the fp32 rsqrt per head.
    """
    h, q, inter = model.hidden, model.q_dim, model.intermediate
    norms = 2 * (h * (FP32 + 2 * e) + FP32)
    if model.qk_norm:
        norms += (q + model.kv_dim) * (FP32 + e) + (model.heads + model.kv_heads) * FP32
    kv_pieces = 2 if ring > 1 else 1
    attention = q * e * (3 if ulysses > 1 else 2) + kv_pieces * 2 * kv_width(model, ulysses) * e + model.heads * FP32
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
    phase: str  # where the peak is: forward (in the loss), backward (the last layer's) or grads (the end)
    stage: int  # the pipeline stage (0 when pp = 1)

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.recompute + self.backward + self.loss

    def gib(self) -> dict[str, float | str | int]:
        terms = {k: v / GIB for k, v in asdict(self).items() if isinstance(v, float)}
        return {**terms, "total": self.total / GIB, "phase": self.phase, "stage": self.stage}


def stage_memory(model: ModelSpec, layout: Layout, work: Workload) -> list[MemoryEstimate]:
    """The peak memory per GPU (bytes) of each pipeline stage: the largest of three moments of a step (see
    ``docs/planner.md``; fused AdamW updates in place, so its step adds nothing to the end of the backward):

    - forward, in the loss: weights and AdamW states, gathered parameters, every kept activation, the loss's buffers;
    - backward, in the last layer's backward: the same less the loss's forward buffers, plus the recomputed layer,
      the layer's backward working set and the LM head's gradient;
    - grads, the end of the backward: activations are gone, the sharded gradients exist, the unsharded gradients
      of the root (embeddings, head; with pp > 1 all the stage's layers) are reduce-scattered.

    Sharded gradients exist only from the reduce-scatters on (``zero_grad(set_to_none=True)`` frees them every
    step), so the first two moments count 12 of the 16 bytes of state per parameter. With ``cpu_offload`` on CUDA
    (FSDP2's ``CPUOffloadPolicy``) the sharded states live in host memory and the optimizer steps there: ``states``
    is 0 in every moment (the shard copied to the device for each all-gather is a transient of one layer, within
    the gathered parameters' margin).
    """
    e = work.dtype_bytes
    tokens = work.seq_len // layout.cp  # local tokens of one row on one GPU
    chunked = work.mlp_chunk_tokens > 0
    full = layer_activation_bytes(model, e, layout.ulysses, mlp_chunked=chunked, ring=layout.ring)
    kept_input = 0 if (work.offload and work.device == "cuda") else model.hidden * e  # a checkpointed layer's input
    h, vocab, layer = model.hidden, model.vocab, model.layer_params
    cast = FP32 if e != FP32 else 0  # an unsharded gradient cast to fp32 for the reduce-scatter
    estimates = []
    for index, layers in enumerate(stage_layers(model.layers, layout.pp)):
        first, last = index == 0, index == layout.pp - 1
        root = (model.embed_params if first else 0) + ((model.head_params + h) if last else 0)
        stage_params = len(layers) * layer + root
        live_states = stage_params * (STATE_BYTES - FP32) / layout.dp_cp  # fp32 weights, AdamW exp_avg, exp_avg_sq
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
        states = stage_params * STATE_BYTES / layout.dp_cp
        if work.cpu_offload and work.device == "cuda":  # sharded states and the optimizer step in host memory
            live_states = states = 0
        phases = {
            "forward": (live_states, gathered_fwd, activations, 0, 0, loss_fwd),
            "backward": (live_states, gathered_bwd, activations_bwd, recompute, backward, loss_bwd),
            "grads": (states, gathered_fwd + unsharded_grads, 0, 0, 0, 0),
        }
        phase = max(phases, key=lambda name: sum(phases[name]))
        estimates.append(MemoryEstimate(*(float(term) for term in phases[phase]), phase, index))
    return estimates


def estimate_memory(model: ModelSpec, layout: Layout, work: Workload) -> MemoryEstimate:
    """The peak memory per GPU: that of the pipeline stage that needs the most."""
    return max(stage_memory(model, layout, work), key=lambda estimate: estimate.total)
