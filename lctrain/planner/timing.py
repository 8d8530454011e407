"""Time: one ring step (attention compute against the K/V transfer: does it hide?) and one optimizer step."""

from __future__ import annotations

from dataclasses import dataclass

from lctrain.flops import delta_rule_flops_per_token, flops_per_token
from lctrain.planner.memory import CHUNK, kv_width
from lctrain.planner.presets import FP32, Hardware, Layout, ModelSpec, Workload
from lctrain.rules import groups_inside_nodes, stage_layers

BACKWARD_FLOPS_RATIO = 2.5  # attention backward / forward FLOPs (flash backward: 5 matmuls vs 2, scores recomputed)


# The pieces the ring's last forward fetch and its dK/dV returns travel in (lctrain.attention.ring_transfers.PIECES;
# a test keeps the two equal): on a ring of two, where each pass has one transfer, it hides behind 2 - 1/PIECES steps.
RING_PIECES = 4


@dataclass
class RingStep:
    """One ring step of one layer on one GPU: compute (attention of half an (S/R)² block for its heads) against
    the transfer of the next K/V piece (forward) and, in the backward, of the fp32 dK/dV returned to their owner
    plus, with a ring of more than two, the next K/V piece fetched again (a ring of two keeps its one remote piece
    from the forward). A transfer hides behind ``overlap`` steps' compute: one, or on a ring of two, whose one
    transfer per pass travels in pieces while both steps compute, 2 - 1/RING_PIECES.

    A hybrid's gated delta layer runs no ring step: it all-gathers its pieces' summaries and convolution halos over
    the ring once (``summary_fwd_s``), and all-reduces their gradient in the backward (``summary_bwd_s``: twice the
    bytes); the layer waits for both (exposed), whose size does not grow with the length. Their bandwidth is what
    ``lctrain probe`` measured for this exchange (``summary_intra_gbps``, ``summary_inter_gbps``), else the ring's
    link's."""

    link: str  # "intra" (the ring lies inside a node: NVLink), "inter" (it spans nodes: network) or "none"
    tokens_per_rank: int  # S/R: the piece a ring rank holds after the Ulysses all-to-all
    threshold_tokens: float  # S/R from which communication hides (forward and backward)
    compute_fwd_s: float
    comm_fwd_s: float
    compute_bwd_s: float
    comm_bwd_s: float
    overlap: float = 1.0
    summary_fwd_s: float = 0.0
    summary_bwd_s: float = 0.0

    @property
    def hidden(self) -> bool:
        return (
            self.overlap * self.compute_fwd_s >= self.comm_fwd_s
            and self.overlap * self.compute_bwd_s >= self.comm_bwd_s
        )

    @property
    def exposed_fwd_s(self) -> float:
        return max(0.0, self.comm_fwd_s - self.overlap * self.compute_fwd_s)

    @property
    def exposed_bwd_s(self) -> float:
        return max(0.0, self.comm_bwd_s - self.overlap * self.compute_bwd_s)


def flops_rate(hw: Hardware, work: Workload) -> float:
    return hw.tflops * 1e12 * work.mfu


def attention_rates(hw: Hardware, work: Workload) -> tuple[float, float]:
    """FLOP/s of the attention kernel, forward and backward: measured ones (``lctrain probe``) as they are, else
    the peak x mfu for both."""
    forward = hw.attention_tflops * 1e12 if hw.attention_tflops else flops_rate(hw, work)
    backward = hw.attention_backward_tflops * 1e12 if hw.attention_backward_tflops else forward
    return forward, backward


# the link whose bandwidth a collective's takes when a hardware file has no measured figure for it
COLLECTIVE_LINKS = {
    "alltoall_gbps": "intra_gbps",
    "summary_intra_gbps": "intra_gbps",
    "summary_inter_gbps": "inter_gbps",
}


def link_bandwidth(hw: Hardware, work: Workload, field: str) -> float:
    """Bytes/s of link ``field`` (``intra_gbps``, ``inter_gbps``, or a collective's: ``alltoall_gbps``,
    ``summary_intra_gbps``, ``summary_inter_gbps``): measured as it is, nominal x link efficiency; a collective not
    measured takes its link's (``COLLECTIVE_LINKS``)."""
    if getattr(hw, field) is None:
        field = COLLECTIVE_LINKS[field]
    efficiency = 1.0 if field in hw.measured else work.link_efficiency
    return getattr(hw, field) * 1e9 * efficiency


def ring_step(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload) -> RingStep:
    """Compute vs communication of one ring step (see the module doc and ``docs/planner.md``)."""
    ring, ulysses, e = layout.ring, layout.ulysses, work.dtype_bytes
    piece = work.seq_len // ring
    if ring == 1:
        return RingStep("none", piece, 0.0, 0.0, 0.0, 0.0, 0.0)
    inside = groups_inside_nodes(layout.cp, work.gpus_per_node)
    link = "intra" if inside else "inter"
    bandwidth = link_bandwidth(hw, work, "intra_gbps" if inside else "inter_gbps")
    rate_fwd, rate_bwd = attention_rates(hw, work)
    kv_elements = piece * kv_width(model, ulysses) / ulysses  # S/R tokens × max(Hkv/U, 1) heads × D
    pairs = piece * piece / 2  # zigzag: every step is the same half (S/R)² block
    flops_fwd = 4 * model.head_dim * (model.heads / ulysses) * pairs
    summary_bandwidth = link_bandwidth(hw, work, f"summary_{link}_gbps")  # measured by lctrain probe, or the ring's
    summary_s = summary_exchange_bytes(model, ring, ulysses, e) / summary_bandwidth
    backward_bytes = FP32 + (e if ring > 2 else 0)  # per K/V element: fp32 dK/dV, and K/V again when R > 2
    overlap = 2 - 1 / RING_PIECES if ring == 2 else 1.0
    # hides when S/R ≥ max(Hkv, U)/Hq · max(e · C_fwd, b / 2.5 · C_bwd) / (W · overlap) (b: the backward's bytes per
    # K/V element)
    threshold = (
        max(model.kv_heads, ulysses)
        / model.heads
        * max(e * rate_fwd, backward_bytes * rate_bwd / BACKWARD_FLOPS_RATIO)
        / (bandwidth * overlap)
    )
    return RingStep(
        link=link,
        tokens_per_rank=piece,
        threshold_tokens=threshold,
        compute_fwd_s=flops_fwd / rate_fwd,
        comm_fwd_s=2 * kv_elements * e / bandwidth,
        compute_bwd_s=BACKWARD_FLOPS_RATIO * flops_fwd / rate_bwd,
        comm_bwd_s=2 * kv_elements * backward_bytes / bandwidth,
        overlap=overlap,
        summary_fwd_s=summary_s,
        summary_bwd_s=2 * summary_s,
    )


def summary_exchange_bytes(model: ModelSpec, ring: int, ulysses: int, e: int) -> int:
    """Bytes one GPU receives in a gated delta layer's forward exchanges over a ring of ``ring``: every other ring
    rank's two zigzag pieces' summaries, ``[Hv/U, dk, dk + dv]`` fp32 each, and convolution halos,
    ``[K - 1, channels/U]``; 0 for a model without such layers. The gradient's all-reduce in the backward moves twice
    as much."""
    if not any(model.linear_layers):
        return 0
    hv, (dk, dv) = model.linear_heads[1], model.linear_head_dims
    piece = hv // ulysses * dk * (dk + dv) * FP32 + (model.conv_kernel - 1) * model.conv_channels // ulysses * e
    return (ring - 1) * 2 * piece


@dataclass
class StepTime:
    """One optimizer step on the busiest GPU, in seconds."""

    compute_s: float  # FLOPs (with recomputation) at mfu × peak
    ring_exposed_s: float  # ring transfers longer than the attention they overlap
    ulysses_s: float  # the all-to-alls (not overlapped: attention waits for them)
    expert_s: float  # expert parallelism's all-to-alls: tokens to their experts' ranks and back (not overlapped)
    fsdp_exposed_s: float  # parameter all-gathers and gradient reduce-scatters beyond the compute they overlap
    bubble_s: float  # pipeline idle time, (pp − 1)/m of the stage's work (1F1B)
    tokens_per_step: int  # dp × batch × seq_len
    model_flops: float  # per GPU per step, ``flops_per_token`` (no recomputation), as the trainer's MFU counts
    peak_flops: float  # per GPU, FLOP/s

    @property
    def total_s(self) -> float:
        return (
            self.compute_s + self.ring_exposed_s + self.ulysses_s + self.expert_s + self.fsdp_exposed_s + self.bubble_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        """The MFU the trainer would report at this step time."""
        return self.model_flops / (self.total_s * self.peak_flops)


def step_time(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload, ring: RingStep) -> StepTime:
    e, rows = work.dtype_bytes, work.batch
    layers = max(len(r) for r in stage_layers(model.layers, layout.pp))
    recomputed = sum(layout.checkpointed(i) for i in range(model.layers)) / model.layers
    per_token = model_flops_per_token(model, work.seq_len)
    model_flops = rows * work.seq_len * per_token / (layout.pp * layout.cp)
    # a recomputed forward is 1/3 of the FLOPs, and so is the reference model's forward (preference losses)
    forwards = recomputed + (work.reference != "none")
    compute = model_flops * (1 + forwards / 3) / flops_rate(hw, work)
    ring_exposed = 0.0
    if layout.ring > 1:
        ring_exposed = rows * layers * ring_layer_s(model, layout, ring, recomputed)
    ulysses = 0.0
    if layout.ulysses > 1:
        tokens = work.seq_len // layout.cp
        moved = (layout.ulysses - 1) / layout.ulysses
        per_layer = moved * tokens * e * (2 * model.q_dim + 2 * kv_width(model, layout.ulysses))  # q, k, v, out
        if any(model.linear_layers):  # a gated delta layer's q, k, v, gates (fp32) and output, averaged over layers
            (_, hv), dv = model.linear_heads, model.linear_head_dims[1]
            linear = moved * tokens * ((model.conv_channels + hv * dv) * e + 2 * hv * FP32)
            share = sum(model.linear_layers) / model.layers
            per_layer = (1 - share) * per_layer + share * linear
        ulysses = rows * layers * per_layer * (2 + recomputed) / link_bandwidth(hw, work, "alltoall_gbps")
    experts = expert_all_to_all_s(model, layout, hw, work) * rows * layers * (4 + 2 * recomputed)
    fsdp_exposed = 0.0
    if layout.dp_cp > 1:
        gathers = 2 if layout.pp == 1 else 1  # resharded after forward: gathered again for the backward
        gathers += work.reference != "none"  # the reference's forward gathers its weights (or the base's) once more
        # the experts are gathered over the dp_cp / ep ranks that hold the same ones (lctrain.parallel.expert)
        dense = (model.num_params - model.layers * model.expert_params) / layout.pp
        gathered = dense * (layout.dp_cp - 1) / layout.dp_cp
        gathered += model.layers * model.expert_params / layout.ep / layout.pp * (layout.efsdp - 1) / layout.efsdp
        volume = gathered * (gathers * e + FP32)
        inside = groups_inside_nodes(layout.dp_cp, work.gpus_per_node)
        bandwidth = link_bandwidth(hw, work, "intra_gbps" if inside else "inter_gbps")
        fsdp_exposed = max(0.0, volume / bandwidth - compute)
    busy = compute + ring_exposed + ulysses + experts
    bubble = busy * (layout.pp - 1) / rows
    tokens = layout.dp * rows * work.seq_len
    return StepTime(
        compute, ring_exposed, ulysses, experts, fsdp_exposed, bubble, tokens, model_flops, hw.tflops * 1e12
    )


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """``flops_per_token`` of the model (``lctrain.train.meter``'s count): a hybrid's gated delta layers count their
    recurrence in place of attention."""
    hv, (dk, dv) = model.linear_heads[1], model.linear_head_dims
    delta = delta_rule_flops_per_token(hv, dk, dv, CHUNK) if any(model.linear_layers) else 0.0
    args = (model.active_params, model.layers, model.hidden, seq_len, model.windows, model.linear_layers, delta)
    return flops_per_token(*args)


def ring_layer_s(model: ModelSpec, layout: Layout, ring: RingStep, recomputed: float) -> float:
    """The ring's exposed seconds in one layer for one row, averaged over the model's layers: a layer without a
    window (or with one reaching past a zigzag chunk, S/2R) runs ring − 1 steps whose transfers hide behind their
    compute or not (``RingStep``); a layer whose window W is no larger than a chunk fetches only the W − 1 tokens
    before each of its two chunks from its ring neighbours (and returns their dK/dV), counted whole, as its banded
    compute is too short to hide them (gpt-oss's 128-token layers, Gemma 3's 1,024-token ones); a gated delta layer
    waits for its summary exchanges (again when recomputed)."""
    fwd = ring.exposed_fwd_s * (1 + recomputed)
    full = (layout.ring - 1) * (fwd + ring.exposed_bwd_s)
    chunk = ring.tokens_per_rank // 2
    windows = model.windows or (None,) * model.layers
    total = 0.0
    for layer, window in enumerate(windows):
        if model.is_linear(layer):
            total += ring.summary_fwd_s * (1 + recomputed) + ring.summary_bwd_s
        elif window is None or window > chunk:
            total += full
        else:  # 2 (W - 1) of the piece's rows travel, forward (again when recomputed) and backward
            edge = 2 * (window - 1) / ring.tokens_per_rank
            total += edge * (ring.comm_fwd_s * (1 + recomputed) + ring.comm_bwd_s)
    return total / len(windows)


def expert_all_to_all_s(model: ModelSpec, layout: Layout, hw: Hardware, work: Workload) -> float:
    """Seconds of one of expert parallelism's all-to-alls in one layer for one row: the k copies of each of the
    GPU's S/(ring·ulysses) tokens, (ep - 1)/ep of which go to other ranks (routing balanced), over the measured
    all-to-all bandwidth (``lctrain probe``'s, else NVLink's) when the ep ranks share a node, else the network's.
    A layer runs four (dispatch and combine, forward and backward), six when it is recomputed."""
    if layout.ep == 1 or not model.moe:
        return 0.0
    tokens = work.seq_len // layout.cp
    moved = tokens * model.experts_per_token * model.hidden * work.dtype_bytes * (layout.ep - 1) / layout.ep
    inside = groups_inside_nodes(layout.ep, work.gpus_per_node)
    return moved / link_bandwidth(hw, work, "alltoall_gbps" if inside else "inter_gbps")
