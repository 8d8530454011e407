"""The typed configuration of a training run: one dataclass per component, each field documented and checked where it
is defined (``__post_init__``: one ``ValueError`` naming the setting and the fix, raised when the config is made).
The ``model`` and ``data`` sections live with the code that reads them (``lctrain.models.config``,
``lctrain.data.config``); the rules that join sections or need the model are ``lctrain.config.checks``'. Importing
this module loads neither torch nor transformers.

Hydra composes ``configs/train.yaml`` (its defaults list picks one file from each group, then a recipe from
``recipes/`` when ``recipe=NAME`` is given) on top of ``JobConfig``; any field can be overridden on the
command line (``optim.lr=1e-3``). Each component receives only its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lctrain.config.ruler import RulerConfig
from lctrain.data.config import DataConfig
from lctrain.models.config import ModelConfig
from lctrain.parallel.config import ParallelConfig

EVAL_TASKS = ("passkey", "perplexity", "ruler")


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay, and global-norm gradient clipping."""

    lr: float = 3e-4  # peak learning rate (after warmup)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay, on matrices only (not norms or biases)
    warmup_steps: int = 10  # linear warmup from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1  # the cosine ends at lr · min_lr_ratio at the last step
    max_grad_norm: float | None = 1.0  # None = no clipping (the norm is still reported)

    def __post_init__(self) -> None:
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if len(self.betas) != 2:
            raise ValueError(f"optim.betas={self.betas} must be two numbers, e.g. [0.9, 0.95]")


@dataclass
class TrainConfig:
    """The loop: steps, accumulation, seed, device and where the run writes."""

    steps: int = 100  # optimizer steps of the whole run (the cosine ends here)
    grad_accum: int = 1  # micro-batches per optimizer step
    seed: int = 0  # weight init (random init) and torch's RNG
    run_dir: str = "runs/default"  # config.yaml, metrics.jsonl, loss.png, checkpoints/, hf/
    device: str = "auto"  # auto (cuda if available), cuda or cpu
    nonfinite: str = "stop"  # a step whose gradient norm is NaN/inf: stop (raise) or skip (no update, logged)
    loss_chunk_tokens: int = 1024  # tokens per chunk of the cross-entropy (the logits of one chunk exist at once)
    # a mixture of experts' router load-balancing loss pools its statistics over: sequence = each packed row (over
    # its context-parallel ranks), the loss the mean over the rows; global = the whole step (dp x accumulation), from
    # a no-grad forward of the step's rows first (one more forward per row)
    router_aux_scope: str = "sequence"
    peak_tflops: float | None = None  # per-device peak for the MFU estimate; None = known GPUs only
    timeout_s: float = 600.0  # a collective waiting longer than this for other ranks stops the job with an error
    # progressive training: stages run one after another, each a mapping of settings over this job
    # ({data.seq_len: 32768, train.steps: 200, parallel.ring: 4}), in <run_dir>/stage_<k>, each starting from the
    # previous stage's exported weights; [] = one run
    stages: list[dict[str, Any]] = field(default_factory=list)
    val_every: int = 0  # score data.val_sources every this many steps, and at the end; 0 = only at the end
    val_rows: int = 8  # packed rows of data.val_sources scored each time (the same rows every time)
    # also the key-token loss: the tokens the model predicts far better with the whole row than with this many tokens
    # before them (lctrain.train.key_tokens); 0 = off
    val_key_window: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "loss_chunk_tokens", "val_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError(f"train.timeout_s={self.timeout_s} must be > 0 (seconds a collective may wait)")
        if self.nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.nonfinite={self.nonfinite!r} must be stop or skip")
        if self.router_aux_scope not in ("sequence", "global"):
            raise ValueError(f"train.router_aux_scope={self.router_aux_scope!r} must be sequence or global")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"train.device={self.device!r} must be auto, cuda or cpu")
        if self.val_every < 0:
            raise ValueError(f"train.val_every={self.val_every} must be >= 0 (0 = only at the end)")
        if self.val_key_window < 0 or self.val_key_window % 2:
            raise ValueError(f"train.val_key_window={self.val_key_window} must be an even number of tokens (0 = off)")


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (DCP) in ``<run_dir>/checkpoints/step_XXXXXXXX`` and the Hugging Face export."""

    every: int = 100  # steps between checkpoints (and one at the end); 0 = only at the end
    keep: int = 2  # newest complete checkpoints kept; older ones are deleted
    resume: str = "auto"  # auto (latest complete checkpoint in run_dir, if any), none, or a checkpoint directory
    export_hf: bool = True  # at the end, write a Hugging Face model directory to <run_dir>/hf
    # LoRA (model.lora.rank > 0): the export writes the adapter to <run_dir>/adapter (peft's format) and, with this,
    # the base model with the adapters merged into <run_dir>/hf
    export_merged: bool = True
    # the names and shapes of the exported weights: published (what save_pretrained writes and every checkpoint on the
    # Hub has: a mixture of experts' experts one tensor each) or fused (transformers' in-memory names: the experts
    # stacked in one tensor per projection); the same for a family transformers converts nothing of
    export_layout: str = "published"

    def __post_init__(self) -> None:
        if self.export_layout not in ("published", "fused"):
            raise ValueError(f"checkpoint.export_layout={self.export_layout!r} must be published or fused")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep={self.keep} must be >= 1")
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every} must be >= 0 (0 = only at the end)")


@dataclass
class LoggingConfig:
    """Rank 0 prints one metrics line per `every` steps and writes every step to <run_dir>/metrics.jsonl and to the
    trackers enabled (W&B, TensorBoard, MLflow; several at once: ``lctrain.train.trackers``)."""

    every: int = 1  # print the metrics line every this many steps
    progress_bar: bool = True  # a tqdm bar on rank 0
    wandb: str = "disabled"  # disabled, offline (local files) or online
    wandb_project: str = "lctrain"  # the W&B project name
    tensorboard: bool = False  # TensorBoard event files in <run_dir>/tensorboard (pip install 'lctrain[tensorboard]')
    mlflow: bool = False  # an MLflow run of every step, the config and the plots (pip install 'lctrain[mlflow]')
    # MLflow's tracking URI: a server (http://host:5000) or a store (sqlite:///path.db); None = a SQLite store with the
    # artifacts in <run_dir>/mlflow
    mlflow_uri: str | None = None
    mlflow_experiment: str = "lctrain"  # the MLflow experiment the run belongs to (created when missing)
    plot: bool = True  # write <run_dir>/loss.png at the end

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"logging.every={self.every} must be >= 1")
        if self.wandb not in ("disabled", "offline", "online"):
            raise ValueError(f"logging.wandb={self.wandb!r} must be disabled, offline or online")


@dataclass
class EvalConfig:
    """``python -m lctrain eval``: passkey retrieval and perplexity of model.path on the job's mesh. Whether the mesh
    cuts the lengths whole is ``lctrain.eval.evaluator.check_eval``'s."""

    # passkey, perplexity and/or ruler (the suite of the ruler section)
    tasks: list[str] = field(default_factory=lambda: ["passkey", "perplexity"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])  # passkey sample lengths (tokens)
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # needle depths, 0 = start
    samples: int = 5  # passkey samples (different keys) per (length, depth) cell
    digits: int = 5  # digits of each pass key
    seed: int = 0  # seed of the pass keys
    perplexity_lengths: list[int] = field(default_factory=list)  # row lengths for perplexity; [] = eval.lengths
    perplexity_rows: int = 4  # packed rows of data.* documents per perplexity length
    out_dir: str | None = None  # where the results go; None = <train.run_dir>/eval

    def __post_init__(self) -> None:
        unknown = [task for task in self.tasks if task not in EVAL_TASKS]
        if unknown or not self.tasks:
            raise ValueError(f"eval.tasks={self.tasks} must be a non-empty list of {EVAL_TASKS}")
        if "passkey" in self.tasks and (not self.lengths or not self.depths):
            raise ValueError(f"eval.lengths={self.lengths} and eval.depths={self.depths} must not be empty for passkey")
        if any(not 0.0 <= depth <= 1.0 for depth in self.depths):
            raise ValueError(f"eval.depths={self.depths} must be fractions in [0, 1] (0 = start of the haystack)")
        for name in ("samples", "digits", "perplexity_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")


OBJECTIVES = ("lm", "dpo")
# TRL's names; the reference-free ones need no reference model
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "sft")
REFERENCE_FREE_LOSSES = ("simpo", "orpo", "sft")
REFERENCES = ("initial", "path", "none")


@dataclass
class ObjectiveConfig:
    """What a step minimizes: the language-modelling loss (``lm``) or a preference loss on packed pairs (``dpo``:
    the ``loss_type`` terms, weighted, as TRL's ``DPOConfig``); docs/preference.md has the formulas."""

    name: str = "lm"  # lm (token-mean cross-entropy of the trained tokens) or dpo (preference pairs)
    # dpo: the loss terms, summed with loss_weights: sigmoid, ipo, hinge, robust, simpo, orpo, sft
    loss_type: list[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: list[float] = field(default_factory=list)  # one per loss_type; [] = 1.0 each
    beta: float = 0.1  # dpo: the KL temperature (ipo: its tau; simpo and orpo: their beta, as TRL's)
    label_smoothing: float = 0.0  # robust: the assumed rate of flipped labels, in [0, 0.5)
    simpo_gamma: float = 0.5  # simpo: the target reward margin
    # the reference model of the losses that need one: initial (the initial policy: with LoRA the base with the
    # adapters disabled, else a frozen copy sharded like the policy), path (a Hugging Face directory,
    # reference_path) or none (only with reference-free losses: simpo, orpo, sft)
    reference: str = "initial"
    reference_path: str | None = None  # reference=path: the Hugging Face model directory
    # compute the reference's log-probs of every pair the run trains and validates on in one pass before training,
    # keep them with the run (<run_dir>/reference_logps/), and drop the reference model
    precompute_reference: bool = False

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective.name={self.name!r} must be one of {', '.join(OBJECTIVES)}")
        if self.name == "lm":
            return
        unknown = [loss for loss in self.loss_type if loss not in PREFERENCE_LOSSES]
        if unknown or not self.loss_type or len(set(self.loss_type)) < len(self.loss_type):
            raise ValueError(
                f"objective.loss_type={list(self.loss_type)}: give distinct terms among {', '.join(PREFERENCE_LOSSES)}"
            )
        if self.loss_weights and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"objective.loss_weights={list(self.loss_weights)}: give one weight per objective.loss_type "
                f"({len(self.loss_type)}), or [] for 1.0 each"
            )
        if not self.beta > 0:
            raise ValueError(f"objective.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"objective.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.reference not in REFERENCES:
            raise ValueError(f"objective.reference={self.reference!r} must be one of {', '.join(REFERENCES)}")
        if (self.reference == "path") != (self.reference_path is not None):
            raise ValueError(
                f"objective.reference={self.reference} with objective.reference_path={self.reference_path}: set "
                f"both (reference=path and a Hugging Face directory) or neither"
            )
        if self.reference == "none" and self.needs_reference:
            raise ValueError(
                f"objective.loss_type={list(self.loss_type)} with objective.reference=none: "
                f"{', '.join(loss for loss in self.loss_type if loss not in REFERENCE_FREE_LOSSES)} compare with a "
                f"reference model; set objective.reference=initial or use only {', '.join(REFERENCE_FREE_LOSSES)}"
            )

    @property
    def needs_reference(self) -> bool:
        """A term compares the policy with a reference model (the reference-free terms alone build none)."""
        return self.name == "dpo" and any(loss not in REFERENCE_FREE_LOSSES for loss in self.loss_type)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    ruler: RulerConfig = field(default_factory=RulerConfig)

    @property
    def step_rows(self) -> int:
        """The rows of one optimizer step on each dp rank, ``data.batch_size`` × ``train.grad_accum``: with a
        pipeline, the step's micro-batches."""
        return self.data.batch_size * self.train.grad_accum
