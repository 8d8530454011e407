"""LoRA (``model.lora``, peft's adapters on a frozen base) trains exactly like the single-process peft model under
USP attention, FSDP2, pipeline stages, activation checkpointing and the other memory savers; its checkpoints resume
exactly and its exports reload with peft and with ``from_pretrained``.

Two spawned gloo groups, rank 4 and LoRA alpha 32 (so that clipping acts), 6 steps of 2 rows per case, on the
parity model (``reference_training.py``: 2 layers, 4 with pp 2), each case against the single-process peft model
built the same way (``apply_lora`` on the empty model, the same seeded init) at the trainer parity tests'
tolerances: the first step's loss within 1e-5 relative and every trained parameter's gradient within 1e-5 abs +
1e-4 rel, every step's loss within 1e-5 relative and gradient norm within 1e-3 relative. Cases: adapters only and
with ``model.lora.trainable=[embed_tokens, norm]``, checkpointing full and selective, on

- **world 4**: ring 2 × Ulysses 2, and dp 2 × ring 2 (one of them a Mistral with a sliding window of 5). In the
  ring × Ulysses case with ``trainable``, also: the frozen parameters have no gradient and no AdamW state after
  the steps, and their values are bitwise those they started with; FSDP2 reduce-scatters exactly the trained
  parameters' gradients, once per backward (FSDP2's ``foreach_reduce`` is wrapped to count them);
- **world 2**: pp 2 (1F1B; one a Qwen3 with its q/k norms trained), and ring 2 with ``parallel.cpu_offload``,
  activation offload and a chunked MLP (the LM head trained too). The second pp case is run A, with a checkpoint
  every 3 steps and the export; it is relaunched from its step-3 checkpoint as B (pp 2: the same losses and
  exported adapter as A's, bit for bit) and as C on another mesh (ring 2: A's losses within 1e-5 relative); C's
  final checkpoint is relaunched as E, with nothing left to train and ``checkpoint.export_merged=false``.

Observed on CPU (torch 2.13, peft 0.21.2, the 7 cases): first-step losses within 1.1e-7 relative and gradients
within 1.5e-7 absolute; over 6 steps, losses within 1.1e-7 relative and gradient norms within 3.8e-5 relative.

In the test process: a checkpoint holds the trained state and the optimizer only; C and E wrote ``adapter/``, C
also ``hf/``; ``PeftModel.from_pretrained`` of each adapter on the base model (the seeded init) gives the logits of
C's merged export loaded with ``from_pretrained``, and those are the trained sharded model's (1e-5 abs + 1e-5 rel).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from tests.helpers.models import exported_lora_logits
from tests.helpers.reference_training import (
    assert_curve_matches,
    assert_first_step_matches,
    job_config,
    reference,
    train_case,
)

STEPS = 6
ADAPTERS = ("model.lora.rank=4", "model.lora.alpha=32")
TRAINABLE = (*ADAPTERS, "model.lora.trainable=[embed_tokens,norm]")
# the model of a case (model.* overrides): a random-init Llama unless another family is named
MODELS = {
    "adapters": ADAPTERS,
    "trainable": TRAINABLE,
    "mistral_window": (*ADAPTERS, "model.family=mistral", "model.sliding_window=5"),
    "qwen3": (*ADAPTERS, "model.family=qwen3", "model.lora.trainable=[norm]"),  # its q/k norms trained too
    "trainable_head": (*ADAPTERS, "model.lora.trainable=[embed_tokens,norm,lm_head]"),  # the loss reads the copy
}
# other parallel.* settings of a case
SAVERS = {
    "": (),
    "offload": ("parallel.cpu_offload=true", "parallel.activation_offload=true", "parallel.mlp_chunk_tokens=12"),
}
# (world, pp, dp, ring, ulysses, activation checkpointing, model, savers)
Case = tuple[int, int, int, int, int, str, str, str]
CASES: list[Case] = [
    (4, 1, 1, 2, 2, "full", "adapters", ""),
    (4, 1, 1, 2, 2, "selective", "trainable", ""),
    (4, 1, 2, 2, 1, "selective", "mistral_window", ""),
    (4, 1, 2, 2, 1, "full", "trainable", ""),
    (2, 2, 1, 1, 1, "full", "qwen3", ""),
    (2, 2, 1, 1, 1, "selective", "trainable", ""),
    (2, 1, 1, 2, 1, "full", "trainable_head", "offload"),
]
FROZEN_CASE = CASES[1]
RESUMED_CASE = CASES[5]
RESUME_AT = STEPS // 2  # run A's checkpoint that B and C resume from
SEQ = 64


def case_id(case: Case) -> str:
    _, pp, dp, ring, ulysses, ac, model, savers = case
    return f"pp{pp}-dp{dp}-ring{ring}-ulysses{ulysses}-ac_{ac}-{model}" + (f"-{savers}" if savers else "")


def layers_and_rows(case: Case) -> tuple[int, int]:
    """Decoder layers and rows per step (grad_accum; a pipeline needs as many rows as pp ranks)."""
    return (4, 2) if case[1] > 1 else (2, 2)


def job(case: Case, workdir: str) -> JobConfig:
    _, pp, dp, ring, ulysses, ac, model, savers = case
    layers, rows = layers_and_rows(case)
    parallel = [f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.ring={ring}", f"parallel.ulysses={ulysses}"]
    parallel += SAVERS[savers]
    return job_config(
        workdir,
        f"{workdir}/run_{case_id(case)}",
        steps=STEPS,
        num_layers=layers,
        grad_accum=rows,
        parallel=[*parallel, f"parallel.activation_checkpointing={ac}"],
        model=MODELS[model],
    )


def frozen_and_reduced(cfg: JobConfig) -> tuple[tuple, dict[str, Any]]:
    """``train_case`` with the frozen parameters watched: their dtype, values before and after, gradients and AdamW
    state, and the gradients FSDP2 reduce-scatters (counted in its ``foreach_reduce``)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from lctrain.train.trainer import Trainer

    built: list[Trainer] = []
    init = Trainer.__init__

    def keep(self: Trainer, job_cfg: JobConfig) -> None:
        init(self, job_cfg)
        built.append(self)
        frozen = {name: p.to_local().clone() for name, p in self.model.named_parameters() if not p.requires_grad}
        self.frozen_before = frozen  # type: ignore[attr-defined]

    reduced: list[int] = []
    foreach_reduce = param_group.foreach_reduce

    def counting_reduce(fsdp_params: list, unsharded_grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        reduced.append(sum(grad.numel() for grad in unsharded_grads))
        return foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    Trainer.__init__, param_group.foreach_reduce = keep, counting_reduce
    try:
        result = train_case(cfg)
    finally:
        Trainer.__init__, param_group.foreach_reduce = init, foreach_reduce
    trainer = built[0]
    params = dict(trainer.model.named_parameters())
    frozen = {name for name, p in params.items() if not p.requires_grad}
    states = {id(p) for p in trainer.optimizer.state}
    return result, {
        "frozen": frozen,
        "trainable_numel": sum(p.numel() for p in params.values() if p.requires_grad),
        "frozen_with_grad": [name for name in frozen if params[name].grad is not None],
        "frozen_with_state": [name for name in frozen if id(params[name]) in states],
        "frozen_changed": [
            name for name in frozen if not torch.equal(params[name].to_local(), trainer.frozen_before[name])
        ],
        "reduced_per_backward": sum(reduced) / (STEPS * cfg.train.grad_accum),
        "optimizer_params": sum(len(group["params"]) for group in trainer.optimizer.param_groups),
    }


def sharded_logits(trainer: Any) -> torch.Tensor:
    """The trained sharded model's logits ``[1, S, V]`` on a fixed input, gathered (ring only, dp = pp = 1)."""
    input_ids = torch.randint(0, trainer.hf_config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(7))
    shard = functools.partial(trainer.place.shard, dim=1)
    with torch.no_grad():
        logits = trainer.model(
            input_ids=shard(input_ids), position_ids=shard(torch.arange(SEQ)[None]), logits_to_keep=0
        ).logits
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, logits.contiguous())
    from lctrain.attention import unshard_sequence

    return unshard_sequence(shards, dim=1, ring_size=trainer.dims.ring, ulysses_size=1)


def rerun(cfg: JobConfig, run_dir: str, resume: str, **parallel: int) -> JobConfig:
    """``cfg`` relaunched into ``run_dir`` from the checkpoint ``resume``, on the mesh ``parallel`` changes."""
    cfg = copy.deepcopy(cfg)
    cfg.train.run_dir, cfg.checkpoint.resume = run_dir, resume
    for axis, degree in parallel.items():
        setattr(cfg.parallel, axis, degree)
    return cfg


def world_4(configs: dict[Case, JobConfig]) -> dict | None:
    results = {case: train_case(cfg) for case, cfg in configs.items() if case != FROZEN_CASE}
    results[FROZEN_CASE], watched = frozen_and_reduced(configs[FROZEN_CASE])
    return {"results": results, "watched": watched} if dist.get_rank() == 0 else None


def world_2(configs: dict[Case, JobConfig], workdir: str) -> dict | None:
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer

    run_a = configs[RESUMED_CASE]  # A: checkpoints at steps 3 and 6, and the export
    run_a.checkpoint.every, run_a.checkpoint.export_hf = RESUME_AT, True
    out: dict[str, Any] = {"results": {case: train_case(cfg) for case, cfg in configs.items()}}
    checkpoints = f"{run_a.train.run_dir}/checkpoints"
    resume = f"{checkpoints}/step_{RESUME_AT:08d}"
    out["B"] = Trainer(build_training_job(rerun(run_a, f"{workdir}/B", resume))).train()
    run_c = rerun(run_a, f"{workdir}/C", resume, pp=1, ring=2)
    trainer = Trainer(build_training_job(run_c))
    out["C"] = trainer.train()
    out["C_logits"] = sharded_logits(trainer)
    run_e = rerun(run_c, f"{workdir}/E", f"{workdir}/C/checkpoints/step_{STEPS:08d}")  # nothing left to train
    run_e.checkpoint.export_merged = False
    Trainer(build_training_job(run_e)).train()
    return out if dist.get_rank() == 0 else None


@functools.cache
def results_for(world: int, workdir: str) -> dict[str, Any]:
    configs = {case: job(case, workdir) for case in CASES if case[0] == world}
    if world == 4:
        return run_distributed(world_4, 4, configs)[0]
    return run_distributed(world_2, 2, configs, workdir)[0]


def reference_for(case: Case, workdir: str) -> tuple:
    layers, rows = layers_and_rows(case)
    model = MODELS[case[6]]
    return reference(workdir, steps=STEPS, dp=case[2], batch_size=1, grad_accum=rows, num_layers=layers, model=model)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lora_step_matches_single_process_peft_model(case: Case, parity_workdir: str) -> None:
    result, expected = results_for(case[0], parity_workdir)["results"][case], reference_for(case, parity_workdir)
    assert_first_step_matches(result, expected)
    assert any(".lora_B." in name and grad.abs().max() > 0 for name, grad in expected[2].items())
    assert_curve_matches(result, expected, STEPS)


def test_frozen_parameters_get_no_gradient_no_state_and_stay_unchanged(parity_workdir: str) -> None:
    watched = results_for(4, parity_workdir)["watched"]
    assert watched["frozen"] and all(
        ".base_layer." in n or ".original_module." in n or "lm_head" in n for n in watched["frozen"]
    )
    assert watched["frozen_with_grad"] == [] and watched["frozen_with_state"] == []
    assert watched["frozen_changed"] == []
    # every trainable parameter's gradient once per backward (in 3 units: 2 layers and the root), nothing frozen
    assert watched["reduced_per_backward"] == watched["trainable_numel"]
    assert watched["optimizer_params"] == len(reference_for(FROZEN_CASE, parity_workdir)[2])


def run_dir(case: Case, workdir: str) -> Path:
    return Path(workdir) / f"run_{case_id(case)}"


def test_resume_from_a_lora_checkpoint_is_exact(parity_workdir: str) -> None:
    out = results_for(2, parity_workdir)
    a = out["results"][RESUMED_CASE][0]
    assert out["B"] == a[RESUME_AT:]  # the same mesh: bit for bit
    as_float64 = functools.partial(torch.tensor, dtype=torch.float64)
    torch.testing.assert_close(as_float64(out["C"]), as_float64(a[RESUME_AT:]), atol=0, rtol=1e-5)  # another mesh
    exported_a = load_file(run_dir(RESUMED_CASE, parity_workdir) / "adapter" / "adapter_model.safetensors")
    exported_b = load_file(Path(parity_workdir) / "B" / "adapter" / "adapter_model.safetensors")
    assert exported_a.keys() == exported_b.keys()
    assert all(torch.equal(exported_a[key], exported_b[key]) for key in exported_a)


def test_lora_checkpoint_holds_the_trained_state_and_the_optimizer_only(parity_workdir: str) -> None:
    from lctrain.checkpoint.safe_read import read_metadata

    results_for(2, parity_workdir)
    checkpoint = run_dir(RESUMED_CASE, parity_workdir) / "checkpoints" / f"step_{RESUME_AT:08d}"
    keys = read_metadata(checkpoint).state_dict_metadata
    weights = [key for key in keys if key.startswith("model.")]
    assert weights and all(".lora_" in key or ".modules_to_save." in key for key in weights), weights
    assert not any(".base_layer." in key or ".original_module." in key or "lm_head" in key for key in keys)
    assert any(key.startswith("optim.state.") and key.endswith(".exp_avg") for key in keys)


@pytest.mark.parametrize("name", ["C", "E"])
def test_adapter_reloads_with_peft_and_equals_the_merged_export(parity_workdir: str, name: str) -> None:
    out, root = results_for(2, parity_workdir), Path(parity_workdir)
    adapter = root / name / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert (root / name / "hf").is_dir() is (name == "C")  # E: checkpoint.export_merged=false
    expected, adapted, untrained = exported_lora_logits(adapter, root / "C" / "hf", SEQ)  # E exports C's final state
    torch.testing.assert_close(adapted, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["C_logits"], expected, atol=1e-5, rtol=1e-5)  # the trained sharded model's
    assert not torch.allclose(untrained, expected, atol=1e-3)  # the adapters were trained
    exported = load_file(root / "C" / "hf" / "model.safetensors")
    assert not any(".lora_" in key or ".modules_to_save." in key or ".base_layer." in key for key in exported)
