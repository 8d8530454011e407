"""The model families lctrain runs exactly, one record each (``Family``), and what it refuses.

A family is a transformers ``model_type`` whose decoder lctrain patches (USP attention through
``AttentionInterface``), replays in pipeline stages (``PipelineStageModule``), chunks (``chunked_mlp``) and counts
(``lctrain.planner``), and whose every parity test compares it with the plain transformers model. Its record holds
every fact another module asks of a family (how its attention gets a sliding window, where its config keeps its
experts, its attention's norms and biases, its default LoRA targets, what random init must set, the sequence mixer
of its layers); adding a family is adding a record, a parity test and a row of the families table in
``docs/configuration.md``. The windows:

- ``llama`` (Llama 2, Llama 3, 3.1, 3.2: the ``llama3`` RoPE type, tied embeddings on the small ones): no sliding
  window (``LlamaAttention`` passes none to the attention function);
- ``mistral``: ``config.sliding_window`` on every layer (``MistralAttention`` passes it; Mistral-7B-v0.1 declares
  4096, v0.2/v0.3 none);
- ``qwen2``, ``qwen3`` (q/k RMSNorm in attention): ``config.sliding_window`` on the layers whose
  ``config.layer_types[i]`` is ``sliding_attention``, none on the others (``Qwen2Attention``, ``Qwen3Attention``).
  transformers derives ``layer_types`` from ``use_sliding_window``, ``sliding_window`` and ``max_window_layers``
  (layers ``i >= max_window_layers`` slide) unless the config lists them, and drops ``sliding_window`` when
  ``use_sliding_window`` is false;
- the mixtures of experts (a record with ``experts``: a router and experts in place of the MLP,
  ``lctrain.models.moe``): ``mixtral`` (``config.sliding_window`` on every layer, as Mistral), ``qwen3_moe`` (q/k
  RMSNorm; ``config.sliding_window`` on every layer, which transformers drops unless ``use_sliding_window``);
  ``gpt_oss`` (attention sinks, biased experts with a clamped SwiGLU, a biased router): ``config.sliding_window``
  (128) on the layers ``config.layer_types`` marks ``sliding_attention`` (every other one), the rule ``pattern``:
  the config has no switch, so no window means every layer ``full_attention``, the window kept;
- ``gemma3_text`` (Gemma 3: q/k RMSNorm, ``query_pre_attn_scalar`` as the softmax scale, scaled embeddings, RoPE per
  layer type): ``config.sliding_window`` on the ``sliding_attention`` layers (five of every six), the rule
  ``pattern``.

``layer_windows`` states that rule; ``tests/unit/test_model_families.py`` checks it against the window each
attention module actually receives. The job's ``model.*`` settings are written into the config the model is built
from and exported with here, after its record refused what lctrain cannot run (``lctrain.models.hf.model_config``):
``model.sliding_window`` (``apply_sliding_window``) keeps, changes or removes the window, ``set_rope`` the RoPE
settings, ``set_router_aux_loss`` the router's loss weight; ``model_flops_per_token`` counts a model's training FLOPs
per token (``lctrain.flops``) by its layers: windows, mixers, routed experts. Pure functions of a transformers
config: this module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lctrain.flops import delta_rule_flops_per_token, flops_per_token

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the attention's projections, in every family
PROJECTIONS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")  # with a dense MLP's
# the projections of the gated delta (linear-attention) layers: Qwen3-Next's fused ones, Qwen3.5's
QWEN3_NEXT_LINEAR = ("in_proj_qkvz", "in_proj_ba", "out_proj")
QWEN3_5_LINEAR = ("in_proj_qkv", "in_proj_z", "out_proj")


@dataclass(frozen=True)
class Experts:
    """Where a mixture of experts' transformers config keeps its experts, and which layers have them."""

    count: str  # the config attribute: routed experts per layer
    width: str  # the config attribute: one expert's width
    # only every decoder_sparse_step-th layer outside mlp_only_layers has experts (Qwen3-MoE), else every layer
    sparse_layers: bool = False


@dataclass(frozen=True)
class Family:
    """What lctrain knows of one transformers model type it runs (see the module docstring)."""

    model_type: str
    models: str  # the published models of the family, for messages and docs
    # how the attention gets its window: none, model (every layer), layers (layer_types), pattern (layer_types, a
    # window always declared: the model builds its sliding mask whether or not a layer uses it)
    window: str = "none"
    window_flag: bool = False  # the config keeps sliding_window only with use_sliding_window set (else drops it)
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys
    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    # random init sets head_dim = hidden_size / num_heads (the family's config class would default to another)
    head_dim_from_width: bool = False
    experts: Experts | None = None
    # model.lora.target_modules' default: a mixture of experts' attention only (peft reads Qwen3-MoE's MLP names as its
    # experts': lctrain.models.lora), its experts get adapters from model.lora.target_parameters
    lora_targets: tuple[str, ...] = PROJECTIONS
    # the attention transformers builds the plain model with (before lctrain selects its own): gpt-oss has no sdpa
    built_attention: str = "sdpa"
    # the decoder layers' attribute holding a gated delta (linear-attention) mixer, on the layers whose
    # config.layer_types[i] is linear_attention: run over the context-parallel ranks by lctrain.linear_attention
    linear_mixer: str | None = None
    # RoPE per layer type (config.rope_parameters keyed by layer_types' kinds, rotary_emb(x, positions, layer_type)):
    # Gemma 3's local layers have their own base, its global layers theirs with the scaling
    rope_per_layer_type: bool = False
    sinks: bool = False  # a learned attention sink per head (gpt-oss): one parameter per head and layer
    expert_bias: bool = False  # biased experts (gate_up and down) and router (gpt-oss)
    layer_norms: int = 2  # RMSNorms of hidden size per decoder layer (Gemma 3's four: around attention and MLP)

    @property
    def moe(self) -> bool:
        return self.experts is not None


FAMILIES = {
    family.model_type: family
    for family in (
        Family("llama", "Llama 2, 3, 3.1, 3.2"),
        Family("mistral", "Mistral 7B v0.1-v0.3", window="model"),
        Family("qwen2", "Qwen2, Qwen2.5", window="layers", qkv_bias=True),
        Family("qwen3", "Qwen3 dense", window="layers", qk_norm=True, head_dim_from_width=True),
        Family(
            "qwen3_moe",
            "Qwen3-30B-A3B, Qwen3-235B-A22B",
            window="model",
            window_flag=True,
            qk_norm=True,
            head_dim_from_width=True,
            experts=Experts("num_experts", "moe_intermediate_size", sparse_layers=True),
            lora_targets=ATTENTION,
        ),
        Family(
            "mixtral",
            "Mixtral 8x7B, 8x22B",
            window="model",
            head_dim_from_width=True,
            experts=Experts("num_local_experts", "intermediate_size"),
            lora_targets=ATTENTION,
        ),
        Family(
            "gpt_oss",
            "gpt-oss-20b, gpt-oss-120b",
            window="pattern",
            head_dim_from_width=True,
            experts=Experts("num_local_experts", "intermediate_size"),
            lora_targets=ATTENTION,
            built_attention="eager",
            sinks=True,
            expert_bias=True,
        ),
        Family(
            "gemma3_text",
            "Gemma 3 1B-27B (the language model)",
            window="pattern",
            qk_norm=True,
            head_dim_from_width=True,
            rope_per_layer_type=True,
            layer_norms=4,
        ),
        # the hybrids: three gated delta layers before each gated full-attention layer (partial rotary, q/k norms)
        Family(
            "qwen3_next",
            "Qwen3-Next-80B-A3B",
            qk_norm=True,
            head_dim_from_width=True,
            experts=Experts("num_experts", "moe_intermediate_size", sparse_layers=True),
            lora_targets=(*ATTENTION, *QWEN3_NEXT_LINEAR),
            linear_mixer="linear_attn",
        ),
        Family(
            "qwen3_5_text",
            "Qwen3.5 dense (the language model)",
            qk_norm=True,
            head_dim_from_width=True,
            lora_targets=(*PROJECTIONS, *QWEN3_5_LINEAR),
            linear_mixer="linear_attn",
        ),
        Family(
            "qwen3_5_moe_text",
            "Qwen3.5 MoE (the language model)",
            qk_norm=True,
            head_dim_from_width=True,
            experts=Experts("num_experts", "moe_intermediate_size"),
            lora_targets=(*ATTENTION, *QWEN3_5_LINEAR),
            linear_mixer="linear_attn",
        ),
    )
}
# RoPE types whose positions lctrain checks against transformers (tests/distributed/test_export.py): a checkpoint's
# own, or the scaling model.rope_scaling.type sets (any but default); the others (longrope: short or long factors by
# the longest position in the batch, which differs between context-parallel ranks; proportional) are refused
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
ROPE_SCALING_TYPES = ROPE_TYPES[1:]
LAYER_TYPES = ("full_attention", "sliding_attention")
HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")  # a family with a linear_mixer


@dataclass(frozen=True)
class LanguageModel:
    """The language model of an image-text model type, which lctrain trains alone: its config is the checkpoint
    config's ``config`` attribute; what it leaves out is neither read, trained nor exported (the export is the text
    model's checkpoint)."""

    left_out: str
    # renames of the checkpoint's language-model tensors to the text model's names (from_pretrained's key_mapping),
    # where transformers' own conversion mapping for the text model does not make them
    renames: dict[str, str] | None = None
    config: str = "text_config"


LANGUAGE_MODELS = {
    "gemma3": LanguageModel(
        "its vision tower and projector",
        {r"^language_model\.model\.": "model.", r"^language_model\.lm_head\.": "lm_head."},
    ),
    "qwen3_5": LanguageModel("its vision tower"),
    "qwen3_5_moe": LanguageModel("its vision tower"),
}

_MOE = (
    "it is a mixture-of-experts model whose router or shared experts lctrain has not been made and checked to run "
    "exactly (the mixtures it runs: qwen3_moe, mixtral, qwen3_next, qwen3_5_moe_text)"
)
_ALIBI = "its attention adds ALiBi position biases to the scores, which USP attention does not compute"
# why some model types people ask for are refused (any other type: not one of FAMILIES)
REFUSED = {
    "gemma2": "its attention soft-caps the scores (attn_logit_softcapping), which USP attention does not compute",
    "phi3": "it uses longrope RoPE (factors chosen by the longest position in the batch, which differs between "
    "context-parallel ranks) and fused qkv/gate_up projections lctrain does not test",
    "falcon": "its decoder layer (attention and MLP in parallel, a fused query_key_value projection, ALiBi in some "
    "checkpoints) is not the Llama layer lctrain's pipeline stages, chunked MLP and planner assume",
    "bloom": _ALIBI,
    "mpt": _ALIBI,
    "qwen2_moe": _MOE,
    "deepseek_v2": _MOE,
    "deepseek_v3": _MOE,
    "olmoe": _MOE,
    "dbrx": _MOE,
}


def rope_parameters(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    """The RoPE parameters of each kind of layer: ``{layer type: parameters}`` for a family with RoPE per layer type
    (``Family.rope_per_layer_type``), else ``{"all": config.rope_parameters}``; the dicts are the config's own."""
    rope = getattr(config, "rope_parameters", None) or {}
    family = FAMILIES.get(config.model_type)
    return dict(rope) if family is not None and family.rope_per_layer_type else {"all": rope}


def model_source(path: str | None, family: str) -> str:
    """How the job names its model in messages: ``model.path='...'`` or ``model.family='...'``."""
    return f"model.path={path!r}" if path is not None else f"model.family={family!r}"


def family_of(model_type: str, source: str) -> Family:
    """The record of ``model_type``; a model type lctrain cannot run exactly is refused, naming it and the reason
    (``source`` names the model: ``model_source``)."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    reason = REFUSED.get(model_type, "lctrain has not been made and checked to run it exactly")
    raise ValueError(
        f"{source} is a {model_type!r} model, which lctrain does not train: {reason}. Supported model types: "
        f"{', '.join(FAMILIES)}"
    )


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """The sliding window each decoder layer's attention receives from transformers (None = full causal)."""
    layers = config.num_hidden_layers
    rule = FAMILIES[config.model_type].window
    if rule == "none":
        return [None] * layers
    window = getattr(config, "sliding_window", None)
    if rule == "model":
        return [window] * layers
    return [window if kind == "sliding_attention" else None for kind in config.layer_types]  # layers, pattern


def apply_sliding_window(config: PretrainedConfig, setting: int | None) -> None:
    """``model.sliding_window`` on a checkpoint's config, in place: None keeps the checkpoint's own windows; 0
    removes every window (full causal attention on every layer); W > 0 makes W the window of every layer that
    has one (Mistral: every layer, also when the checkpoint declares none; Qwen: the layers ``layer_types`` marks
    ``sliding_attention``). The config is what the model is built from and what the export writes, so the
    exported ``config.json`` says which windows were trained."""
    family = FAMILIES[config.model_type]
    rule = family.window
    if setting is None or rule == "none":
        return  # a positive window on a family without one is refused by the config checks (check_model_features)
    if setting == 0 and rule == "pattern":  # the model builds its sliding mask from sliding_window: kept
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        return
    if setting == 0:
        config.sliding_window = None
        if family.window_flag:
            config.use_sliding_window = False
        if rule == "layers":
            config.use_sliding_window = False
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        return
    if rule == "model":
        config.sliding_window = setting
        if family.window_flag:
            config.use_sliding_window = True  # transformers drops sliding_window on reload without it
    elif "sliding_attention" in config.layer_types:
        config.sliding_window = setting
        if rule == "layers":
            config.use_sliding_window = True  # transformers drops sliding_window on reload without it


# RoPE parameters that say which dimensions rotate, not how positions scale (Qwen3-Next and Qwen3.5 rotate a quarter of
# each head, Qwen3.5 in interleaved sections): kept when model.rope_scaling replaces the type
ROPE_GEOMETRY = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def set_rope(config: PretrainedConfig, cfg: Any) -> None:
    """Apply ``model.max_position_embeddings``, ``model.rope_theta`` and ``model.rope_scaling`` (when set; ``cfg`` is
    the ``model`` section, ``lctrain.models.config.ModelConfig``) to the transformers config, in place: its
    ``rope_parameters`` are what the model computes RoPE from and what the exported ``config.json`` holds, so the
    export loads and generates with the same positions in transformers. With RoPE per layer type (Gemma 3) they set
    the global (``full_attention``) layers'; the local layers keep theirs."""
    if cfg.max_position_embeddings is not None:
        config.max_position_embeddings = cfg.max_position_embeddings
    kinds = rope_parameters(config)
    kind = "all" if "all" in kinds else "full_attention"  # RoPE per layer type (Gemma 3): the global layers'
    rope = dict(kinds[kind])
    if cfg.rope_theta is not None:
        rope["rope_theta"] = cfg.rope_theta
    scaling = cfg.rope_scaling
    if scaling.type is not None:  # the new type's parameters replace the old's; which dimensions rotate stays
        kept = {key: rope[key] for key in ROPE_GEOMETRY if key in rope}
        rope = {"rope_theta": rope["rope_theta"], **kept, "rope_type": scaling.type, "factor": scaling.factor}
        if scaling.original_max_position_embeddings is not None:
            rope["original_max_position_embeddings"] = scaling.original_max_position_embeddings
        if scaling.type == "llama3":
            rope |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    config.rope_parameters = rope if kind == "all" else {**kinds, kind: rope}


def set_router_aux_loss(config: PretrainedConfig, coef: float | None) -> None:
    """``model.router_aux_loss_coef`` on a mixture of experts' config, in place: None keeps the checkpoint's (its
    coefficient counts only when ``output_router_logits`` is set, as in transformers' forward); a value sets
    ``router_aux_loss_coef`` and ``output_router_logits`` (coefficient > 0), so the exported config says what was
    trained. ``lctrain.models.moe.router_aux_coef`` reads the result."""
    if coef is None or not num_experts(config):
        return
    config.router_aux_loss_coef = coef
    config.output_router_logits = coef > 0


def linear_layers(config: PretrainedConfig) -> list[int]:
    """The decoder layers whose sequence mixer is a gated delta (linear-attention) layer; [] for a family without."""
    if FAMILIES[config.model_type].linear_mixer is None:
        return []
    return [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]


def num_experts(config: PretrainedConfig) -> int:
    """The routed experts per layer of a transformers config (its family's ``Experts.count`` attribute); 0 for a
    dense family."""
    experts = FAMILIES[config.model_type].experts
    return 0 if experts is None else int(getattr(config, experts.count))


def expert_width(config: PretrainedConfig) -> int:
    """One expert's width (its family's ``Experts.width`` attribute) of a mixture of experts' config."""
    return int(getattr(config, FAMILIES[config.model_type].experts.width))


def moe_layers(config: PretrainedConfig) -> list[int]:
    """The decoder layers whose MLP is a mixture of experts (``Experts.sparse_layers``: not in ``mlp_only_layers``,
    every ``decoder_sparse_step``-th; else all); [] for a dense family."""
    experts = FAMILIES[config.model_type].experts
    if experts is None:
        return []
    if not experts.sparse_layers:
        return list(range(config.num_hidden_layers))
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers)
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def active_parameters(config: PretrainedConfig, num_params: int) -> int:
    """The parameters one token computes with, of a model of ``num_params``: each MoE layer's experts count for the
    ``num_experts_per_tok`` it is routed to (each expert: gate, up and down, 3 · hidden · width, and gpt-oss's
    biases, 2 · width + hidden); a dense model's all. What the FLOP count (MFU) of a mixture of experts takes."""
    layers = moe_layers(config)
    if not layers:
        return num_params
    idle = num_experts(config) - config.num_experts_per_tok
    hidden, width = config.hidden_size, expert_width(config)
    expert = 3 * hidden * width + (2 * width + hidden) * FAMILIES[config.model_type].expert_bias  # gpt-oss's biases
    return num_params - len(layers) * idle * expert


def model_flops_per_token(config: PretrainedConfig, num_params: int, seq_len: int) -> float:
    """Training FLOPs per token of a Hugging Face model of ``num_params`` parameters on rows of ``seq_len`` tokens:
    its active parameters (a mixture of experts counts the routed experts only), each layer's sliding window, and a
    hybrid's gated delta layers' recurrence in place of their attention."""
    active = active_parameters(config, num_params)
    windows = layer_windows(config)
    linear = set(linear_layers(config))
    if not linear:
        return flops_per_token(active, config.num_hidden_layers, config.hidden_size, seq_len, windows)
    kinds = [i in linear for i in range(config.num_hidden_layers)]
    heads, dims = config.linear_num_value_heads, (config.linear_key_head_dim, config.linear_value_head_dim)
    delta = delta_rule_flops_per_token(heads, *dims)
    return flops_per_token(active, config.num_hidden_layers, config.hidden_size, seq_len, windows, kinds, delta)
