"""The suite's generated examples: exactly the requested length, the same for a seed and different across the cell's
keys, the needle whole at the requested depth, answers and their parts located in the tokens, the haystacks (noise,
a user's corpus, the embedded docstrings), the chat template, the multiple-choice records, and the bad settings
refused in one line."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from lctrain.config import load_config
from lctrain.config.ruler import RulerConfig
from lctrain.config.schema import TrainConfig
from lctrain.data import IGNORE_INDEX, load_tokenizer
from lctrain.ruler.choice import choice_example, read_choices
from lctrain.ruler.haystack import NOISE
from lctrain.ruler.suite import build_suite, check_suite
from lctrain.ruler.tasks import CWE_WORDS, NEEDLE, NEEDLES, VT_VARIABLES, TaskMaker
from lctrain.train.ruler_suite import check_job_suite

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


@functools.cache
def tokenizer():
    return load_tokenizer(None)


@functools.cache
def maker(haystack: str = "noise", corpus: tuple[str, ...] = (), chat: bool = False) -> TaskMaker:
    return TaskMaker(tokenizer(), seed=7, haystack=haystack, corpus_paths=corpus, corpus_tokens=4096, chat=chat)


def words_of(text: str) -> list[str]:
    return [w.strip(".,") for w in text.split()]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_examples_are_exact_deterministic_and_answered_at_the_end(task: str, length: int) -> None:
    depth = 0.5 if task.startswith("niah") else None
    example = maker().make(task, length, depth, 0)
    again = TaskMaker(tokenizer(), seed=7).make(task, length, depth, 0)
    assert example.input_ids.shape == (length,) and example.input_ids[0] == tokenizer().bos_token_id
    assert torch.equal(example.input_ids, again.input_ids) and example.answer == again.answer
    others = [maker().make(task, length, depth, 1), TaskMaker(tokenizer(), seed=8).make(task, length, depth, 0)]
    assert all(other.answer != example.answer for other in others)
    # the answer ends the example, its tokens are the only labels, and each part decodes to its value or word
    tok = tokenizer()
    assert tok.decode(example.answer_ids).strip() == example.answer
    expected = torch.full_like(example.input_ids, IGNORE_INDEX)
    expected[example.answer_start - 1 : -1] = example.answer_ids
    assert torch.equal(example.labels, expected)
    parts = [tok.decode(example.answer_ids[a:b]).strip(" ,") for a, b in example.parts]
    assert parts == example.answer.split(", " if task != "vt" else " ")
    assert len(parts) == {"niah_multivalue": NEEDLES, "niah_multiquery": NEEDLES, "vt": VT_VARIABLES}.get(
        task, {"cwe": CWE_WORDS, "fwe": 3}.get(task, 1)
    )


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("length", [512, 2048])
def test_the_needle_lies_whole_at_the_requested_depth(depth: float, length: int) -> None:
    tok = tokenizer()
    sentence = max(len(tok(" " + s)["input_ids"]) for s in NOISE)  # W > length / 4 here
    for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        example = maker().make(task, length, depth, 0)
        start, stop = example.needle_span
        needle = tok.decode(example.input_ids[start:stop])
        assert needle.startswith(" One of the special magic numbers for ") and needle.endswith(".")
        value = needle.rstrip(".").split()[-1]
        assert value in example.answer.split(", ")
        text = tok.decode(example.input_ids[: example.answer_start])
        assert text.count(NEEDLE.split("{")[0].strip()) == (1 if task == "niah_single" else NEEDLES)
        # the needle sits at the sentence boundary nearest to depth x the haystack's tokens: within one sentence
        before = tok.decode(example.input_ids[:start])
        sentences = sum(text.count(s) for s in NOISE)
        assert abs(sum(before.count(s) for s in NOISE) - depth * sentences) <= 1
        assert abs(example.needle_depth - depth) <= sentence / (length / 4)


def test_multivalue_answers_in_the_texts_order_and_multiquery_in_the_asked_order() -> None:
    tok = tokenizer()
    example = maker().make("niah_multivalue", 2048, 0.7, 3)
    text = tok.decode(example.input_ids[: example.answer_start])
    values = example.answer.split(", ")
    assert sorted(values, key=text.index) == values
    query = maker().make("niah_multiquery", 2048, 0.2, 3)
    text = tok.decode(query.input_ids[: query.answer_start])
    asked = text.split("What are all the special magic numbers for ")[1].split(" mentioned")[0]
    keys = asked.replace(" and ", ", ").split(", ")
    for key, value in zip(keys, query.answer.split(", "), strict=True):
        assert f"for {key} is: {value}." in text


def test_variable_tracking_common_and_frequent_words_have_the_answers_they_claim() -> None:
    tok = tokenizer()
    vt = maker().make("vt", 1024, None, 2)
    text = tok.decode(vt.input_ids[: vt.answer_start])
    names = vt.answer.split()
    value = text.split("assigned the value ")[1].split()[0]
    assert f"VAR {names[0]} = {value}." in text
    assert all(f"VAR {b} = VAR {a}." in text for a, b in zip(names, names[1:]))
    assert [text.index(f"VAR {n} =") for n in names] == sorted(text.index(f"VAR {n} =") for n in names)
    for task, count in (("cwe", CWE_WORDS), ("fwe", 3)):
        example = maker().make(task, 4096, None, 1)
        body = tok.decode(example.input_ids[: example.answer_start]).split("Question:")[0]
        listed = [w for w in words_of(body.split("\n", 1)[1]) if w.isalpha()]
        counts = {w: listed.count(w) for w in set(listed)}
        answer = example.answer.split(", ")
        ranked = sorted(counts, key=lambda w: -counts[w])
        assert set(answer) == set(ranked[:count]) and counts[ranked[count - 1]] > counts[ranked[count]]
        if task == "cwe":  # the order of first appearance; f each (at most RULER's 30), the others f // 10
            frequency = counts[answer[0]]
            assert answer == sorted(answer, key=listed.index) and 20 <= frequency <= 30
            assert {counts[w] for w in answer} == {frequency}
            assert {counts[w] for w in counts if w not in answer} == {frequency // 10}
        else:  # the most frequent first, with distinct counts
            assert [counts[w] for w in answer] == sorted((counts[w] for w in answer), reverse=True)
            assert len({counts[w] for w in answer}) == 3


def test_a_users_corpus_and_the_embedded_docstrings_as_haystacks(tmp_path: Path) -> None:
    tok = tokenizer()
    (tmp_path / "a.txt").write_text("Rivers carry silt to the delta. The delta grows every year! " * 40)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "Owls hunt at night. They fly without a sound."}) + "\n")
    corpus = (str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"))
    example = maker("corpus", corpus).make("niah_single", 1024, 0.5, 0)
    text = tok.decode(example.input_ids)
    assert "delta" in text and "The grass is green" not in text and example.answer in text
    embedded = maker("corpus").make("niah_multikey", 1024, 0.5, 0)
    text = tok.decode(embedded.input_ids)
    assert "The grass is green" not in text and embedded.answer in text and len(text.split()) > 300
    (tmp_path / "c.csv").write_text("x")
    for paths, message in (([str(tmp_path / "none.txt")], "no such file"), ([str(tmp_path / "c.csv")], ".txt")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            _ = TaskMaker(tok, seed=0, haystack="corpus", corpus_paths=tuple(paths), corpus_tokens=512).corpus


def test_chat_prompts_are_rendered_with_the_template() -> None:
    tok = tokenizer()
    example = maker(chat=True).make("niah_single", 1024, 0.5, 0)
    text = tok.decode(example.input_ids)
    assert text.startswith("<|bos|><|im_start|>user\nSome special magic numbers")
    assert "provided text?<|im_end|>\n<|im_start|>assistant\nThe special magic number for " in text
    assert text.count("<|bos|>") == 1 and example.input_ids.shape == (1024,)


def choice_record(**fields: str) -> dict[str, str]:
    record = {"context": "Bob has a blue hat. " * 200, "question": "What color is Bob's hat?", "choice_A": "red",
              "choice_B": "blue", "choice_C": "green", "choice_D": "black", "answer": "B"}  # fmt: skip
    return {**record, **fields}


def test_multiple_choice_records_cut_in_the_middle_or_padded_in_front(tmp_path: Path) -> None:
    tok = tokenizer()
    short = choice_example(tok, choice_record(), 4096, 0, chat=False)  # the context: about 1200 tokens
    long = choice_example(tok, choice_record(), 512, 1, chat=False)
    assert [tok.decode([c]) for c in short.choices] == ["A", "B", "C", "D"] and short.correct_choice == 1
    assert tok.decode(short.answer_ids) == "B" and tok.decode(short.input_ids[-20:]).endswith(
        "The correct answer is (B"
    )
    # shorter than the length: a padding document first (its own positions), the record exactly as alone
    assert short.start > 0 and short.cu_seqlens.tolist() == [0, short.start, 4096]
    assert short.position_ids[short.start] == 0 and short.input_ids[short.start] == tok.bos_token_id
    # longer: the context's middle cut out, its start and end kept
    text = tok.decode(long.input_ids)
    assert long.start == 0 and long.input_ids.shape == (512,) and text.count("Bob has a blue hat.") < 200
    assert "<text>\nBob has a blue hat." in text and "Bob has a blue hat. \n</text>" in text
    path = tmp_path / "choices.jsonl"
    path.write_text(json.dumps(choice_record()) + "\n\n" + json.dumps(choice_record(answer="D")) + "\n")
    assert [r["answer"] for r in read_choices(str(path))] == ["B", "D"]


@pytest.mark.parametrize(
    "record,message",
    [
        ({"question": None}, "line 1 lacks the field\\(s\\) question: each record needs context, question"),
        ({"choice_C": 3}, "lacks the field\\(s\\) choice_C"),
        ({"answer": "E"}, "answer='E'; give A-D"),
    ],
)
def test_bad_multiple_choice_records_are_refused_in_one_line(tmp_path: Path, record: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({k: v for k, v in choice_record(**record).items() if v is not None}) + "\n")
    with pytest.raises(ValueError, match=message) as error:
        read_choices(str(path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"tasks": ["niah_single", "qa_2"]}, "lctrain has no task 'qa_2'"),
        ({"depths": [0.5, 1.5]}, "ruler.depths=\\[0.5, 1.5\\] must be fractions in \\[0, 1\\]"),
        ({"tasks": ["choice"]}, "the task choice scores the multiple-choice file ruler.choice_path"),
        ({"haystack": "essays"}, "ruler.haystack='essays' must be noise or corpus"),
        ({"relative_threshold": 0}, "ruler.relative_threshold=0"),
        ({"every": -1}, "ruler.every=-1 must be >= 0"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        RulerConfig(**settings)
    assert "\n" not in str(error.value)


def test_the_section_and_the_key_window_come_through_the_config() -> None:
    cfg = load_config(["ruler.tasks=[vt,fwe]", "ruler.every=5", "eval.tasks=[ruler]", "train.val_key_window=64"])
    assert cfg.ruler.tasks == ["vt", "fwe"] and cfg.ruler.every == 5 and cfg.train.val_key_window == 64
    with pytest.raises(ValueError, match="train.val_key_window=5 must be an even number"):
        TrainConfig(val_key_window=5)


def test_lengths_beyond_the_model_or_not_cut_whole_or_too_short_are_refused() -> None:
    cfg = load_config(["parallel.ring=2", "parallel.ulysses=2"])
    dims = cfg.parallel.dims()
    with pytest.raises(ValueError, match="ruler.lengths: 8192 tokens is beyond the model's 4096 positions"):
        check_suite(RulerConfig(), tokenizer(), [1024, 8192], dims, 4096)
    with pytest.raises(ValueError, match="ruler.lengths"):
        check_suite(RulerConfig(), tokenizer(), [1026], dims, None)
    with pytest.raises(ValueError, match="ruler.lengths: 256 tokens is too short for the task cwe"):
        check_suite(RulerConfig(tasks=["vt", "cwe"]), tokenizer(), [256, 1024], dims, None)
    # the check train and eval run before any process group: the default lengths from data.seq_len
    job = load_config(["data.seq_len=1024", "ruler.tasks=[niah_multiquery]", "ruler.every=10"])
    with pytest.raises(ValueError, match="ruler.lengths: 256 tokens is too short for the task niah_multiquery"):
        check_job_suite(job, tokenizer(), 131072)


def test_the_suite_covers_every_cell_in_order() -> None:
    ruler = RulerConfig(tasks=["niah_single", "vt"], depths=[0.0, 1.0], samples=2)
    examples = build_suite(ruler, tokenizer(), [512, 1024])
    cells = [(e.task, e.length, e.depth, e.index) for e in examples]
    assert cells == [("niah_single", n, d, i) for n in (512, 1024) for d in (0.0, 1.0) for i in (0, 1)] + [
        ("vt", n, None, i) for n in (512, 1024) for i in (0, 1)
    ]
    assert RulerConfig().suite_lengths(4096) == [1024, 2048, 4096]
