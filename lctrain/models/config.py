"""What model a job trains: a local Hugging Face checkpoint, or a fresh one built from sizes, the RoPE scaling
and sliding window written into its config (``lctrain.models.hf.model_config``), and the LoRA adapters trained on
it (``lctrain.models.lora``). The ``model`` section of ``lctrain.config.JobConfig``; each dataclass checks its own
fields when it is made (what needs the model's config is ``lctrain.config.check_model_job``'s). Importing this
module loads neither torch nor transformers."""

from __future__ import annotations

from dataclasses import dataclass, field

from lctrain.families import ROPE_SCALING_TYPES, family_of, model_source


@dataclass
class RopeScalingConfig:
    """RoPE scaling for context extension, written into the model's config (transformers' ``rope_parameters``) and
    so into the exported checkpoint. ``type: null`` keeps the checkpoint's own."""

    type: str | None = None  # linear, dynamic, yarn or llama3; None = unchanged
    factor: float = 1.0  # the extension: new context / original_max_position_embeddings
    original_max_position_embeddings: int | None = None  # yarn, llama3: the context the checkpoint was trained at
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only

    def __post_init__(self) -> None:
        if self.type is None:
            return
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(f"model.rope_scaling.type={self.type!r} must be one of {ROPE_SCALING_TYPES} (or null)")
        if self.factor < 1:
            raise ValueError(
                f"model.rope_scaling.factor={self.factor} must be >= 1: the new context over the one the "
                f"checkpoint was trained at (e.g. 16 for 8K -> 128K)"
            )
        if self.type in ("yarn", "llama3") and self.original_max_position_embeddings is None:
            raise ValueError(
                f"model.rope_scaling.type={self.type} needs model.rope_scaling.original_max_position_embeddings: "
                f"set it to the context the checkpoint was trained at (e.g. 8192)"
            )


@dataclass
class LoraConfig:
    """LoRA adapters (peft's) on a frozen base model: ``rank`` 0 trains every weight (full fine-tuning)."""

    rank: int = 0  # adapter rank r; 0 = no adapters (full fine-tuning)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on each adapter's input (not with activation checkpointing or a chunked MLP)
    # leaf names of the linear layers that get adapters; [] = the family's attention and MLP projections
    target_modules: list[str] = field(default_factory=list)
    # modules trained in full beside the adapters (peft's modules_to_save, matched by name suffix: norm = every
    # RMSNorm), e.g. [embed_tokens, norm] as LongLoRA trains for long context; [] = adapters only
    trainable: list[str] = field(default_factory=list)
    # a mixture of experts' expert weights that get adapters (peft's target_parameters: module.parameter names matched
    # by suffix), e.g. [experts.gate_up_proj, experts.down_proj] on qwen3_moe or mixtral; [] = the experts stay frozen
    target_parameters: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(
                f"model.lora.rank={self.rank} must be >= 1 (the adapters' rank), or 0 for full fine-tuning"
            )
        if self.rank == 0:
            return
        if not self.alpha > 0:
            raise ValueError(
                f"model.lora.alpha={self.alpha} must be > 0: the adapters' output is scaled by alpha / rank (e.g. "
                f"alpha = 2 x rank = {2 * self.rank})"
            )
        if not 0 <= self.dropout < 1:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1)")
        if self.dropout and self.target_parameters:
            raise ValueError(
                f"model.lora.dropout={self.dropout} with model.lora.target_parameters: peft adds the experts' adapters "
                f"to their weights, where no dropout on the input can act; set model.lora.dropout=0"
            )


@dataclass
class ModelConfig:
    """A Llama-style model: a local Hugging Face checkpoint directory, or a fresh one built from these sizes."""

    path: str | None = None  # a local HF model directory (config.json + *.safetensors); None = random init
    # for random init: llama, mistral, qwen2, qwen3, gemma3_text, or the mixtures of experts qwen3_moe, mixtral,
    # gpt_oss (the transformers model type; the hybrids: docs/configuration.md)
    family: str = "llama"
    hidden_size: int = 256  # model width (random init)
    intermediate_size: int = 688  # MLP width (random init; a mixture of experts: each expert's)
    num_experts: int = 8  # experts per decoder layer (random init of a mixture of experts)
    experts_per_token: int = 2  # experts each token is routed to, top-k (random init of a mixture of experts)
    # the weight of the router's load-balancing loss in the step's loss (a mixture of experts): null = the checkpoint's
    # (its router_aux_loss_coef when its output_router_logits is set, as transformers trains it, else 0; random
    # init: 0); written into the exported config.json
    router_aux_loss_coef: float | None = None
    num_layers: int = 4  # decoder layers (random init)
    num_heads: int = 8  # attention (query) heads; must be divisible by parallel.ulysses
    num_kv_heads: int = 4  # key/value heads (GQA); divides or is divided by parallel.ulysses
    vocab_size: int | None = None  # None = the tokenizer's vocabulary size
    # the context length the config declares (dynamic and yarn RoPE scale from it); None = the checkpoint's, or
    # 131072 for random init
    max_position_embeddings: int | None = None
    rope_theta: float | None = None  # RoPE base; None = the checkpoint's, or 10000 for random init
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    # the sliding window (tokens each query sees, itself included): null = the checkpoint's own on each layer (random
    # init: none); 0 = none on any layer; W > 0 = W on every layer that has one (Mistral: every layer; Qwen: its
    # sliding_attention layers; random init: every layer; Llama has none). Written into the exported config.json
    sliding_window: int | None = None
    tie_word_embeddings: bool = False  # share the input embedding with the LM head (random init)
    init_std: float = 0.02  # random init: normal(0, init_std) for linear and embedding weights
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters; rank 0 = full fine-tuning

    def __post_init__(self) -> None:
        if self.path is None:  # a checkpoint's own model type is checked when its config is read
            family_of(self.family, model_source(None, self.family))
