"""The layout planner, ``python -m lctrain plan``: a (pp, dp, ring, ulysses) layout for a model, a sequence length
and a cluster.

For every layout whose degrees multiply to the number of GPUs and that lctrain accepts (the rules of
``lctrain.rules`` that ``lctrain.config.check_job`` applies, in ``layout_problems``), the planner estimates

- the peak memory per GPU, term by term (``MemoryEstimate``): sharded parameters, gradients and AdamW states; the
  parameters FSDP gathers; the activations kept for the backward; the recomputed layer; one layer's backward
  working set; the chunked loss;
- one ring step (``RingStep``): the attention a GPU computes while K/V (in the backward also dK/dV) travel one
  hop, and whether the transfer hides behind it, S/R ≥ C/W: compute per step grows with (S/R)², bytes with S/R,
  so it hides once S/R ≥ ``threshold_tokens`` (a constant of the model times C/W);
- the time of one optimizer step (``StepTime``): FLOPs at an assumed fraction of peak, plus what communication
  cannot hide.

It recommends one layout (``recommend``) and can write it as a recipe (``recipe_text``). ``docs/planner.md`` derives
every term, lists the assumptions and the estimate's error against measured peaks
(``python -m benchmarks.validate_planner``). Pure arithmetic: importing it loads neither torch nor transformers.

Modules: ``presets`` (the inputs), ``memory``, ``timing``, ``search`` (checks, estimates, recommendation),
``report`` (table, recipe), ``cli``; ``probe`` (``python -m lctrain probe``) measures a cluster's links and attention
kernel under torchrun and writes the hardware file the planner reads: it imports torch, so this package does not
import it.
"""

from lctrain.planner.cli import main, parser
from lctrain.planner.memory import (
    MemoryEstimate,
    estimate_memory,
    kv_width,
    layer_activation_bytes,
    layer_backward_bytes,
    stage_memory,
)
from lctrain.planner.presets import FP32, GIB, HARDWARE, NAMED_MODELS, Hardware, Layout, ModelSpec, Workload, load_model
from lctrain.planner.report import SBATCH_GPUS_PER_NODE, describe, recipe_text, table
from lctrain.planner.search import Plan, evaluate, layout_problems, meshes, plan_layouts, ranked, recommend
from lctrain.planner.timing import RingStep, StepTime, ring_step, step_time

__all__ = [
    "FP32",
    "GIB",
    "HARDWARE",
    "NAMED_MODELS",
    "SBATCH_GPUS_PER_NODE",
    "Hardware",
    "Layout",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "RingStep",
    "StepTime",
    "Workload",
    "describe",
    "estimate_memory",
    "evaluate",
    "kv_width",
    "layer_activation_bytes",
    "layer_backward_bytes",
    "layout_problems",
    "load_model",
    "main",
    "meshes",
    "parser",
    "plan_layouts",
    "ranked",
    "recipe_text",
    "recommend",
    "ring_step",
    "stage_memory",
    "step_time",
    "table",
]
