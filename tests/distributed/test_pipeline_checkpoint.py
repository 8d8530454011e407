"""Checkpoints and export with pipeline stages: pp=2 resumes exactly, a pp=2 checkpoint loads with pp=1, and the
sharded Hugging Face export loads with ``from_pretrained``.

One spawned gloo group of 2 ranks runs, on a small jsonl corpus, a 4-layer model with ``Interleaved1F1B`` (pp=2,
2 stages per rank, so each rank's checkpoint part is two stages merged):

- **A**: 6 steps, a checkpoint every 3 (``step_3``, ``step_6``), then the export to ``hf/``;
- **B**: pp=2 again, from ``A/step_3`` to step 6: the same losses as A's steps 4-6, bit for bit;
- **C**: pp=1 with ring=2 (same world size, a different mesh) from ``A/step_3``: A's losses within 1e-5 relative
  (the same data and weights, summed in another order; observed ~1e-7);
- **D**: pp=1 with ring=2 from ``A/step_6`` with nothing left to train, then its export: every exported tensor
  equals A's export exactly (the pp=2 checkpoint loaded into pp=1 unchanged, both exports write the same weights);
- **E**: pp=1 with dp=2 from ``A/step_3`` fails before training, naming ``parallel.dp`` and the fix.

In the test process: A's ``metrics.jsonl`` (written by rank 0, which holds no loss itself with pp=2) has A's losses;
A's export is sharded (``model-00001-of-00002.safetensors``, ``model-00002-of-00002.safetensors`` and the index);
``from_pretrained`` loads it with no missing or unexpected keys and its weights are A's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lctrain.config import JobConfig
from lctrain.testing import run_distributed
from lctrain.train.job import build_training_job
from lctrain.train.trainer import Trainer
from testbed.corpus import write_corpus
from tests.helpers.reference_training import job_config

STEPS = 6
PIPELINE = ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=2"]
RING = ["parallel.ring=2"]


def job(workdir: str, name: str, parallel: list[str], *, resume: str = "none", every: int = 0) -> JobConfig:
    cfg = job_config(
        workdir, f"{workdir}/{name}", steps=STEPS, num_layers=4, batch_size=1, grad_accum=2, parallel=parallel
    )
    cfg.checkpoint.resume = resume
    cfg.checkpoint.every = every
    cfg.checkpoint.export_hf = True
    return cfg


def run_jobs(workdir: str) -> dict[str, object] | None:
    step_3, step_6 = f"{workdir}/A/checkpoints/step_00000003", f"{workdir}/A/checkpoints/step_00000006"
    results: dict[str, object] = {"A": Trainer(build_training_job(job(workdir, "A", PIPELINE, every=3))).train()}
    results["B"] = Trainer(build_training_job(job(workdir, "B", PIPELINE, resume=step_3))).train()
    results["C"] = Trainer(build_training_job(job(workdir, "C", RING, resume=step_3))).train()
    results["D"] = Trainer(build_training_job(job(workdir, "D", RING, resume=step_6))).train()
    try:
        Trainer(build_training_job(job(workdir, "E", ["parallel.dp=2"], resume=step_3)))
    except ValueError as error:
        results["E"] = str(error)
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline_checkpoint")
    write_corpus(root / "corpus.jsonl")
    return root


@functools.cache
def results(workdir: Path) -> dict[str, object]:
    return run_distributed(run_jobs, 2, str(workdir))[0]


def test_pp2_resume_gives_the_same_losses(workdir: Path) -> None:
    losses = results(workdir)
    assert len(losses["A"]) == STEPS and len(losses["B"]) == STEPS - 3
    assert losses["B"] == losses["A"][3:]
    logged = [json.loads(line) for line in (workdir / "A" / "metrics.jsonl").read_text().splitlines()]
    assert [record["loss"] for record in logged] == losses["A"]


def test_pp2_checkpoint_loads_with_pp1(workdir: Path) -> None:
    losses = results(workdir)
    torch.testing.assert_close(torch.tensor(losses["C"]), torch.tensor(losses["A"][3:]), atol=0, rtol=1e-5)
    assert losses["D"] == []
    exported_pp2 = load_file(workdir / "A" / "hf" / "model-00001-of-00002.safetensors")
    exported_pp2 |= load_file(workdir / "A" / "hf" / "model-00002-of-00002.safetensors")
    exported_pp1 = load_file(workdir / "D" / "hf" / "model.safetensors")
    assert exported_pp2.keys() == exported_pp1.keys()
    for name, tensor in exported_pp1.items():
        assert torch.equal(exported_pp2[name], tensor), name


def test_resume_with_another_dp_names_the_setting(workdir: Path) -> None:
    message = results(workdir)["E"]
    assert "was saved with parallel.dp=1 and this job has parallel.dp=2" in message
    assert "resume with parallel.dp=1 (pp, ring and ulysses may change)" in message
    assert not (workdir / "E" / "checkpoints").exists()


def test_sharded_export_loads_with_from_pretrained(workdir: Path) -> None:
    results(workdir)
    hf_dir = workdir / "A" / "hf"
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert index["weight_map"]["lm_head.weight"] == "model-00002-of-00002.safetensors"
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported = load_file(workdir / "D" / "hf" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, exported[name]), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values())
