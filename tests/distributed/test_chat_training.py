"""Fine-tuning on conversations, mixtures and validation train exactly like the plain single-process Hugging Face
model, on one spawned gloo group of 4 ranks.

Three jobs (``STEPS`` steps each, the tiny fp32 model of ``tests/helpers/reference_training.py``, 64-token rows):

- ``chat``: conversations (``write_chat_corpus``: only the assistant's tokens are trained; some conversations are
  dropped, longer than a row, some skipped, without an assistant turn), ring 2 × ulysses 2;
- ``chat_dp2``: the same conversations on dp 2 × ring 2 with ``grad_accum`` 2. It validates every 2 steps and at
  the end on two held-out sources, conversations and text documents: 3 rows, so one dp rank scores 2 and the other
  1 (and a forward it drops);
- ``mixture``: ``data.sources`` of those conversations (weight 0.6) and text documents (0.4), ring 2 × ulysses 2,
  4 rows a step.

The first row of the conversations holds no trained token in its first and last quarter: ring rank 0's shard of it
has only masked labels (checked here), so that rank's loss sum is 0 and the step's is still exact. Compared with
the reference (the plain model on every document piece of the same rows; labels from the loader, so the loss is
the sum of the assistant tokens' losses over their count): first-step loss within 1e-5 relative and every gradient
within 1e-5 absolute + 1e-4 relative, every step's loss within 1e-5 relative; the mixture's ``loss/<name>`` (each
source's token mean) within 1e-5 relative and ``tokens/<name>`` exactly; the last validation (on the exported
weights) ``val_loss``, ``val_loss/<name>`` and each ``val_loss_by_position`` bucket within 1e-5 relative of the
exported model's direct computation, ``val_tokens`` exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lctrain.attention import SequencePlace
from lctrain.config import JobConfig
from lctrain.data import IGNORE_INDEX, PackedLoader
from lctrain.testing import run_distributed
from lctrain.train.trainer import position_buckets
from tests.helpers.corpus import write_chat_corpus, write_corpus
from tests.helpers.reference_training import (
    SEQ_LEN,
    assert_first_step_matches,
    job_config,
    reference,
    reference_model,
    token_losses,
    world_job,
)

STEPS = 3
VAL_ROWS = 3
VALIDATED = "chat_dp2"


def data(workdir: str, case: str) -> tuple[str, ...]:
    chat = f"{workdir}/chat.jsonl"
    if case == "mixture":
        return (
            f"data.sources=[{{name:chat,paths:[{chat}],weight:0.6}},{{name:text,paths:[{workdir}/corpus.jsonl],"
            f"weight:0.4}}]",
        )
    return (f"data.paths=[{chat}]",)


MESHES = {  # case -> (parallel overrides, data.batch_size, train.grad_accum)
    "chat": (["parallel.ring=2", "parallel.ulysses=2"], 1, 1),
    "chat_dp2": (["parallel.dp=2", "parallel.ring=2"], 1, 2),
    "mixture": (["parallel.ring=2", "parallel.ulysses=2"], 4, 1),  # 4 rows a step: both sources in the first
}


def job(workdir: str, case: str) -> JobConfig:
    parallel, batch_size, grad_accum = MESHES[case]
    held_out = (
        f"data.val_sources=[{{name:chat,paths:[{workdir}/val_chat.jsonl]}},"
        f"{{name:text,paths:[{workdir}/val_text.jsonl]}}]"
    )
    extra = (held_out,) if case == VALIDATED else ()
    cfg = job_config(
        workdir,
        f"{workdir}/run_{case}",
        steps=STEPS,
        batch_size=batch_size,
        grad_accum=grad_accum,
        parallel=parallel,
        data=(*data(workdir, case), *extra),
    )
    if case == VALIDATED:
        cfg.train.val_every, cfg.train.val_rows = 2, VAL_ROWS
        cfg.checkpoint.export_hf = True
    return cfg


@pytest.fixture(scope="module")
def results(parity_workdir: str) -> dict[str, tuple]:
    root = Path(parity_workdir)
    write_chat_corpus(root / "chat.jsonl")
    write_chat_corpus(root / "val_chat.jsonl", 30, seed=2)
    write_corpus(root / "val_text.jsonl", 20)
    configs = {case: job(parity_workdir, case) for case in MESHES}
    return run_distributed(world_job, 4, configs)[0]


def metrics(workdir: str, case: str) -> list[dict]:
    return [json.loads(line) for line in Path(f"{workdir}/run_{case}/metrics.jsonl").read_text().splitlines()]


@functools.cache
def reference_for(workdir: str, case: str) -> tuple[list[float], list[float], dict]:
    _, batch_size, grad_accum = MESHES[case]
    dp = 2 if case == "chat_dp2" else 1
    return reference(
        workdir, steps=STEPS, dp=dp, batch_size=batch_size, grad_accum=grad_accum, data=data(workdir, case)
    )


def test_ring_rank_zero_holds_only_masked_labels_in_the_first_row(results: dict, parity_workdir: str) -> None:
    for case in ("chat", "chat_dp2"):
        cfg = job(parity_workdir, case)
        place = SequencePlace(ring_size=2, ulysses_size=2 if case == "chat" else 1)
        shard = next(iter(PackedLoader(cfg.data, place=place)))
        assert (shard["labels"] == IGNORE_INDEX).all(), case
        whole = next(iter(PackedLoader(cfg.data)))
        assert (whole["labels"] != IGNORE_INDEX).any(), case  # the row itself trains some tokens


@pytest.mark.parametrize("case", list(MESHES))
def test_first_step_and_losses_match_the_single_process_model(results: dict, parity_workdir: str, case: str) -> None:
    expected = reference_for(parity_workdir, case)
    assert_first_step_matches(results[case], expected)
    torch.testing.assert_close(
        torch.tensor(results[case][0], dtype=torch.float64),
        torch.tensor(expected[0], dtype=torch.float64),
        atol=0,
        rtol=1e-5,
    )


def test_per_source_loss_is_each_source_token_mean(results: dict, parity_workdir: str) -> None:
    cfg = job(parity_workdir, "mixture")
    first = next(iter(PackedLoader(cfg.data)))
    direct = token_losses(reference_model(cfg), [first])
    step = metrics(parity_workdir, "mixture")[0]
    total = direct["loss"].sum().item() / len(direct["loss"])
    assert math.isclose(step["loss"], total, rel_tol=1e-5)
    for index, name in enumerate(("chat", "text")):
        mine = direct["source"] == index
        assert step[f"tokens/{name}"] == int(mine.sum()) > 0
        assert math.isclose(step[f"loss/{name}"], direct["loss"][mine].mean().item(), rel_tol=1e-5), name


def test_validation_equals_the_exported_model_scored_directly(results: dict, parity_workdir: str) -> None:
    cfg = job(parity_workdir, VALIDATED)
    records = metrics(parity_workdir, VALIDATED)
    assert [r["step"] for r in records if "val_loss" in r] == [2, 3]
    last = records[-1]
    model = AutoModelForCausalLM.from_pretrained(f"{parity_workdir}/run_{VALIDATED}/hf").eval()
    val = dataclasses.replace(cfg.data, paths=[], sources=cfg.data.val_sources, val_sources=[], truncate=True)
    rows = iter(PackedLoader(val))
    direct = token_losses(model, [next(rows) for _ in range(VAL_ROWS)])
    losses = direct["loss"]
    assert last["val_tokens"] == len(losses)
    assert math.isclose(last["val_loss"], losses.mean().item(), rel_tol=1e-5)
    for index, name in enumerate(("chat", "text")):
        mine = direct["source"] == index
        assert mine.any() and math.isclose(last[f"val_loss/{name}"], losses[mine].mean().item(), rel_tol=1e-5)
    edges = position_buckets(SEQ_LEN)
    assert (
        list(last["val_loss_by_position"])
        == [f"{a}-{b}" for a, b in zip(edges, edges[1:])]
        == [
            "0-4",
            "4-16",
            "16-64",
        ]
    )
    for (a, b), value in zip(zip(edges, edges[1:]), last["val_loss_by_position"].values()):
        bucket = (direct["position"] >= a) & (direct["position"] < b)
        assert bucket.any() and math.isclose(value, losses[bucket].mean().item(), rel_tol=1e-5), (a, b)
