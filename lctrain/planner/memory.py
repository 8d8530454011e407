"""Peak memory per GPU, term by term (``docs/planner.md`` derives every term)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lctrain.families import ATTENTION, FAMILIES
from lctrain.planner.presets import FP32, GIB, Layout, ModelSpec, Workload
from lctrain.rules import stage_layers

STATE_BYTES = 4 + 4 + 8  # per parameter, FSDP-sharded: fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
CHUNK = 64  # the chunk of transformers' chunked gated delta rule (torch_chunk_gated_delta_rule), which lctrain runs


@dataclass(frozen=True)
class Lora:
    """``model.lora``: adapters of ``rank`` on every projection of each layer (the default targets; a mixture of
    experts': the attention's), with ``experts`` on its expert weights too (``target_parameters``), and the modules
    trained in full (``trainable``: ``embed_tokens``, ``norm`` (every RMSNorm), ``lm_head``)."""

    rank: int
    trainable: tuple[str, ...] = ()
    experts: bool = False

    def trains(self, module: str) -> bool:
        return module in self.trainable

    def layer_adapter_params(self, model: ModelSpec, layer: int = 0) -> int:
        """Decoder layer ``layer``'s adapter parameters: rank · (in + out) for each projection (a mixture of
        experts': the attention's; a hybrid's gated delta layer: its family's targets among its own projections,
        ``linear_projections``), and with ``experts`` rank · (in + out) for each expert weight of each expert
        (``gate_up_proj`` h -> 2I, ``down_proj`` I -> h: rank · E · (2h + 3I))."""
        h, q, kv, inter = model.hidden, model.q_dim, model.kv_dim, model.intermediate
        experts = model.experts * (2 * h + 3 * model.expert_intermediate) if self.experts else 0
        if model.is_linear(layer):
            shapes = linear_projections(model)
            mixer = sum(sum(shapes[name]) for name in FAMILIES[model.family].lora_targets if name in shapes)
        else:  # q (with the hybrids' gate: 2q wide), o, k, v
            mixer = (h + q * (1 + model.attention_gate)) + (q + h) + (h + kv) * 2
        return self.rank * (mixer + (0 if model.moe else (h + inter) * 3) + experts)

    def adapted_expert_bytes(self, model: ModelSpec, e: int) -> int:
        """What one layer's expert adapters add beside the per-token terms: peft adds each expert's update to the
        weights, a new tensor of the experts' size (``expert_params`` in the compute dtype) that the experts' GEMMs
        keep for the backward, whose gradient is as large again while that layer's backward runs."""
        return model.expert_params * e if self.experts else 0

    def layer_trained_params(self, model: ModelSpec, layer: int = 0) -> int:
        """Decoder layer ``layer``'s trained parameters: its adapters and, with ``norm``, copies of its RMSNorms
        (a gated delta layer's gated norm in place of the q/k norms)."""
        mixer_norms = model.linear_head_dims[1] if model.is_linear(layer) else 2 * model.head_dim * model.qk_norm
        norms = 2 * model.hidden + mixer_norms
        return self.layer_adapter_params(model, layer) + (norms if self.trains("norm") else 0)

    def root_trained_params(self, model: ModelSpec, *, first: bool, last: bool) -> int:
        """The trained copies among the root's modules (embeddings on the first stage, final norm and head on the
        last)."""
        embed = model.embed_params if first and self.trains("embed_tokens") else 0
        norm = model.hidden if last and self.trains("norm") else 0
        head = model.head_params if last and self.trains("lm_head") else 0
        return embed + norm + head


def linear_projections(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """A gated delta layer's projections by transformers' names, (in, out): Qwen3-Next's fused ``in_proj_qkvz`` and
    ``in_proj_ba``, Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; ``out_proj``."""
    h, hv, values = model.hidden, model.linear_heads[1], model.linear_heads[1] * model.linear_head_dims[1]
    return {
        "in_proj_qkvz": (h, model.conv_channels + values),
        "in_proj_ba": (h, 2 * hv),
        "in_proj_qkv": (h, model.conv_channels),
        "in_proj_z": (h, values),
        "in_proj_b": (h, hv),
        "in_proj_a": (h, hv),
        "out_proj": (values, h),
    }


def kv_width(model: ModelSpec, ulysses: int) -> int:
    """K (or V) elements per local token that attention keeps and the ring sends: after the Ulysses all-to-all a GPU
    holds S/R tokens of max(Hkv/U, 1) heads, i.e. max(Hkv, U)·D per local token (KV heads are replicated U/Hkv
    times when U > Hkv, never expanded to Hq)."""
    return model.head_dim * (max(model.kv_heads, ulysses) if ulysses > 1 else model.kv_heads)


def delta_rule_bytes(model: ModelSpec) -> int:
    """Bytes per local token (all of a token's value heads) that one run of transformers' chunked gated delta rule
    keeps, in fp32, as lctrain runs it on a piece (values ``[0 | v]``, w = dk + dv wide, for the piece's summary),
    counted per value head from the tensors autograd saves in it: the queries and keys and their chunked and
    beta-scaled copies, before and after their L2 norm (12 · dk), the values and their chunked, corrected and output
    forms (4 · w), five chunk-by-chunk matrices of each chunk (5 · CHUNK: each token's row of them), norms, beta and
    decay (6), and the state entering each chunk and its decayed copy (2 · dk · w / CHUNK: the recurrent state,
    [dk, w] per head, twice a chunk)."""
    hv, (dk, dv) = model.linear_heads[1], model.linear_head_dims
    w = dk + dv
    return hv * FP32 * (12 * dk + 4 * w + 5 * CHUNK + 6 + 2 * dk * w // CHUNK)


def linear_mixer_bytes(model: ModelSpec, e: int, ulysses: int) -> int:
    """Bytes per local token a gated delta mixer keeps for its backward: the projections' outputs (q, k, v before
    the convolution, z, b, a), the convolution's and SiLU's outputs, the gates g and beta and softplus's input
    (fp32), with Ulysses the all-to-all's q, k, v and gates (and the output back), the chunked rule's tensors
    (``delta_rule_bytes``) and the gated RMSNorm's fp32 input, gate and normalized value and its output, which
    ``out_proj`` keeps. Nothing of it grows with the sequence beyond its own tokens: no K/V."""
    hv, (_, dv) = model.linear_heads[1], model.linear_head_dims
    channels, values = model.conv_channels, hv * dv
    projections = (channels + values + 2 * hv) * e + 2 * channels * e + 3 * hv * FP32
    if ulysses > 1:
        projections += channels * e + 2 * hv * FP32 + values * e
    return projections + delta_rule_bytes(model) + values * (3 * FP32 + e)


def linear_state_bytes(model: ModelSpec, ring: int, ulysses: int, e: int) -> int:
    """Bytes per row one gated delta layer keeps whatever the length: the summaries of every piece of the row
    (zigzag: 2 · ring pieces) gathered over the ring, ``[pieces, Hv/U, dk, dk + dv]`` fp32, the composed states
    entering them, ``[pieces, Hv/U, dk, dv]`` fp32, and the gathered convolution halos,
    ``[pieces, K - 1, channels/U]``."""
    hv, (dk, dv) = model.linear_heads[1], model.linear_head_dims
    pieces, heads = 2 * ring, hv // ulysses
    summaries = pieces * heads * dk * (2 * dk + dv) * FP32
    return summaries + pieces * (model.conv_kernel - 1) * model.conv_channels // ulysses * e


def layer_activation_bytes(
    model: ModelSpec,
    e: int,
    ulysses: int,
    *,
    mlp_chunked: bool = False,
    ring: int = 1,
    lora: Lora | None = None,
    linear: bool = False,
) -> int:
    """Bytes per local token that one decoder layer keeps for its backward when it is not checkpointed.

    Counted from what autograd saves in the Hugging Face Llama layer patched with USP attention:
    - each RMSNorm: its input in fp32 (a copy for bf16), the normalized value and its output (kept by the next
      matmuls) in the compute dtype, and the fp32 rsqrt;
    - attention: q, k, v and the output (plus the output after the all-to-all back when U > 1, a separate tensor
      that o_proj keeps), and the fp32 log-sum-exp per head; with a ring, the K/V of its last step (up to a
      whole piece), which the backward starts with;
    - MLP: gate, SiLU(gate), up and their product, each [tokens, intermediate] (none with a chunked MLP, which
      keeps only its input, the norm's output); a mixture of experts (``lctrain.parallel.expert``) keeps the same
      four for each of a token's k experts ([tokens · k, expert width]), the token's k copies sorted by expert (the
      experts' input), their k outputs (weighted by the router), the router's logits and fp32 probabilities
      ([tokens, experts]) and its top-k weights (fp32) and indices (int64), and the weights' sum that renormalises
      them (Mixtral; Qwen3-MoE with ``norm_topk_prob``, as its checkpoints set it);
    - Qwen3's q/k RMSNorms (on this rank's tokens, every head, before any all-to-all): each its input in fp32 (a
      copy for bf16) and the normalized value in the compute dtype, and the fp32 rsqrt per head.

    With LoRA (``lora``): a frozen norm weight needs no gradient, so its normalized value is not kept; each adapter
    keeps its ``[tokens, rank]`` middle (``lora_B``'s input); the adapted linear layers' inputs are kept by
    ``lora_A`` as they were by the trained weights.

    The hybrids' attention also keeps its output gate (q_proj's gate half, its sigmoid, the gated output: 4 · q).
    ``linear``: a hybrid's gated delta layer, its mixer's bytes (``linear_mixer_bytes``) in place of attention's
    (and of the q/k norms'); a shared expert keeps the MLP's four tensors of its width, its output (multiplied by its
    gate's sigmoid), the gate's logit and sigmoid.
    """
    h, q = model.hidden, model.q_dim
    normalized = 0 if lora is not None and not lora.trains("norm") else e  # kept for the norm weight's gradient
    norms = 2 * (h * (FP32 + e + normalized) + FP32)
    if model.qk_norm and not linear:
        norms += (q + model.kv_dim) * (FP32 + normalized) + (model.heads + model.kv_heads) * FP32
    kv_pieces = 2 if ring > 1 else 1
    attention = q * e * (3 if ulysses > 1 else 2) + kv_pieces * 2 * kv_width(model, ulysses) * e + model.heads * FP32
    attention += 4 * q * e * model.attention_gate  # the gate's half of q_proj's output, its sigmoid, the gated output
    if linear:
        attention = linear_mixer_bytes(model, e, ulysses)
    mlp = 0 if mlp_chunked else 4 * (model.token_mlp_width + model.shared_expert) * e
    mlp += 0 if mlp_chunked or not model.shared_expert else h * e + e + FP32
    if model.moe and not mlp_chunked:
        k = model.experts_per_token
        # the router's logits and probabilities, its top-k (fp32 weights, int64 indices) renormalised (their sum)
        mlp += 2 * k * h * e + model.experts * (e + FP32) + k * (FP32 + 8) + (k + 1) * FP32
    other = ATTENTION if linear else tuple(linear_projections(model)) if model.linear_layers else ()
    # the layers model.lora adapts by default (a hybrid's: those of the layer's kind)
    projections = sum(name not in other for name in FAMILIES[model.family].lora_targets)
    adapters = 0 if lora is None else projections * lora.rank * e
    return norms + attention + mlp + adapters


def layer_backward_bytes(model: ModelSpec, e: int, ring: int, ulysses: int, *, mlp_chunked: bool = False) -> int:
    """Bytes per local token one layer's backward allocates beyond what the layer kept, besides the incoming
    gradient: the larger of the MLP part (at the product's backward: the gradients of SiLU(gate) and of up, while
    the product's gradient replaces the freed product) and the attention part (the gradient of the output, the
    dq/dk/dv blocks, the fp32 dq accumulator, with a ring the double-buffered K/V and fp32 dK/dV in flight, with
    Ulysses the all-to-all send/receive buffers)."""
    h, q = model.hidden, model.q_dim
    kv = kv_width(model, ulysses)
    # a mixture of experts also holds the gradient of the k copies of each token sorted by expert
    mlp = h * e + (0 if mlp_chunked else 2 * model.token_mlp_width * e + 2 * model.experts_per_token * h * e)
    attention = h * e + q * e + (q + 2 * kv) * e + (q * FP32 if e != FP32 else 0)
    if ring > 1:
        attention += 2 * (2 * kv) * e + 2 * (2 * kv) * FP32
    if ulysses > 1:
        attention += 2 * q * e
    # a gated delta layer's: the gradient of its output and of the chunked rule's fp32 tensors, as large again
    linear = h * e + delta_rule_bytes(model) if any(model.linear_layers) else 0
    return max(mlp, attention, linear)


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
    lora = Lora(work.lora_rank, work.lora_trainable, work.lora_experts) if work.lora_rank else None
    adapted = 0 if lora is None else lora.adapted_expert_bytes(model, e)  # per layer, not per token
    full = layer_activation_bytes(model, e, layout.ulysses, mlp_chunked=chunked, ring=layout.ring, lora=lora)
    full_linear = layer_activation_bytes(model, e, layout.ulysses, mlp_chunked=chunked, lora=lora, linear=True)
    state = linear_state_bytes(model, layout.ring, layout.ulysses, e) if any(model.linear_layers) else 0
    kept_input = 0 if (work.offload and work.device == "cuda") else model.hidden * e  # a checkpointed layer's input
    h, vocab, layer = model.hidden, model.vocab, model.layer_params
    cast = FP32 if e != FP32 else 0  # an unsharded gradient cast to fp32 for the reduce-scatter
    # LoRA: the trained parameters (adapters, trained copies) have fp32 states and gradients; the frozen base
    # (every original weight) is stored sharded in the compute dtype, with no gradient and no AdamW state
    trained_of = model.params_of if lora is None else lambda i: lora.layer_trained_params(model, i)
    layer_trained = max(trained_of(i) for i in range(model.layers))  # the largest layer's
    not_here = model.expert_params * (layout.ep - 1) // layout.ep  # a layer's experts held by the other EP ranks
    layer_unit = layer - not_here + (0 if lora is None else layer_trained)  # what FSDP gathers of one layer
    # a layer's unsharded gradient (LoRA on a mixture of experts: no expert weight's gradient, the adapters' only)
    layer_grads = layer_trained - (not_here if lora is None else 0)
    norm_kept = e if lora is None or lora.trains("norm") else 0  # a norm's normalized value, for its weight gradient
    estimates = []
    for index, layers in enumerate(stage_layers(model.layers, layout.pp)):
        first, last = index == 0, index == layout.pp - 1
        root = (model.embed_params if first else 0) + ((model.head_params + h) if last else 0)
        root_trained = root if lora is None else lora.root_trained_params(model, first=first, last=last)
        root_unit = root + (0 if lora is None else root_trained)
        layer_sum = sum(model.params_of(i) for i in layers)
        stage_params = layer_sum + root
        trained_sum = sum(trained_of(i) for i in layers)
        trained = trained_sum + root_trained
        # the stage's layers' unsharded gradients (pp > 1)
        grads_sum = trained_sum - (len(layers) * not_here if lora is None else 0)
        frozen = 0 if lora is None else stage_params
        # fp32 weights, AdamW exp_avg, exp_avg_sq of the trained parameters; the frozen ones
        live_states = (trained * (STATE_BYTES - FP32) + frozen * e) / layout.dp_cp
        if layout.pp == 1:  # layers resharded after forward: the current and the prefetched one are gathered
            gathered_fwd = root_unit * e + 2 * layer_unit * e
            gathered_bwd = gathered_fwd + layer_grads * (e + cast)  # + a layer's unsharded gradient
            unsharded_grads = root_trained * (e + cast)
        else:  # a stage keeps its layers gathered, and their gradients unsharded, for the whole step
            gathered_fwd = (root_unit + len(layers) * layer_unit) * e
            gathered_bwd = gathered_fwd + grads_sum * e + layer_grads * cast
            unsharded_grads = (grads_sum + root_trained) * e + max(root_trained, layer_grads) * cast
        in_flight = 1 if layout.pp == 1 else min(work.batch, layout.pp - index)  # 1F1B warm-up depth
        kinds = {i: full_linear if model.is_linear(i) else full for i in layers}
        per_token = sum(kept_input if layout.checkpointed(i) else kinds[i] for i in layers)
        per_token += 2 * model.head_dim * e + 3 * 8  # RoPE cos/sin, shared by the layers; ids, labels, positions
        final_norm = h * (FP32 + norm_kept) + FP32 if last else 0  # the final norm's fp32 input, [normalized], rsqrt
        per_token += final_norm
        if not first:
            per_token += h * e  # the activations received from the previous stage
        kept_adapted = adapted * sum(not layout.checkpointed(i) for i in layers)  # the adapted expert weights
        kept_states = state * sum(model.is_linear(i) and not layout.checkpointed(i) for i in layers)
        activations = in_flight * (tokens * per_token + kept_adapted + kept_states)
        activations_bwd = activations - tokens * final_norm  # its backward ran before the last layer's
        # the rebuilt layer; in fp32 its first norm keeps the layer's input itself, which the checkpoint holds already
        rebuilt = max((kinds[i] for i in layers if layout.checkpointed(i)), default=0) - (h * FP32 if e == FP32 else 0)
        rebuilt_state = state if any(model.is_linear(i) and layout.checkpointed(i) for i in layers) else 0
        recompute = tokens * rebuilt + adapted + rebuilt_state if any(layout.checkpointed(i) for i in layers) else 0
        backward = tokens * layer_backward_bytes(model, e, layout.ring, layout.ulysses, mlp_chunked=chunked)
        backward += adapted  # the adapted expert weights' gradient
        if chunked:  # one MLP chunk rebuilt in the backward (gate, SiLU, up, product) with two gradients
            backward += min(work.mlp_chunk_tokens, tokens) * 6 * model.token_mlp_width * e
        loss_fwd = loss_bwd = 0
        if last:
            chunk = min(work.loss_chunk_tokens, tokens)
            # fp32 logits of a chunk and logsumexp's temporary, plus the previous chunk's logits (still referenced
            # while the next are computed) when there are several chunks; beside them the fp32 accumulator of the
            # head's gradient, later cast to the compute dtype (none for a frozen head); the loss's input and its
            # gradient
            logits = (3 if tokens > chunk else 2) * chunk * vocab * FP32
            head_trained = lora is None or lora.trains("lm_head")
            head_grad = vocab * h * (FP32 + (e if e != FP32 else 0)) if head_trained else 0
            accumulator = vocab * h * FP32 if head_trained else 0
            loss_fwd = max(logits + accumulator, head_grad) + 2 * tokens * h * e
            loss_bwd = vocab * h * e if head_trained else 0  # the head's unsharded gradient, until the reduce-scatter
        states = (trained * STATE_BYTES + frozen * e) / layout.dp_cp
        if work.reference == "copy":  # the frozen reference: sharded in the compute dtype, its root kept gathered
            live_states += stage_params * e / layout.dp_cp
            states += stage_params * e / layout.dp_cp
            gathered_fwd += root * e
            gathered_bwd += root * e
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
