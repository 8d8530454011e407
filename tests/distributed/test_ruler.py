"""The ruler suite scored on the training mesh equals the Hugging Face model's scores and greedy decoding, on every
mesh; a model trained on the task's format scores above chance; the suite runs during training with its figures in
``metrics.jsonl``, and the key-token loss equals a direct computation.

Models: a tiny random Llama with peaked predictions (``write_peaked_model``: argmaxes are never near ties) scored on
the seven generated tasks at 320 tokens (two examples to a row) and 640 (needles at depths 0 and 1), and a tiny Llama
trained in the test on the multiple-choice format (``tests/helpers/ruler.py``) scored on a choice file at 192 tokens
(records cut in the middle, two to a row) and 512 (records after a padding document).

- One process, ring 2 x Ulysses 2 and pp 2 x ring 2 (GPipe): every example's predicted tokens, match, parts and
  score exactly equal; log-probabilities within 1e-5 relative.
- The one-process records against transformers (``AutoModelForCausalLM.from_pretrained``, eager attention, each
  example alone without its padding document): the argmax tokens at the answer positions exactly, the answer's
  log-probability within 1e-5 relative (or 1e-5 absolute, near 0); and ``generate`` (greedy) writes the answer
  exactly when ``match``, and agrees with the teacher-forced argmax up to its first wrong token.
- Training (ring 2 x Ulysses 2, 2 steps, ``ruler.every=1``, validation with ``train.val_key_window=64``): the suite's
  figures at both steps in ``metrics.jsonl``, its files and plot; the last step's records equal ``lctrain eval`` of
  the export on one process, and the same run's on pp 2 x ring 2; the key-token loss and count equal a computation
  with transformers on the export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from lctrain.config import JobConfig, load_config
from lctrain.data import IGNORE_INDEX, PackedLoader, load_tokenizer
from lctrain.eval.run import evaluate
from lctrain.testing import run_distributed
from lctrain.train.job import build_training_job
from lctrain.train.key_tokens import ALPHA, BETA
from lctrain.train.trainer import Trainer
from lctrain.train.validate import validation_data
from tests.helpers.models import write_peaked_model
from tests.helpers.ruler import choice_text, train_choice_model, write_choices

MESHES = {
    "single": [],
    "ring2_ulysses2": ["parallel.ring=2", "parallel.ulysses=2"],
    "pp2_ring2": ["parallel.pp=2", "parallel.ring=2", "parallel.pp_schedule=GPipe"],
}
GENERATED = [
    "ruler.tasks=[niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe,fwe]",
    "ruler.lengths=[320,640]",  # two 320-token examples to a row
    "ruler.depths=[0.0,1.0]",
    "ruler.samples=1",
]
KEY_WINDOW = 64


def choice_suite(workdir: Path) -> list[str]:
    return ["ruler.tasks=[choice]", f"ruler.choice_path={workdir}/choices.jsonl", "ruler.lengths=[192,512]"]


def eval_job(workdir: Path, model: str, case: str, suite: list[str]) -> JobConfig:
    return load_config(
        [f"model.path={workdir}/{model}", "eval.tasks=[ruler]", "train.device=cpu",
         "data.seq_len=512", f"eval.out_dir={workdir}/eval/{model}_{case}", *MESHES[case], *suite]
    )  # fmt: skip


def train_job(workdir: Path, case: str = "ring2_ulysses2") -> JobConfig:
    """Two steps with the suite at each; on ring 2 x Ulysses 2 also the validation with the key-token loss (a
    pipeline validates nothing)."""
    validation = [f"data.val_sources=[{{name: choices, paths: [{workdir}/val.jsonl]}}]", "train.val_rows=2",
                  f"train.val_key_window={KEY_WINDOW}"]  # fmt: skip
    return load_config(
        [f"model.path={workdir}/trained", f"data.paths=[{workdir}/docs.jsonl]", "data.seq_len=512",
         "train.steps=2", "train.device=cpu", f"train.run_dir={workdir}/train_{case}", "optim.lr=1e-5",
         "optim.warmup_steps=1", "checkpoint.every=0", "logging.progress_bar=false", "ruler.every=1",
         *choice_suite(workdir), *MESHES[case], *(validation if case == "ring2_ulysses2" else [])]
    )  # fmt: skip


def world_job(jobs: list[tuple[str, JobConfig]]) -> None:
    for kind, cfg in jobs:
        Trainer(build_training_job(cfg)).train() if kind == "train" else evaluate(cfg)
    dist.barrier()


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "ruler_examples.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("ruler")
    write_peaked_model(workdir / "random")
    train_choice_model(workdir / "trained")
    write_choices(workdir / "choices.jsonl", seed=1, count=8, words=(30, 90), needle_within=25)
    tokenizer = load_tokenizer(str(workdir / "trained"))
    # training and validation documents; three or so of the shorter validation documents fit in a row
    for name, seed, count, words in (("docs", 2, 16, (60, 90)), ("val", 3, 8, (30, 60))):
        records_ = write_choices(workdir / f"{name}.json", seed, count, words, words[1])
        texts = [choice_text(tokenizer, r) for r in records_]
        (workdir / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    four = [("train", train_job(workdir)), ("train", train_job(workdir, "pp2_ring2"))]
    four += [("eval", eval_job(workdir, "random", case, GENERATED)) for case in ("ring2_ulysses2", "pp2_ring2")]
    four.append(("eval", eval_job(workdir, "trained", "ring2_ulysses2", choice_suite(workdir))))
    run_distributed(world_job, 4, four)
    one = [
        eval_job(workdir, "random", "single", GENERATED),
        eval_job(workdir, "trained", "single", choice_suite(workdir)),
        eval_job(workdir, "train_ring2_ulysses2/hf", "single", choice_suite(workdir)),  # the export of training
    ]
    run_distributed(world_job, 1, [("eval", cfg) for cfg in one])
    return workdir


def assert_same_records(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected) > 0
    exact = ("task", "length", "depth", "index", "answer_ids", "predicted_ids", "match", "parts_correct", "score")
    for record, reference in zip(got, expected, strict=True):
        assert {k: record[k] for k in exact} == {k: reference[k] for k in exact}
        assert math.isclose(record["logprob"], reference["logprob"], rel_tol=1e-5, abs_tol=1e-5)
        for a, b in zip(record.get("choice_logprobs", []), reference.get("choice_logprobs", []), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)


@pytest.mark.parametrize("case", ["random_ring2_ulysses2", "random_pp2_ring2", "trained_ring2_ulysses2"])
def test_scores_are_identical_on_every_mesh(workdir: Path, case: str) -> None:
    model, mesh = case.split("_", 1)
    assert_same_records(records(workdir / "eval" / case), records(workdir / "eval" / f"{model}_single"))
    summary = json.loads((workdir / "eval" / case / "ruler.json").read_text())
    assert summary["mesh"]["pp"] == (2 if mesh.startswith("pp2") else 1)
    assert (workdir / "eval" / case / "ruler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("model", ["random", "trained"])
def test_teacher_forcing_equals_the_hugging_face_model_and_greedy_decoding(workdir: Path, model: str) -> None:
    hf = AutoModelForCausalLM.from_pretrained(workdir / model, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # generate exactly as many tokens as the answer has
    found = records(workdir / "eval" / f"{model}_single")
    assert len(found) == (22 if model == "random" else 16)
    matches = 0
    for record in found:
        prompt = torch.tensor(record["prompt_ids"][record["prompt_start"] :])[None]
        answer = torch.tensor(record["answer_ids"])
        with torch.no_grad():
            logits = hf(input_ids=torch.cat([prompt[0], answer])[None]).logits[0, prompt.shape[1] - 1 : -1].double()
            generated = hf.generate(prompt, max_new_tokens=len(answer), do_sample=False)[0, prompt.shape[1] :]
        logprobs = torch.log_softmax(logits, dim=-1)
        assert logprobs.argmax(-1).tolist() == record["predicted_ids"]
        expected = logprobs[torch.arange(len(answer)), answer].sum().item()
        assert math.isclose(expected, record["logprob"], rel_tol=1e-5, abs_tol=1e-5)  # fp32: near 0, 1e-6 apart
        assert torch.equal(generated, answer) == record["match"]
        wrong = next((i for i, (p, a) in enumerate(zip(record["predicted_ids"], answer.tolist())) if p != a), None)
        agree = len(answer) if wrong is None else wrong + 1
        assert generated[:agree].tolist() == record["predicted_ids"][:agree]
        matches += record["match"]
    if model == "trained":  # greedy decoding writes the letter of most records, as teacher forcing says
        assert matches >= len(found) // 2


def test_a_model_trained_on_the_format_scores_above_chance(workdir: Path) -> None:
    summary = json.loads((workdir / "eval" / "trained_single" / "ruler.json").read_text())
    scores = {length: cell["score"] for length, cell in summary["tasks"]["choice"].items()}
    assert set(scores) == {"192", "512"} and min(scores.values()) >= 0.75, scores  # chance: 0.25
    assert summary["effective_length"] == 512
    found = records(workdir / "eval" / "trained_single")
    assert all(r["prompt_start"] > 0 for r in found if r["length"] == 512)  # after a padding document
    assert any(r["prompt_start"] == 0 for r in found if r["length"] == 192)  # cut in the middle


def test_the_suite_runs_during_training(workdir: Path) -> None:
    run = workdir / "train_ring2_ulysses2"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert line["ruler/effective_length"] in (0, 192, 512)
        assert set(line["ruler/score_by_length"]) == {"192", "512"} and set(line["ruler/choice"]) == {"192", "512"}
    assert (run / "ruler" / "step_00000001" / "ruler.json").is_file() and (run / "ruler.png").is_file()
    # the last step's weights are the export's: the same scores as lctrain eval of the export on one process
    assert_same_records(
        records(run / "ruler" / "step_00000002"), records(workdir / "eval" / "train_ring2_ulysses2/hf_single")
    )
    # and on a pipeline (pp 2 x ring 2), whose two steps give the same weights up to rounding
    pipeline = workdir / "train_pp2_ring2"
    assert_same_records(records(pipeline / "ruler" / "step_00000002"), records(run / "ruler" / "step_00000002"))
    assert json.loads((pipeline / "metrics.jsonl").read_text().splitlines()[-1])["ruler/effective_length"] == 512


def key_tokens_reference(workdir: Path) -> tuple[int, float]:
    """(count, mean loss) of the key tokens of the validation rows, with transformers on the export: each document
    alone for the whole row's log-probabilities; each block of KEY_WINDOW / 2 tokens after the block before it, from
    position 0, for the window's."""
    cfg = train_job(workdir)
    export = workdir / "train_ring2_ulysses2" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    data = validation_data(cfg.data)
    data.tokenizer = str(export)
    rows = iter(PackedLoader(data))
    half, count, total = KEY_WINDOW // 2, 0, 0.0
    with torch.no_grad():
        for _ in range(cfg.train.val_rows):
            row = next(rows)
            ids, labels = row["input_ids"][0], row["labels"][0]
            bounds = row["cu_seqlens"][0].tolist()
            for start, stop in zip(bounds, bounds[1:]):
                whole = torch.log_softmax(model(input_ids=ids[None, start:stop]).logits[0].double(), -1)
                for block in range(start, stop, half):
                    first, end = max(start, block - half), min(stop, block + half)
                    short = torch.log_softmax(model(input_ids=ids[None, first:end]).logits[0].double(), -1)
                    for t in range(block, end):
                        if labels[t] == IGNORE_INDEX:
                            continue
                        long_lp, short_lp = whole[t - start, labels[t]].item(), short[t - first, labels[t]].item()
                        if long_lp - short_lp > ALPHA and long_lp > BETA:
                            count, total = count + 1, total - long_lp
    return count, total / max(count, 1)


def test_the_key_token_loss_equals_a_direct_computation(workdir: Path) -> None:
    metrics = (workdir / "train_ring2_ulysses2" / "metrics.jsonl").read_text()
    last = [json.loads(line) for line in metrics.splitlines()][-1]
    count, loss = key_tokens_reference(workdir)
    assert count >= 3 and last["val_key_tokens"] == count  # at least the answers of the whole documents
    assert math.isclose(last["val_key_loss"], loss, rel_tol=1e-4)
    assert last["val_key_loss"] < 0.5 < last["val_loss"]  # the answers, found far back, are what the model knows
    assert set(last["val_key_loss_by_position"]) == set(last["val_loss_by_position"])
