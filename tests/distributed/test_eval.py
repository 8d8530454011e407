"""``lctrain eval`` gives the same scores on every mesh: one process, ring 2 × ulysses 2, ring 4, and dp 2 × ring 2.

A tiny random-init Llama (2 layers, width 64, the embedded tokenizer) is exported as a Hugging Face directory;
passkey retrieval runs at 2 lengths × 3 depths (2 samples per cell) and perplexity at 2 lengths (2 rows of a small
jsonl corpus each). Passkey: every sample's argmax tokens at the answer positions, hence its correctness and each
cell's accuracy, are exactly equal; log-probabilities within 1e-5 relative. Perplexity: the same token counts, NLL
within 1e-5 relative. A random model retrieves nothing (accuracy 0), so the argmax tokens are what is compared.
"""

from __future__ import annotations

import json
import math
import random
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lctrain.config import JobConfig, load_config
from lctrain.data import load_tokenizer
from lctrain.eval.run import evaluate
from lctrain.models import build_empty_model, export_hf, materialize, model_config, random_init_source
from lctrain.testing import run_distributed

MESHES = {  # case -> (world size, parallel overrides)
    "single": (1, []),
    "ring2_ulysses2": (4, ["parallel.ring=2", "parallel.ulysses=2"]),
    "ring4": (4, ["parallel.ring=4"]),
    "dp2_ring2": (4, ["parallel.dp=2", "parallel.ring=2"]),
}


def write_model(directory: Path) -> None:
    """A tiny random Llama with the embedded tokenizer, as a Hugging Face directory (weights std 0.2: peaked
    predictions, so an argmax is never a near tie)."""
    tokenizer = load_tokenizer(None)
    cfg = load_config(
        ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=4",
         "model.num_kv_heads=2", "model.init_std=0.2"]
    )  # fmt: skip
    config = model_config(cfg.model, len(tokenizer))
    model = build_empty_model(config)
    materialize(model, random_init_source(config, seed=0), torch.device("cpu"))
    export_hf(model, config, directory, tokenizer=tokenizer)


def write_corpus(path: Path) -> None:
    text = Path(textwrap.__file__).read_text()
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(40):
            start = rng.randrange(len(text) - 1500)
            f.write(json.dumps({"text": text[start : start + rng.randint(100, 1500)]}) + "\n")


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
    write_model(workdir / "model")
    write_corpus(workdir / "corpus.jsonl")
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
