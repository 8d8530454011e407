"""The planner's inputs: a model's sizes (``ModelSpec``, named presets or a Hugging Face ``config.json``), the hardware
(``Hardware``), what one step runs (``Workload``) and a candidate layout (``Layout``: ``ParallelDims`` and its
activation checkpointing)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from lctrain.parallel.dims import ParallelDims

GIB = 2**30
FP32 = 4  # bytes of the fp32 master weights, gradients, optimizer states, accumulators and logits


@dataclass(frozen=True)
class ModelSpec:
    """The sizes of a Llama-style decoder (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE and
    Mixtral) that memory, FLOPs and bytes depend on. A mixture of experts has ``experts`` experts of width
    ``expert_intermediate`` in every layer in place of the MLP, and a router (``experts x hidden``) that sends each
    token to ``experts_per_token`` of them; ``intermediate`` is then unused. A hybrid (Qwen3-Next, Qwen3.5) has a
    gated delta (linear-attention) mixer in place of attention on the layers ``linear_layers`` marks."""

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
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys (Qwen3): 2 · head_dim weights per layer
    rope_theta: float | None = None
    path: str | None = None  # a Hugging Face model directory (the recipe then uses model=hf)
    windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full causal); () = none
    experts: int = 0  # routed experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # the router's top-k
    expert_intermediate: int = 0  # one expert's width (Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size)
    layout: str | None = None  # the layout of the weights in ``path`` (lctrain.models.layouts), in words; None: none
    sinks: bool = False  # an attention sink per head (gpt-oss)
    expert_bias: bool = False  # biased experts and router (gpt-oss): 2 · expert_intermediate + hidden per expert
    norms: int = 2  # RMSNorms of hidden size per layer (Gemma 3: 4)
    attention_gate: bool = False  # q_proj also makes the output's gate (the hybrids): 2 · q_dim wide
    shared_expert: int = 0  # the width of an always-used shared expert, with its gate (hidden -> 1); 0: none
    linear_layers: tuple[bool, ...] = ()  # each layer's mixer is a gated delta layer (else attention); () = none
    linear_heads: tuple[int, int] = (0, 0)  # the gated delta layers' key and value heads (Hk, Hv)
    linear_head_dims: tuple[int, int] = (0, 0)  # their key and value head dims (dk, dv)
    conv_kernel: int = 0  # the taps of their causal convolution over q, k and v

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer ``layer``'s sequence mixer is a gated delta (linear-attention) layer."""
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def attention_layer_indices(self) -> list[int]:
        """The layers with attention (whose K/V grow with the length)."""
        return [i for i in range(self.layers) if not self.is_linear(i)]

    @property
    def conv_channels(self) -> int:
        """The gated delta layers' convolved channels per token: q, k (Hk · dk each) and v (Hv · dv)."""
        (hk, hv), (dk, dv) = self.linear_heads, self.linear_head_dims
        return 2 * hk * dk + hv * dv

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def one_expert_params(self) -> int:
        """One expert's weights: gate, up and down (and their biases, gpt-oss)."""
        width = self.expert_intermediate
        return 3 * self.hidden * width + (2 * width + self.hidden) * self.expert_bias

    @property
    def expert_params(self) -> int:
        """One layer's expert weights (gate, up, down of every expert): what expert parallelism spreads."""
        return self.experts * self.one_expert_params

    @property
    def token_mlp_width(self) -> int:
        """The MLP width one token goes through: the dense intermediate, or its k experts' widths together."""
        return self.experts_per_token * self.expert_intermediate if self.moe else self.intermediate

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """One attention mixer: q (with the hybrids' output gate: twice as wide), k, v, o projections, their biases,
        the sinks, and Qwen3's q/k RMSNorm weights."""
        h, q, kv = self.hidden, self.q_dim * (1 + self.attention_gate), self.kv_dim
        projections = h * (q + 2 * kv + self.q_dim) + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        return projections + self.heads * self.sinks + 2 * self.head_dim * self.qk_norm

    @property
    def linear_params(self) -> int:
        """One gated delta mixer, as transformers builds it (``Qwen3NextGatedDeltaNet``, ``Qwen3_5GatedDeltaNet``):
        the input projections to q, k, v, z, b and a (hidden -> 2 · Hk · dk + 2 · Hv · dv + 2 · Hv), the depthwise
        convolution over q, k, v (``conv_kernel`` taps, no bias), ``A_log`` and ``dt_bias`` (Hv each), the gated
        RMSNorm (dv) and ``out_proj`` (Hv · dv -> hidden)."""
        (hk, hv), (dk, dv), h = self.linear_heads, self.linear_head_dims, self.hidden
        projections = h * (2 * hk * dk + 2 * hv * dv + 2 * hv) + hv * dv * h
        return projections + self.conv_channels * self.conv_kernel + 2 * hv + dv

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: gate/up/down (a mixture of experts: every expert's, the router, the shared expert and
        its gate)."""
        h, inter = self.hidden, self.intermediate
        if not self.moe:
            return 3 * h * inter + (2 * inter + h) * self.mlp_bias
        shared = (3 * h * self.shared_expert + h) if self.shared_expert else 0
        return self.expert_params + self.experts * (h + self.expert_bias) + shared

    def params_of(self, layer: int) -> int:
        """Parameters of decoder layer ``layer``: its mixer (attention or gated delta), its MLP and its RMSNorms."""
        mixer = self.linear_params if self.is_linear(layer) else self.attention_params
        return mixer + self.mlp_params + self.norms * self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of the largest decoder layer (what FSDP gathers at once): q, k, v, o projections, gate/up/down
        MLP (a mixture of experts: every expert's, and the router), two RMSNorm weights (and Qwen3's q/k RMSNorm
        weights); a hybrid's larger of its two kinds."""
        mixers = [self.attention_params] if self.attention_layer_indices else []
        mixers += [self.linear_params] if any(self.linear_layers) else []
        return max(mixers) + self.mlp_params + self.norms * self.hidden

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
        layers = sum(self.params_of(i) for i in range(self.layers))
        return self.embed_params + layers + self.hidden + self.head_params

    @property
    def active_params(self) -> int:
        """The parameters one token goes through (the FLOPs' count): ``num_params`` for a dense model."""
        return self.num_params - self.layers * (self.experts - self.experts_per_token) * self.one_expert_params

    @classmethod
    def from_hf_config(cls, config: dict, *, name: str, path: str | None = None) -> ModelSpec:
        """From a Hugging Face ``config.json``, read by transformers (its class defaults for absent fields, e.g.
        Qwen3's ``head_dim`` 128). Biases as transformers builds them: Qwen2 always on q/k/v, never on o; Llama and
        Qwen3 on all four with ``attention_bias``. An image-text checkpoint's (Gemma 3, Qwen3.5): its language
        model's, which lctrain trains alone."""
        # imported here: the named sizes need neither transformers nor torch (lctrain.models imports both)
        from transformers import AutoConfig

        from lctrain.families import LANGUAGE_MODELS, expert_width, family_of, layer_windows, num_experts

        if config.get("model_type") in LANGUAGE_MODELS:
            text = LANGUAGE_MODELS[config["model_type"]].config
            config = getattr(AutoConfig.for_model(**config), text).to_dict()
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        # a mixture of experts' MLP width is its experts' (Qwen3.5 MoE's config has no intermediate_size)
        needed += () if "num_experts" in config or "num_local_experts" in config else ("intermediate_size",)
        missing = [key for key in needed if key not in config]
        if missing:
            raise ValueError(f"{name}: config.json has no {', '.join(missing)}: is it a Llama-style decoder?")
        record = family_of(config.get("model_type", "llama"), f"--model {name}")
        family = record.model_type
        hf = AutoConfig.for_model(**{**config, "model_type": family})
        attention_bias = bool(getattr(hf, "attention_bias", False))
        windows = tuple(layer_windows(hf))
        experts = num_experts(hf)
        if experts and (getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1):
            raise ValueError(
                f"{name}: the planner counts experts in every layer (mlp_only_layers [], decoder_sparse_step 1)"
            )
        hybrid = record.linear_mixer is not None
        linear = tuple(kind == "linear_attention" for kind in hf.layer_types) if hybrid else ()
        return cls(
            name=name,
            hidden=hf.hidden_size,
            intermediate=getattr(hf, "intermediate_size", None) or expert_width(hf),
            layers=hf.num_hidden_layers,
            heads=hf.num_attention_heads,
            kv_heads=hf.num_key_value_heads,
            vocab=hf.vocab_size,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            tied=bool(hf.tie_word_embeddings),
            family=family,
            qkv_bias=record.qkv_bias or attention_bias,
            o_bias=not record.qkv_bias and attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=record.qk_norm,
            rope_theta=config.get("rope_theta"),
            path=path,
            windows=windows if any(windows) else (),
            experts=experts,
            experts_per_token=int(getattr(hf, "num_experts_per_tok", 0)) if experts else 0,
            expert_intermediate=expert_width(hf) if experts else 0,
            sinks=record.sinks,
            expert_bias=record.expert_bias,
            norms=record.layer_norms,
            attention_gate=hybrid,  # the hybrids' full-attention layers gate their output
            shared_expert=int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) if experts else 0,
            linear_layers=linear,
            linear_heads=(hf.linear_num_key_heads, hf.linear_num_value_heads) if hybrid else (0, 0),
            linear_head_dims=(hf.linear_key_head_dim, hf.linear_value_head_dim) if hybrid else (0, 0),
            conv_kernel=hf.linear_conv_kernel_dim if hybrid else 0,
        )


def _named(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw) -> ModelSpec:
    return ModelSpec(name, hidden, inter, layers, heads, kv, vocab, kw.pop("head_dim", hidden // heads), **kw)


def _moe(
    name: str, hidden: int, layers: int, heads: int, kv: int, vocab: int, experts: int, k: int, width: int, **kw
) -> ModelSpec:
    """A mixture of experts: ``experts`` of ``width`` per layer, ``k`` per token (RoPE base 1e6 unless given)."""
    moe = {"experts": experts, "experts_per_token": k, "expert_intermediate": width, "rope_theta": 1e6}
    return _named(name, hidden, width, layers, heads, kv, vocab, **{**moe, **kw})


QWEN3_MOE = {"head_dim": 128, "family": "qwen3_moe", "qk_norm": True}
# Qwen3-Next-80B-A3B: three gated delta layers before each gated full-attention layer, a shared expert of 512
QWEN3_NEXT = {
    "head_dim": 256, "family": "qwen3_next", "qk_norm": True, "attention_gate": True, "shared_expert": 512,
    "linear_layers": tuple((i + 1) % 4 != 0 for i in range(48)), "linear_heads": (16, 32),
    "linear_head_dims": (128, 128), "conv_kernel": 4, "rope_theta": 1e7,
}  # fmt: skip
# Qwen3.5-35B-A3B's language model: the same layers, 40 of them, 256 experts
QWEN3_5_MOE = {**QWEN3_NEXT, "family": "qwen3_5_moe_text", "linear_layers": QWEN3_NEXT["linear_layers"][:40]}
# Qwen3.5-4B's language model: the same layers, dense (an MLP of 9,216), 32 of them, tied embeddings
QWEN3_5 = {
    **QWEN3_NEXT, "family": "qwen3_5_text", "shared_expert": 0, "linear_layers": QWEN3_NEXT["linear_layers"][:32],
}  # fmt: skip
# gpt-oss: 128-token windows on every other layer (the first slides), biases on the attention, experts and router
GPT_OSS = {
    "head_dim": 64, "family": "gpt_oss", "qkv_bias": True, "o_bias": True, "sinks": True, "expert_bias": True,
    "rope_theta": 150000.0,
}  # fmt: skip
# Gemma 3 27B's language model: 1,024-token windows on five layers of six, tied embeddings, four norms a layer
GEMMA3_27B = {
    "head_dim": 128, "family": "gemma3_text", "tied": True, "qk_norm": True, "norms": 4, "rope_theta": 1e6,
    "windows": tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62)),
}  # fmt: skip

# Published sizes (the models' config.json files; mistral-7b is v0.1, with its 4,096-token window on every layer;
# mixtral-8x7b is v0.1, without a window).
# `tiny` is recipe tiny_cpu with the default tokenizer.
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
        _named("mistral-7b", 4096, 14336, 32, 32, 8, 32000, family="mistral", rope_theta=10000.0, windows=(4096,) * 32),
        _named("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, family="qwen2", qkv_bias=True, rope_theta=1e6),
        _named("qwen3-8b", 4096, 12288, 36, 32, 8, 151936, head_dim=128, family="qwen3", qk_norm=True, rope_theta=1e6),
        _moe("qwen3-30b-a3b", 2048, 48, 32, 4, 151936, 128, 8, 768, **QWEN3_MOE),
        _moe("qwen3-235b-a22b", 4096, 94, 64, 4, 151936, 128, 8, 1536, **QWEN3_MOE),
        _named("qwen3.5-4b", 2560, 9216, 32, 16, 4, 248320, tied=True, **QWEN3_5),
        _moe("qwen3-next-80b-a3b", 2048, 48, 16, 2, 151936, 512, 10, 512, **QWEN3_NEXT),
        _moe("qwen3.5-35b-a3b", 2048, 40, 16, 2, 248320, 256, 8, 512, **QWEN3_5_MOE),
        _moe("mixtral-8x7b", 4096, 32, 32, 8, 32000, 8, 2, 14336, family="mixtral"),
        _moe("mixtral-8x22b", 6144, 56, 48, 8, 32768, 8, 2, 16384, family="mixtral"),
        _moe("gpt-oss-20b", 2880, 24, 64, 8, 201088, 32, 4, 2880, **GPT_OSS, windows=(128, None) * 12),
        _moe("gpt-oss-120b", 2880, 36, 64, 8, 201088, 128, 4, 2880, **GPT_OSS, windows=(128, None) * 18),
        _named("gemma3-27b", 5376, 21504, 62, 32, 16, 262208, **GEMMA3_27B),
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
    model = ModelSpec.from_hf_config(json.loads(config_file.read_text()), name=model_dir.name, path=str(model_dir))
    if any(model_dir.glob("*.safetensors")):
        # imported here: torch and transformers, only for a directory with weights
        from lctrain.models.hf import checkpoint_layout

        model = replace(model, layout=checkpoint_layout(model_dir))
    return model


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links. Bandwidths are per GPU and per direction, in GB/s (1e9 bytes).

    A preset holds vendor figures (peak FLOP/s, nominal bandwidths: the workload's ``mfu`` and ``link_efficiency``
    scale them). A hardware file written by ``python -m lctrain probe`` (``load_hardware``) holds what it measured
    (``measured``): achieved bandwidths, to which no link efficiency applies, the attention kernel's achieved rates
    (used as they are for the ring step) and a large GEMM's rate in place of the peak (``mfu`` still scales it).
    """

    name: str
    tflops: float  # dense peak for the compute dtype (bf16 on GPUs); from a probe: a large GEMM's achieved rate
    mem_gib: float  # device memory
    intra_gbps: float  # inside a node (NVLink)
    inter_gbps: float  # between nodes (InfiniBand/RoCE, the NIC share of one GPU)
    device: str = "cuda"
    alltoall_gbps: float | None = None  # the Ulysses all-to-all (bytes leaving a GPU per s); None: intra_gbps
    attention_tflops: float | None = None  # the attention kernel's achieved forward rate; None: tflops x mfu
    attention_backward_tflops: float | None = None  # its backward (counted as 2.5x the forward's FLOPs); None: same
    # a hybrid's gated delta summary exchange over a ring inside a node / across nodes; None: intra_gbps / inter_gbps
    summary_intra_gbps: float | None = None
    summary_inter_gbps: float | None = None
    measured: tuple[str, ...] = ()  # the fields a probe measured
    dtype: str | None = None  # the compute dtype a probe measured in (bf16 or fp32); None: a preset


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


# the fields a hardware file may hold (null: not measured)
MEASURABLE = (
    "tflops",
    "mem_gib",
    "intra_gbps",
    "inter_gbps",
    "alltoall_gbps",
    "attention_tflops",
    "attention_backward_tflops",
    "summary_intra_gbps",
    "summary_inter_gbps",
)


def load_hardware(path: str | Path, fallback: str | None = None) -> Hardware:
    """The hardware file ``path`` (JSON, written by ``python -m lctrain probe``): its figures, and those of the
    preset ``fallback`` (default: h100 for a CUDA file, cpu for a CPU one) it lacks or holds as null, e.g. the
    links between nodes when the probe ran on one node."""
    where = f"--hardware {path}"
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: cannot read it as JSON ({error}); write it with python -m lctrain probe") from None
    if not isinstance(record, dict) or record.get("device") not in ("cuda", "cpu"):
        raise ValueError(
            f'{where}: not a hardware file (no "device": "cuda" or "cpu"); write it with python -m lctrain probe'
        )
    values, measured = {}, []
    for name in MEASURABLE:
        value = record.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{where}: {name}={value!r} must be a positive number or null (not measured)")
        values[name] = float(value)
        measured.append(name)
    dtype = record.get("dtype")
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"{where}: dtype={dtype!r} must be bf16 or fp32, the dtype the probe measured in")
    preset = HARDWARE[fallback or ("h100" if record["device"] == "cuda" else "cpu")]
    name = str(record.get("name", Path(path).stem))
    return replace(preset, name=name, device=record["device"], measured=tuple(measured), dtype=dtype, **values)


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
    cpu_offload: bool = False  # parallel.cpu_offload (FSDP-sharded weights, gradients, AdamW states in host memory)
    lora_rank: int = 0  # model.lora.rank (adapters on every projection); 0 = full fine-tuning
    lora_trainable: tuple[str, ...] = ()  # model.lora.trainable: embed_tokens, norm, lm_head
    # model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]: adapters on a mixture of experts'
    # expert weights too (expert parallelism refused)
    lora_experts: bool = False
    # the preference objective's reference model (objective.*): none (LM, reference-free losses or precomputed
    # log-probs), adapters (LoRA's base with the adapters disabled: one more forward) or copy (a frozen copy of the
    # weights, or another model: its weights too)
    reference: str = "none"
    mfu: float = 0.4  # achieved fraction of peak FLOP/s, for matmuls and attention alike
    link_efficiency: float = 0.8  # achieved fraction of the nominal link bandwidths
    headroom: float = 0.15  # fraction of device memory kept free (allocator fragmentation, CUDA context, NCCL)
    device: str = "cuda"  # cuda or cpu (offload is a no-op on cpu: activations already live in host memory)

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Layout(ParallelDims):
    """A mesh (``ParallelDims``: its degrees multiply to the world size) and the activation checkpointing that goes
    with it."""

    ac: str = "none"  # parallel.activation_checkpointing: none, selective or full
    ac_every: int = 2  # parallel.ac_every (selective)

    def checkpointed(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) is checkpointed (``apply_activation_checkpointing``)."""
        if self.ac == "none":
            return False
        return layer % (1 if self.ac == "full" else self.ac_every) == 0

    def ac_label(self) -> str:
        return f"selective/{self.ac_every}" if self.ac == "selective" else self.ac
