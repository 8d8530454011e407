"""Passkey samples (exact length, needle at the requested depth, answer tokens located whatever the digit merges),
the ``eval.*`` checks, and the heat map."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from lctrain.config.schema import EvalConfig, JobConfig, ParallelConfig
from lctrain.data import IGNORE_INDEX, load_tokenizer
from lctrain.eval.evaluator import check_eval
from lctrain.eval.passkey import FILLER, INTRO, NEEDLE, QUESTION, answer_tokens, passkey_sample, sample_key
from lctrain.eval.report import accuracy_grid, passkey_table, plot_passkey


@functools.cache
def tokenizer():
    return load_tokenizer(None)  # the embedded byte-level BPE: it merges digits (" 68231" -> " 6" "8" "231")


@pytest.mark.parametrize("length", [96, 128, 256, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_sample_length_needle_depth_and_answer(length: int, depth: float) -> None:
    tok = tokenizer()
    key = sample_key(0, length, depth, 0, digits=5)
    sample = passkey_sample(tok, length, depth, key)
    ids = sample.input_ids
    assert ids.shape == (length,) and ids[0] == tok.bos_token_id
    # the answer: the last tokens, decoding to the key; labels hold them one position earlier, nothing else
    assert tok.decode(sample.answer_ids).strip() == key
    expected = torch.full_like(ids, IGNORE_INDEX)
    expected[sample.answer_start - 1 : -1] = sample.answer_ids
    assert torch.equal(sample.labels, expected)
    assert tok.decode(ids[: sample.answer_start]).endswith(QUESTION)
    # the needle, whole, at the requested depth of the filler (within one filler sentence)
    assert tok.decode(ids[sample.needle_start : sample.needle_end]).strip() == NEEDLE.format(key=key)
    filler, before = sample.filler_tokens, sample.needle_start - 1 - len(tok(INTRO)["input_ids"])
    assert before == round(sample.needle_depth * filler)
    assert abs(before - depth * filler) <= max(len(tok(" " + s)["input_ids"]) for s in FILLER) / 2
    # after the filler: fewer line breaks than one sentence, then the question
    padding = sample.answer_start - len(tok(" " + QUESTION)["input_ids"]) - (sample.needle_end + filler - before)
    assert 0 <= padding < max(len(tok(" " + s)["input_ids"]) for s in FILLER)
    text = tok.decode(ids[1:])
    assert text.startswith("There is an important piece") and text.count(key) == 3


def test_needle_moves_from_start_to_end_with_depth() -> None:
    starts = [passkey_sample(tokenizer(), 2048, depth, "12345").needle_start for depth in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert starts == sorted(starts) and starts[0] < 50 and starts[-1] > 2048 - 60


def test_keys_depend_on_seed_and_cell_only() -> None:
    keys = {sample_key(seed, 1024, 0.5, index, 5) for seed in range(3) for index in range(10)}
    assert len(keys) == 30 and all(len(k) == 5 and k[0] != "0" for k in keys)
    assert sample_key(0, 1024, 0.5, 3, 5) == sample_key(0, 1024, 0.5, 3, 5) != sample_key(0, 2048, 0.5, 3, 5)
    assert len(sample_key(0, 1024, 0.5, 0, 12)) == 12


def test_answer_tokens_found_when_the_answer_merges_with_the_prompt() -> None:
    # "is " alone ends with a space token; followed by digits the space joins them (" 6"): the answer tokens are
    # those after the longest common prefix, so they start at the first token that differs
    tok = tokenizer()
    prompt, answer = answer_tokens(tok, "The pass key is ", "68231")
    assert prompt + answer == tok("The pass key is 68231")["input_ids"]
    assert tok.decode(answer).strip() == "68231" and tok.decode(prompt) == "The pass key is"


def test_too_short_or_bad_depth_is_refused() -> None:
    with pytest.raises(ValueError, match="too short"):
        passkey_sample(tokenizer(), 32, 0.5, "12345")
    with pytest.raises(ValueError, match="depth"):
        passkey_sample(tokenizer(), 256, 1.5, "12345")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"lengths": [1000]}, "eval.lengths=1000 is not divisible by 16"),
        ({"perplexity_lengths": [64, 100]}, "eval.perplexity_lengths=100 is not divisible by 16"),
        ({"depths": [0.5, 2.0]}, "fractions"),
        ({"tasks": ["passkey", "mmlu"]}, "eval.tasks"),
        ({"samples": 0}, "eval.samples"),
    ],
)
def test_bad_eval_settings_are_refused(overrides: dict, message: str) -> None:
    mesh = ParallelConfig(ring=4, ulysses=2)  # zigzag: lengths must be multiples of 16
    check_eval(JobConfig(eval=EvalConfig(lengths=[256, 512]), parallel=mesh))
    with pytest.raises(ValueError, match=message):
        check_eval(JobConfig(eval=EvalConfig(**{"lengths": [256, 512], **overrides}), parallel=mesh))


def test_heat_map_and_table(tmp_path: Path) -> None:
    cells = [
        {"length": length, "depth": depth, "accuracy": accuracy}
        for (length, depth, accuracy) in [(512, 0.0, 1.0), (512, 1.0, 0.5), (1024, 0.0, 0.25), (1024, 1.0, 0.0)]
    ]
    assert accuracy_grid(cells) == ([512, 1024], [0.0, 1.0], [[1.0, 0.25], [0.5, 0.0]])
    assert passkey_table(cells).splitlines()[1].split() == ["0.00", "1.00", "0.25"]
    plot_passkey(cells, tmp_path / "passkey.png", "title")
    assert (tmp_path / "passkey.png").read_bytes()[:4] == b"\x89PNG"


def test_a_pipeline_is_refused_for_passkey_and_perplexity() -> None:
    # the ruler suite runs on pipelines (tests/distributed/test_ruler.py)
    from lctrain.eval.evaluator import prepare_eval

    cfg = JobConfig(eval=EvalConfig(tasks=["passkey", "ruler"]), parallel=ParallelConfig(pp=2))
    cfg.model.path = "runs/x/hf"
    with pytest.raises(ValueError, match="parallel.pp=2 for passkey and perplexity: .* or set eval.tasks=\\[ruler\\]"):
        prepare_eval(cfg, 2)
