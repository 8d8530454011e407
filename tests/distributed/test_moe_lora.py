"""LoRA adapters on a mixture of experts' expert weights (``model.lora.target_parameters``, peft's ``ParamWrapper``)
train exactly like the single-process peft model, resume exactly, and export an adapter and a merged model that
load in transformers with the same logits.

One spawned gloo group of 4 ranks runs every case (FSDP2 over dp_cp, lctrain's expert kernel with every expert on
each rank), ``STEPS`` steps, the tiny fp32 model of ``tests/helpers/reference_training.py`` with 4
experts, top 2, router load-balancing coefficient 0.1, LoRA rank 4 and alpha 32 on the attention projections and on
both expert weights (``experts.gate_up_proj``, ``experts.down_proj``):

- ``qwen3_moe`` on dp 2 × ring 2 with every RMSNorm trained too (``model.lora.trainable=[norm]``);
- ``mixtral`` on dp 2 × ring 2, adapters only, with full activation checkpointing (the adapters' update to the
  weights is recomputed in the backward) and the export at the end;
- ``qwen3_moe`` on pp 2 (1F1B, 2 micro-batches) × ring 2 with the chunked MLP (8 tokens a chunk: each chunk adds the
  update again), no router loss (refused across stages);
- the first case stopped after 2 steps (a checkpoint at step 2) and resumed to ``STEPS``.

Each against the single-process peft model (``reference_training.py``: ``apply_lora`` on the empty model, the same
seeded init, transformers' own experts forward) at the trainer parity tests' tolerances: the first step's loss
within 1e-5 relative and every trained parameter's gradient within 1e-5 abs + 1e-4 rel, every step's loss within
1e-5 relative and gradient norm within 1e-3 relative. The resumed steps equal the uninterrupted run's exactly.

In the test process: the experts' adapters are trained (nonzero gradients on both weights' ``lora_B``); the checkpoint
holds them under peft's names; ``PeftModel.from_pretrained`` of the exported adapter on the base model (the seeded
init) gives the logits of the merged export loaded with ``from_pretrained`` (1e-5 abs + 1e-5 rel), and not the base
model's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.models import exported_lora_logits
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    case_configs,
    cases_then_resumed,
    job_config,
    reference,
)

STEPS = 4
EXPERTS = ("model.num_experts=4", "model.experts_per_token=2", "model.router_aux_loss_coef=0.1")
ADAPTERS = (
    "model.lora.rank=4",
    "model.lora.alpha=32",
    "model.lora.target_parameters=[experts.gate_up_proj,experts.down_proj]",
)
DP2_RING2 = ("parallel.dp=2", "parallel.ring=2")
# case -> (model overrides, parallel overrides, grad_accum, dp)
CASES = {
    "qwen3_moe-trainable_norm": (("model.family=qwen3_moe", "model.lora.trainable=[norm]"), DP2_RING2, 1, 2),
    "mixtral-ac_full-export": (("model.family=mixtral",), (*DP2_RING2, "parallel.activation_checkpointing=full"), 1, 2),
    "qwen3_moe-pp2-ring2-chunked": (
        ("model.family=qwen3_moe", "model.router_aux_loss_coef=0"),
        ("parallel.pp=2", "parallel.ring=2", "parallel.mlp_chunk_tokens=8"),
        2,
        1,
    ),
}
RESUMED = "qwen3_moe-trainable_norm"
EXPORTED = "mixtral-ac_full-export"
SEQ = 64


def job(workdir: str, case: str, *, run: str | None = None, steps: int = STEPS) -> JobConfig:
    model, parallel, grad_accum, _ = CASES[case]
    cfg = job_config(
        workdir,
        f"{workdir}/run_{run or case}",
        steps=steps,
        grad_accum=grad_accum,
        parallel=parallel,
        model=(*EXPERTS, *ADAPTERS, *model),
    )
    cfg.checkpoint.export_hf = case == EXPORTED and run is None
    return cfg


@functools.cache
def results_for(workdir: str) -> dict:
    return run_distributed(cases_then_resumed, 4, case_configs(job, workdir, CASES, RESUMED))[0]


def reference_for(workdir: str, case: str) -> tuple:
    model, _, grad_accum, dp = CASES[case]
    return reference(
        workdir, steps=STEPS, dp=dp, batch_size=1, grad_accum=grad_accum, model=(*EXPERTS, *ADAPTERS, *model)
    )


@pytest.mark.parametrize("case", list(CASES))
def test_expert_adapters_train_like_the_single_process_peft_model(case: str, parity_workdir: str) -> None:
    result, expected = results_for(parity_workdir)[case], reference_for(parity_workdir, case)
    assert_first_step_matches(result, expected)
    for weight in ("experts.base_layer.lora_B", "experts.lora_B"):  # gate_up_proj's, down_proj's
        assert any(f".{weight}." in name and grad.abs().max() > 0 for name, grad in expected[2].items()), weight
    assert_curve_matches(result, expected, STEPS)


def test_resume_continues_exactly(parity_workdir: str) -> None:
    from lctrain.checkpoint.safe_read import read_metadata

    results = results_for(parity_workdir)
    (losses, norms, _), (full_losses, full_norms, _) = results["resumed"], results[RESUMED]
    assert losses == full_losses[2:] and norms == full_norms[2:]
    keys = read_metadata(Path(parity_workdir) / "run_resumed" / "checkpoints" / "step_00000002").state_dict_metadata
    for weight in ("experts.base_layer.lora_A", "experts.base_layer.lora_B", "experts.lora_A", "experts.lora_B"):
        assert f"model.model.layers.1.mlp.{weight}.default.weight" in keys, weight
    assert not any(".base_layer.base_layer." in key for key in keys)  # the frozen expert weights are not saved


def test_exported_adapter_reloads_with_peft_and_equals_the_merged_export(parity_workdir: str) -> None:
    results_for(parity_workdir)
    run = Path(parity_workdir) / f"run_{EXPORTED}"
    adapter = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight" in saved
    expected, adapted, untrained = exported_lora_logits(run / "adapter", run / "hf", SEQ)
    torch.testing.assert_close(adapted, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(untrained, expected, atol=1e-3)  # the adapters were trained
    exported = load_file(run / "hf" / "model.safetensors")
    assert not any(".lora_" in key or ".base_layer." in key for key in exported)
    # the merged experts in the published layout, one tensor per expert (checkpoint.export_layout's default)
    assert {key.split(".")[5] for key in exported if ".block_sparse_moe.experts." in key} == {"0", "1", "2", "3"}
