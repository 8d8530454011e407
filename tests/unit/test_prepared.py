"""Prepared data (``lctrain prepare``, ``data.prepared``): the same rows as from the files (text, chat, conversations
rendered per turn, preference pairs, a mixture; shuffled, dp-split by file and by document, other row lengths and
overlong settings), data states that resume either, no tokenizer work when read, and each refusal in one line: another
tokenizer, template, setting or file, a truncated or corrupted array, no manifest."""

from __future__ import annotations

import dataclasses
import json
import shutil
from itertools import islice
from pathlib import Path

import pytest
import torch

from lctrain.attention import SequencePlace
from lctrain.data import DataConfig, PackedLoader, SourceConfig, load_tokenizer
from lctrain.data.prepare import prepare
from lctrain.data.prepared import PreparedSource
from testbed.corpus import REASONING_TEMPLATE, write_chat_corpus, write_corpus, write_pair_corpus, write_reasoning_chats

TENSORS = ("input_ids", "labels", "position_ids", "sources", "completions")
LISTS = ("cu_seqlens", "doc_prefix", "pair_ids")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    write_corpus(root / "text0.jsonl", 40)
    write_corpus(root / "text1.jsonl", 25, long_fraction=0.5)
    with (root / "text1.jsonl").open("a") as f:  # empty texts are left out, as from the files
        f.write(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    write_chat_corpus(root / "chat.jsonl", 60)
    write_pair_corpus(root / "pairs.jsonl", 40)
    write_reasoning_chats(root / "reasoning.jsonl", 20)
    (root / "reasoning.jinja").write_text(REASONING_TEMPLATE)
    return root


def sources(files: Path) -> list[SourceConfig]:
    return [
        SourceConfig("text", [str(files / "text*.jsonl")], weight=2.0),
        SourceConfig("chat", [str(files / "chat.jsonl")]),
        SourceConfig("pairs", [str(files / "pairs.jsonl")]),
    ]


@pytest.fixture(scope="module")
def prepared(files: Path, tokenizer_dir: Path) -> DataConfig:
    """The three sources prepared (in this process), and the reasoning chats with their template; returns the data
    config of the first set."""
    config = DataConfig(sources=sources(files), tokenizer=str(tokenizer_dir), prepared=str(files / "set"))
    prepare(dataclasses.replace(config, prepare_workers=1), str(tokenizer_dir), progress=False)
    reasoning = dataclasses.replace(
        config,
        sources=[SourceConfig("reasoning", [str(files / "reasoning.jsonl")])],
        chat_template=str(files / "reasoning.jinja"),
        prepared=str(files / "reasoning_set"),
        prepare_workers=1,
    )
    prepare(reasoning, str(tokenizer_dir), progress=False)
    return config


def batches(config: DataConfig, count: int, state: dict | None = None, **where) -> tuple[list[dict], dict]:
    """``count`` batches of a loader of ``config`` (dp and place from ``where``), after ``state``; and its state."""
    dp = {key: where.pop(key) for key in ("dp_rank", "dp_size") if key in where}
    loader = PackedLoader(config, **dp, place=SequencePlace(**where))
    if state is not None:
        loader.load_state_dict(state)
    return list(islice(iter(loader), count)), loader.state_dict()


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert sorted(a) == sorted(b)
        for key in TENSORS:
            if key in b:
                assert torch.equal(a[key], b[key]), key
        for key in LISTS:
            if key in b:
                assert [x.tolist() for x in a[key]] == [x.tolist() for x in b[key]], key
        assert a.get("pair_counts") == b.get("pair_counts")


CASES = {  # changes to the data config, dp and place: each compared from the files and from the prepared set
    "text": ({"sources": [0], "seq_len": 96}, {}),
    "text shuffled, dp 2 by file": ({"sources": [0], "seq_len": 64, "shuffle_buffer": 8, "seed": 3}, {"dp_size": 2}),
    "text, dp 3 by document, truncated": (
        {"sources": [0], "seq_len": 48, "truncate": True},
        {"dp_rank": 2, "dp_size": 3},
    ),
    "chat, ring 2 x ulysses 2": ({"sources": [1], "seq_len": 64}, {"ring_rank": 1, "ring_size": 2, "ulysses_size": 2}),
    "chat truncated, last turn": ({"sources": [1], "seq_len": 32, "overlong": "truncate"}, {}),
    "pairs shared": ({"sources": [2], "seq_len": 64}, {}),
    "pairs truncated, shuffled": ({"sources": [2], "seq_len": 48, "overlong": "truncate", "shuffle_buffer": 4}, {}),
    "mixture": ({"seq_len": 64, "batch_size": 2, "shuffle_buffer": 4}, {"dp_rank": 1, "dp_size": 2}),
}


def case_configs(prepared: DataConfig, changes: dict) -> tuple[DataConfig, DataConfig]:
    """(from the files, from the prepared set) of one case."""
    changes = dict(changes)
    picked = changes.pop("sources", None)
    chosen = prepared.sources if picked is None else [prepared.sources[i] for i in picked]
    config = dataclasses.replace(prepared, sources=chosen, **changes)
    return dataclasses.replace(config, prepared=None), config


@pytest.mark.parametrize("case", list(CASES))
def test_prepared_rows_are_the_rows_of_the_files(prepared: DataConfig, case: str) -> None:
    changes, where = CASES[case]
    raw, from_set = case_configs(prepared, changes)
    want, want_state = batches(raw, 30, **where)
    got, got_state = batches(from_set, 30, **where)
    assert_same(got, want)
    assert got_state == want_state  # the same data state: either resumes the other
    if case == "mixture":
        assert sorted({s for b in got for s in b["sources"].unique().tolist()}) == [0, 1, 2]


def test_conversations_rendered_per_turn_and_a_mixture_of_prepared_and_raw(prepared: DataConfig, files: Path) -> None:
    reasoning = dataclasses.replace(
        prepared,
        sources=[SourceConfig("reasoning", [str(files / "reasoning.jsonl")]), prepared.sources[0]],
        chat_template=str(files / "reasoning.jinja"),
        prepared=str(files / "reasoning_set"),  # holds the reasoning chats, not the text: that is read from files
        seq_len=64,
    )
    loader = PackedLoader(reasoning)
    assert [type(s).__name__ for s in loader._sources] == ["PreparedSource", "TextSource"]
    got, got_state = batches(reasoning, 20)
    want, want_state = batches(dataclasses.replace(reasoning, prepared=None), 20)
    assert_same(got, want)
    assert got_state == want_state and got_state["sources"][0]["divergent"] > 0  # rendered once per turn


def test_resume_from_either_state_continues_exactly(prepared: DataConfig) -> None:
    raw, from_set = case_configs(prepared, {"seq_len": 64, "shuffle_buffer": 4, "seed": 5})
    where = {"dp_rank": 0, "dp_size": 2, "ring_rank": 1, "ring_size": 2}
    _, raw_state = batches(raw, 23, **where)  # a state saved from the files
    want, _ = batches(raw, 8, raw_state, **where)
    got, prepared_state = batches(from_set, 8, raw_state, **where)
    assert_same(got, want)
    # and a state of the prepared set, loaded on another context-parallel layout of the same dp rank
    reshaped = {"dp_rank": 0, "dp_size": 2, "ulysses_rank": 1, "ulysses_size": 2}
    want, _ = batches(raw, 5, prepared_state, **reshaped)
    got, _ = batches(from_set, 5, prepared_state, **reshaped)
    assert_same(got, want)


def test_reading_a_prepared_set_does_no_tokenizer_work(prepared: DataConfig, monkeypatch) -> None:
    loader = PackedLoader(prepared)
    assert all(isinstance(source, PreparedSource) for source in loader._sources)

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003
        raise AssertionError("tokenizer work at train time")

    monkeypatch.setattr(type(loader.tokenizer), "__call__", refuse)
    monkeypatch.setattr("lctrain.data.chat.render_jinja_template", refuse)
    assert len(list(islice(iter(loader), 10))) == 10


def test_manifest_holds_fingerprints_files_and_counts(prepared: DataConfig, files: Path) -> None:
    manifest = json.loads((files / "set" / "manifest.json").read_text())
    text, chat, pairs = (manifest["sources"][name] for name in ("text", "chat", "pairs"))
    assert text["identity"]["format"] == "text" and chat["identity"]["train_on"] == "assistant"
    assert pairs["identity"]["share_prompt"] is True and len(pairs["identity"]["chat_template"]) == 64
    assert [Path(f["path"]).name for f in text["files"]] == ["text0.jsonl", "text1.jsonl"]
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in text["files"])
    assert text["counts"]["items"] == 67 and text["counts"]["empty"] == 2 and text["counts"]["documents"] == 65
    assert pairs["counts"]["pairs"] == 40 and chat["counts"]["documents"] == 60


def refusal(config: DataConfig) -> str:
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        list(islice(iter(PackedLoader(config)), 3))
    message = str(error.value)
    assert "\n" not in message
    return message


def test_another_tokenizer_template_or_setting_is_refused_naming_it(prepared: DataConfig, files: Path, tmp_path: Path):
    tokenizer = load_tokenizer(prepared.tokenizer)
    tokenizer.add_tokens(["<|extra|>"])
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    assert "another tokenizer" in refusal(dataclasses.replace(prepared, tokenizer=str(tmp_path / "tokenizer")))
    (tmp_path / "template.jinja").write_text(REASONING_TEMPLATE)
    chat = dataclasses.replace(prepared, chat_template=str(tmp_path / "template.jinja"))
    assert "source 'chat' was prepared with another chat template" in refusal(chat)
    assert "train_on='assistant' and this job has train_on='all'" in refusal(
        dataclasses.replace(prepared, train_on="all")
    )
    assert "share_prompt=True" in refusal(dataclasses.replace(prepared, share_prompt=False))
    renamed = [dataclasses.replace(prepared.sources[0], paths=[str(files / "text0.jsonl")])]
    assert "paths=" in refusal(dataclasses.replace(prepared, sources=renamed))
    assert "no manifest.json" in refusal(dataclasses.replace(prepared, prepared=str(tmp_path)))


def test_a_changed_file_or_a_damaged_array_is_refused_naming_it(prepared: DataConfig, files: Path, tmp_path: Path):
    shutil.copy(files / "pairs.jsonl", tmp_path / "pairs.jsonl")
    config = dataclasses.replace(
        prepared, sources=[SourceConfig("pairs", [str(tmp_path / "pairs.jsonl")])], prepared=str(tmp_path / "set")
    )
    prepare(dataclasses.replace(config, prepare_workers=1), config.tokenizer, progress=False)
    assert len(batches(config, 3)[0]) == 3
    tokens = tmp_path / "set" / "source_0" / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tokens.write_bytes(bytes(data))
    assert f"{tokens}: bytes 0-{len(data)} do not match their checksum" in refusal(config)
    tokens.write_bytes(bytes(data[:-6]))
    assert f"{tokens}: {len(data) - 6} bytes where the manifest says {len(data)}" in refusal(config)
    with (tmp_path / "pairs.jsonl").open("a") as f:
        f.write("\n")
    assert "pairs.jsonl of" in refusal(config) and "which now has" in refusal(config)


@pytest.mark.slow
def test_worker_processes_write_the_same_set(prepared: DataConfig, files: Path, tmp_path: Path) -> None:
    config = dataclasses.replace(prepared, prepared=str(tmp_path / "set"), prepare_workers=2)
    prepare(config, config.tokenizer, progress=False)
    for name in ("source_0", "source_1", "source_2"):
        for array in sorted((files / "set" / name).iterdir()):
            assert (tmp_path / "set" / name / array.name).read_bytes() == array.read_bytes(), array
