"""``lctrain eval`` gives the scores the Hugging Face model gives, on every mesh: one process, ring 2 × ulysses 2,
ring 4, and dp 2 × ring 2.

A tiny random-init Llama (2 layers, width 64, the embedded tokenizer) is exported as a Hugging Face directory;
passkey retrieval runs at 2 lengths × 3 depths (2 samples per cell) and perplexity at 2 lengths (2 rows of a small
jsonl corpus each). Passkey: every sample's argmax tokens at the answer positions, hence its correctness and each
cell's accuracy, are exactly equal; log-probabilities within 1e-5 relative. Perplexity: the same token counts, NLL
within 1e-5 relative. A random model retrieves nothing (accuracy 0), so the argmax tokens are what is compared.

The independent reference: the exported directory loaded with ``AutoModelForCausalLM.from_pretrained`` (eager
attention, fp32, one process), run on each passkey sample and on each document of each perplexity row separately;
the answer's log-probability, the argmax tokens and the NLL computed directly from its logits. The one-process
lctrain scores equal it: argmax tokens exactly, log-probabilities and NLL within 1e-5 relative.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lctrain.config import JobConfig, load_config
from lctrain.data import IGNORE_INDEX, PackedLoader, load_tokenizer
from lctrain.eval.passkey import passkey_sample, sample_key
from lctrain.eval.run import evaluate
from lctrain.testing import run_distributed
from testbed.corpus import write_corpus
from tests.helpers.models import write_peaked_model

MESHES = {  # case -> (world size, parallel overrides)
    "single": (1, []),
    "ring2_ulysses2": (4, ["parallel.ring=2", "parallel.ulysses=2"]),
    "ring4": (4, ["parallel.ring=4"]),
    "dp2_ring2": (4, ["parallel.dp=2", "parallel.ring=2"]),
}


def job(workdir: Path, case: str) -> JobConfig:
    return load_config(
        [
            f"model.path={workdir}/model",
            f"data.paths=[{workdir}/corpus.jsonl]",
            "data.seq_len=128",
            *MESHES[case][1],
            "eval.lengths=[128,256]",
            "eval.depths=[0.0,0.5,1.0]",
            "eval.samples=2",
            "eval.perplexity_lengths=[64,128]",
            "eval.perplexity_rows=3",  # dp 2: one rank scores 2 rows, the other 1 (+ a dropped forward)
            "train.device=cpu",
            "train.loss_chunk_tokens=24",
            f"train.run_dir={workdir}/{case}",
        ]
    )


def world_job(configs: dict[str, JobConfig]) -> dict | None:
    results = {case: evaluate(cfg) for case, cfg in configs.items()}
    return results if dist.get_rank() == 0 else None


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("eval")
    write_peaked_model(workdir / "model")
    write_corpus(workdir / "corpus.jsonl", 40, long_fraction=1.0, long=(100, 1500))  # rows start at a document
    results = {}
    for world in sorted({world for world, _ in MESHES.values()}):
        configs = {case: job(workdir, case) for case, (w, _) in MESHES.items() if w == world}
        results.update(run_distributed(world_job, world, configs)[0])
    return workdir, results


@pytest.mark.parametrize("case", [case for case in MESHES if case != "single"])
def test_passkey_scores_are_identical_on_every_mesh(evaluated: tuple[Path, dict], case: str) -> None:
    _, results = evaluated
    expected, got = results["single"]["passkey"], results[case]["passkey"]
    assert [(c["length"], c["depth"]) for c in got] == [(c["length"], c["depth"]) for c in expected]
    assert len(expected) == 6
    for cell, ref in zip(got, expected):
        assert cell["accuracy"] == ref["accuracy"] and cell["token_accuracy"] == ref["token_accuracy"]
        for sample, ref_sample in zip(cell["samples"], ref["samples"], strict=True):
            exact = ("key", "needle_depth", "predicted", "correct", "correct_tokens", "answer_tokens")
            assert {k: sample[k] for k in exact} == {k: ref_sample[k] for k in exact}
            assert math.isclose(sample["logprob"], ref_sample["logprob"], rel_tol=1e-5)
        assert math.isclose(cell["answer_logprob"], ref["answer_logprob"], rel_tol=1e-5)


def hf_reference(workdir: Path, cfg: JobConfig) -> dict:
    """Passkey and perplexity of the exported model computed directly with transformers (see the module doc)."""
    model = AutoModelForCausalLM.from_pretrained(workdir / "model", attn_implementation="eager").eval()
    tokenizer = load_tokenizer(str(workdir / "model"))
    ev = cfg.eval
    passkey = []
    with torch.no_grad():
        for length in ev.lengths:
            for depth in ev.depths:
                for i in range(ev.samples):
                    sample = passkey_sample(tokenizer, length, depth, sample_key(ev.seed, length, depth, i, ev.digits))
                    logprobs = torch.log_softmax(model(input_ids=sample.input_ids[None]).logits[0].double(), dim=-1)
                    positions = (sample.labels != IGNORE_INDEX).nonzero()[:, 0]
                    targets = sample.labels[positions]
                    predicted = logprobs[positions].argmax(-1)
                    passkey.append(
                        {
                            "predicted": tokenizer.decode(predicted),
                            "logprob": logprobs[positions, targets].sum().item(),
                        }
                    )
        perplexity = []
        for length in ev.perplexity_lengths:
            data = dataclasses.replace(cfg.data, seq_len=length, truncate=True, tokenizer=str(workdir / "model"))
            rows = iter(PackedLoader(data))
            nll, tokens = 0.0, 0
            for _ in range(ev.perplexity_rows):
                row = next(rows)
                bounds = row["cu_seqlens"][0].tolist()
                for start, stop in zip(bounds, bounds[1:]):  # each document on its own, positions from 0
                    logits = model(input_ids=row["input_ids"][:, start:stop]).logits[0].double()
                    labels = row["labels"][0, start:stop]
                    valid = labels != IGNORE_INDEX
                    nll -= torch.log_softmax(logits[valid], -1).gather(1, labels[valid][:, None]).sum().item()
                    tokens += int(valid.sum())
            perplexity.append({"length": length, "tokens": tokens, "nll": nll / tokens})
    return {"passkey": passkey, "perplexity": perplexity}


def test_one_process_scores_equal_the_hugging_face_model(evaluated: tuple[Path, dict]) -> None:
    workdir, results = evaluated
    reference = hf_reference(workdir, job(workdir, "single"))
    samples = [sample for cell in results["single"]["passkey"] for sample in cell["samples"]]
    assert len(samples) == len(reference["passkey"]) == 12
    for sample, ref in zip(samples, reference["passkey"], strict=True):
        assert sample["predicted"] == ref["predicted"]
        assert math.isclose(sample["logprob"], ref["logprob"], rel_tol=1e-5), (sample["logprob"], ref["logprob"])
    for result, ref in zip(results["single"]["perplexity"], reference["perplexity"], strict=True):
        assert (result["length"], result["tokens"]) == (ref["length"], ref["tokens"])
        assert math.isclose(result["nll"], ref["nll"], rel_tol=1e-5), (result["nll"], ref["nll"])


@pytest.mark.parametrize("case", [case for case in MESHES if case != "single"])
def test_perplexity_is_identical_on_every_mesh(evaluated: tuple[Path, dict], case: str) -> None:
    _, results = evaluated
    expected, got = results["single"]["perplexity"], results[case]["perplexity"]
    counts = [[(r["length"], r["rows"], r["tokens"]) for r in results] for results in (got, expected)]
    assert counts[0] == counts[1]
    for result, ref in zip(got, expected):
        assert result["tokens"] > 0.9 * result["rows"] * result["length"]  # rows mostly hold predicted tokens
        assert math.isclose(result["nll"], ref["nll"], rel_tol=1e-5)


def test_scores_and_heat_map_are_written_to_the_run_directory(evaluated: tuple[Path, dict]) -> None:
    workdir, results = evaluated
    out = workdir / "ring2_ulysses2" / "eval"
    passkey = json.loads((out / "passkey.json").read_text())
    assert passkey["mesh"] == {"dp": 1, "ring": 2, "ulysses": 2, "layout": "zigzag"}
    assert passkey["cells"] == json.loads(json.dumps(results["ring2_ulysses2"]["passkey"]))
    assert (out / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    perplexity = json.loads((out / "perplexity.json").read_text())
    assert [r["length"] for r in perplexity["lengths"]] == [64, 128]
