"""Sources of the loader: mixtures by weight (proportions, determinism, exact resume mid-mixture), chat sources
(formats, ``auto``, conversations longer than a row, records without a trained token), the embedded chat corpus and
its held-out split, and the data checks that run before any process group."""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import islice
from pathlib import Path

import pytest
import torch

from lctrain.attention import SequencePlace
from lctrain.data import (
    ChatEncoder,
    DataConfig,
    Document,
    DocumentSource,
    PackedLoader,
    SourceConfig,
    check_data,
    load_tokenizer,
    mixture,
    parse_conversation,
)
from lctrain.data.mixture import Mixture, batches, uniform
from lctrain.data.sources import embedded_files
from lctrain.data.stdlib_chat import stdlib_conversations
from testbed.corpus import write_chat_corpus, write_corpus

KEYS = ("input_ids", "labels", "position_ids", "sources")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixture")
    write_corpus(root / "text.jsonl", 120)
    write_chat_corpus(root / "chat.jsonl", 120)
    write_chat_corpus(root / "val_chat.jsonl", 20, seed=3)
    return root


def mixture_config(files: Path, tokenizer_dir: Path, **changes) -> DataConfig:  # noqa: ANN003
    sources = [
        SourceConfig("chat", [str(files / "chat.jsonl")], weight=3.0),
        SourceConfig("text", [str(files / "text.jsonl")], weight=1.0),
    ]
    return DataConfig(seq_len=64, sources=sources, tokenizer=str(tokenizer_dir), **changes)


class Counting:
    """An endless stream of documents of one source."""

    def __init__(self, source: int):
        self.source = source

    def __next__(self) -> Document:
        return Document(torch.tensor([self.source]), source=self.source)


def test_draws_follow_the_weights_within_the_statistical_tolerance() -> None:
    """20,000 draws over weights 5 : 3 : 2: each source's share is within 4.5 standard deviations of a multinomial
    draw (sqrt(p (1 - p) / n): 0.0035 for p = 0.5), the sequence depends only on (seed, dp rank) and differs between
    dp ranks and seeds."""
    weights, draws = [5.0, 3.0, 2.0], 20_000
    picks = [doc.source for doc in islice(Mixture([Counting(i) for i in range(3)], weights, seed=7, dp_rank=0), draws)]
    for source, weight in enumerate(weights):
        p = weight / sum(weights)
        share = picks.count(source) / draws
        assert abs(share - p) <= 4.5 * math.sqrt(p * (1 - p) / draws), (source, share, p)
    again = Mixture([Counting(i) for i in range(3)], weights, seed=7, dp_rank=0, draws=1000)
    assert [doc.source for doc in islice(again, 500)] == picks[1000:1500]  # a restart at draw 1000 draws the same
    other_rank = Mixture([Counting(i) for i in range(3)], weights, seed=7, dp_rank=1)
    assert [doc.source for doc in islice(other_rank, 200)] != picks[:200]
    assert [uniform(8, 0, k) for k in range(100)] != [uniform(7, 0, k) for k in range(100)]
    assert all(0 <= uniform(7, 3, k) < 1 for k in range(1000))


def test_mixture_rows_hold_both_sources_with_their_labels(files: Path, tokenizer_dir: Path) -> None:
    loader = PackedLoader(mixture_config(files, tokenizer_dir))
    batches = list(islice(loader, 40))
    sources = torch.cat([b["sources"].flatten() for b in batches])
    labels = torch.cat([b["labels"].flatten() for b in batches])
    trained = labels != -100
    assert loader.names == ["chat", "text"]
    assert (sources[trained] == 0).sum() > 0 and (sources[trained] == 1).sum() > 0
    state = loader.state_dict()
    assert set(state) == {"dp_rank", "dp_size", "draws", "offset", "sources"} and len(state["sources"]) == 2
    chat = loader.state_dict()["sources"][0]
    assert chat["overlong"] + chat["untrained"] > 0  # write_chat_corpus has both kinds
    counts = {"overlong": chat["overlong"], "untrained": chat["untrained"], "divergent": 0, "unreachable": 0}
    assert loader.skipped()["chat"] == counts
    # the end-of-run line: the conversations' counts in their words, named by the source; the text source's none
    assert not chat["overlong"] and chat["untrained"] > 1  # so far
    assert (
        loader.skipped_line(loader.skipped())
        == f"{chat['untrained']} conversations without a trained token skipped (chat)"
    )
    assert loader.skipped_line({"chat": dict.fromkeys(counts, 0), "text": dict.fromkeys(counts, 0)}) == ""


def test_a_stream_encodes_growing_batches_and_its_rows_do_not_depend_on_them(
    files: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first encoder call takes 4 items, each next one twice as many up to 64 (or the characters' bound); the
    loader's rows and state are the same as with 64 items from the first call."""
    assert [len(b) for b in batches(iter(["a"] * 200), 64, 10**9, first_items=4)] == [4, 8, 16, 32, 64, 64, 12]
    assert [len(b) for b in batches(iter(["a"] * 100), 64, 10**9)] == [64, 36]
    assert [len(b) for b in batches(iter(["ab"] * 6), 64, 4, first_items=4)] == [2, 2, 2]
    config = mixture_config(files, tokenizer_dir, shuffle_buffer=16, seed=3)
    loader = iter(PackedLoader(config))
    growing = [next(loader) for _ in range(30)]
    monkeypatch.setattr(mixture, "FIRST_ENCODE_ITEMS", mixture.ENCODE_ITEMS)
    fixed_loader = PackedLoader(config)
    fixed = list(islice(fixed_loader, 30))
    for got, want in zip(growing, fixed, strict=True):
        for key in KEYS:
            assert torch.equal(got[key], want[key]), key


def test_resume_mid_mixture_is_exact(files: Path, tokenizer_dir: Path) -> None:
    """Saved at every step of a shuffled two-source mixture (dp rank 1 of 2, ring 2 x ulysses 2), through json, a
    new loader yields exactly the next batches: at save points inside a text document (offset > 0), with a
    conversation waiting for the next row, and at a clean row end."""
    config = mixture_config(files, tokenizer_dir, shuffle_buffer=16, seed=3, batch_size=2)
    place = SequencePlace(ring_rank=1, ring_size=2, ulysses_rank=0, ulysses_size=2)
    loader = PackedLoader(config, dp_rank=1, dp_size=2, place=place)
    batches = iter(loader)
    states, following = [], []
    for _ in range(24):
        next(batches)
        states.append(json.loads(json.dumps(loader.state_dict())))
    following = [next(batches) for _ in range(3)]
    assert any(s["offset"] > 0 for s in states) and any(s["offset"] == 0 for s in states)
    for state in (states[-1], next(s for s in states if s["offset"] > 0), next(s for s in states if not s["offset"])):
        resumed = PackedLoader(config, dp_rank=1, dp_size=2, place=place)
        resumed.load_state_dict(state)
        got = list(islice(resumed, 3)) if state is states[-1] else None
        if got is None:  # an earlier save point: compare with the uninterrupted run from there
            fresh = iter(PackedLoader(config, dp_rank=1, dp_size=2, place=place))
            index = states.index(state)
            expected = [next(fresh) for _ in range(index + 4)][index + 1 :]
            got = list(islice(resumed, 3))
        else:
            expected = following
        for want, batch in zip(expected, got, strict=True):
            for key in KEYS:
                assert torch.equal(batch[key], want[key]), key
            assert [c.tolist() for c in batch["cu_seqlens"]] == [c.tolist() for c in want["cu_seqlens"]]


def test_states_of_another_data_layout_are_refused(files: Path, tokenizer_dir: Path) -> None:
    mixture = PackedLoader(mixture_config(files, tokenizer_dir))
    single = PackedLoader(DataConfig(seq_len=64, paths=[str(files / "text.jsonl")], tokenizer=str(tokenizer_dir)))
    with pytest.raises(
        ValueError, match=r"saved by a loader of 1 source\(s\), and this one reads 2 \(\['chat', 'text'\]"
    ):
        mixture.load_state_dict(single.state_dict())
    with pytest.raises(ValueError, match="saved by a loader of 2 source"):
        single.load_state_dict(mixture.state_dict())
    old = {"dp_rank": 0, "dp_size": 1, "epoch": 0, "document": 3, "offset": 5}  # the format from before mixtures
    single.load_state_dict(old)
    assert single.state_dict() == {**old, "part": 0, "overlong": 0, "untrained": 0, "divergent": 0, "unreachable": 0}


def test_chat_sources_in_every_file_format_and_auto(files: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in (files / "chat.jsonl").read_text().splitlines()[:10]]
    (tmp_path / "chat.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chat.parquet")
    jsonl = list(DocumentSource(paths=[str(files / "chat.jsonl")], format="auto").records(0))[:10]
    assert [w for _, w in jsonl[:2]] == [f"{files}/chat.jsonl:1", f"{files}/chat.jsonl:2"]
    for name, where in (("chat.json", "record 1"), ("chat.parquet", "row 1")):
        source = DocumentSource(paths=[str(tmp_path / name)], format="auto")
        assert source.format == "chat"
        got = list(source.records(0))
        assert [json.loads(r)["messages"] for r, _ in got] == [json.loads(r)["messages"] for r, _ in jsonl]
        assert got[1][1] == f"{tmp_path / name} {where}"
    assert DocumentSource(paths=[str(files / "text.jsonl")], format="auto").format == "text"
    with pytest.raises(ValueError, match="a chat record: use data.format=chat or auto"):
        DocumentSource(paths=[str(files / "chat.jsonl")], format="text")


def test_conversations_longer_than_a_row(files: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    """``data.overlong``: drop (counted), truncate (the first seq_len tokens, their labels kept) or error (naming
    the record); records without a trained token are skipped and counted, and a source of only such is an error."""
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * 200}]}
    short = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a short answer"}]}
    silent = {"messages": [{"role": "user", "content": "nobody answers"}]}
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (short, long, silent, short)))
    config = DataConfig(seq_len=40, paths=[str(path)], tokenizer=str(tokenizer_dir))
    dropped = PackedLoader(config)
    row = next(iter(dropped))  # short, short: the long one dropped, the silent one skipped
    assert dropped.skipped()["data"] == {"overlong": 1, "untrained": 1, "divergent": 0, "unreachable": 0}
    assert dropped.skipped_line(dropped.skipped()) == (
        "1 conversation longer than data.seq_len dropped (data.overlong=drop), 1 conversation without a trained token "
        "skipped"
    )
    every = {"overlong": 2, "untrained": 0, "divergent": 3, "unreachable": 1}  # as a chat source words each count
    assert dropped.skipped_line({"data": every}) == (
        "2 conversations longer than data.seq_len dropped (data.overlong=drop), 3 conversations rendered once per "
        "divergent turn (data.divergent_turns), 1 turn no generation prompt leads to left out "
        "(data.unreachable_turns=skip)"
    )
    encoder = ChatEncoder(load_tokenizer(str(tokenizer_dir)))
    lengths = [len(d) for d in encoder.encode([parse_conversation(r, "x") for r in (short, long)])]
    assert lengths[0] < 20 < 40 < lengths[1]
    assert row["cu_seqlens"][0].tolist() == [0, lengths[0], 2 * lengths[0], 40]  # two shorts, then padding
    truncated = list(islice(PackedLoader(dataclasses.replace(config, overlong="truncate")), 2))
    assert truncated[0]["cu_seqlens"][0].tolist() == [0, lengths[0], 40]  # the cut one does not fit: padding
    document = encoder.encode([parse_conversation(long, "x")])[0]
    tokens, trained = document.tokens[:40], document.trained[:40]
    assert torch.equal(truncated[1]["input_ids"][0], tokens)
    assert truncated[1]["labels"][0].tolist() == torch.where(trained[1:], tokens[1:], -100).tolist() + [-100]
    with pytest.raises(ValueError, match=rf"{path}:2: a conversation of \d+ tokens is longer than data.seq_len=40; "):
        next(iter(PackedLoader(dataclasses.replace(config, overlong="error"))))
    path.write_text(json.dumps(silent) + "\n")
    with pytest.raises(ValueError, match="none of the 1 records of epoch 0 gives a document .* no assistant turn"):
        next(iter(PackedLoader(config)))


def test_embedded_chat_corpus_is_made_locally_and_holds_out_files() -> None:
    train, validation = embedded_files(True, "train"), embedded_files(True, "validation")
    assert train and validation and not set(train) & set(validation)
    assert not any("/test/" in f or "/tests/" in f for f in train + validation)
    assert len(validation) == len(train + validation) // 50
    first = [json.loads(r["record"]) for r in stdlib_conversations(train[:20])]
    assert first == [json.loads(r["record"]) for r in stdlib_conversations(train[:20])]  # deterministic
    messages = [m for conversation in first for m in conversation["messages"]]
    assert {m["role"] for m in messages} == {"system", "user", "assistant"}
    assert all(m["content"].strip() for m in messages)
    text_train, text_validation = embedded_files(False, "train"), embedded_files(False, "validation")
    assert (
        not set(text_train) & set(text_validation) and len(text_validation) == len(text_train + text_validation) // 50
    )


BAD_DATA = {  # DataConfig changes, substrings of the message
    "format": ({"format": "csv"}, ["data.format='csv' must be one of auto, text, chat"]),
    "train_on": ({"train_on": "user"}, ["data.train_on='user' must be one of"]),
    "overlong": ({"overlong": "split"}, ["data.overlong='split' must be one of drop, truncate, error"]),
    "divergent_turns": (
        {"divergent_turns": "all"},
        ["data.divergent_turns='all' must be one of expand, last_turn, error"],
    ),
    "unreachable_turns": ({"unreachable_turns": "drop"}, ["data.unreachable_turns='drop' must be one of error, skip"]),
    "no_name": ({"sources": [SourceConfig(paths=["x.jsonl"])]}, ["data.sources[0] has no name"]),
    "same_name": (
        {"sources": [SourceConfig("a", ["x.jsonl"]), SourceConfig("a", ["y.jsonl"])]},
        ["data.sources has two sources named 'a'"],
    ),
    "weight": (
        {"sources": [SourceConfig("a", ["x.jsonl"]), SourceConfig("b", ["y.jsonl"], weight=0.0)]},
        ["data.sources[1].weight=0.0 (b) must be > 0", "leave a source out instead"],
    ),
    "negative_weight": ({"val_sources": [SourceConfig("v", weight=-1.0)]}, ["data.val_sources[0].weight=-1.0"]),
    "sources_and_paths": (
        {"paths": ["x.jsonl"], "sources": [SourceConfig("a", ["y.jsonl"])]},
        ["data.sources and data.paths (or data.dataset) are both set"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_data_settings_name_the_setting(case: str, tokenizer_dir: Path) -> None:
    changes, expected = BAD_DATA[case]
    with pytest.raises(ValueError) as error:
        check_data(DataConfig(**changes), load_tokenizer(str(tokenizer_dir)))
    for text in expected:
        assert text in str(error.value), f"{text!r} not in {error.value}"


def test_bad_data_files_fail_before_training(files: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    """What ``check_data`` (the trainer's check, before any process group) finds in the files: a validation file
    that is also a training file (also the embedded corpus's), a missing template file, a bad first record."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    chat = str(files / "chat.jsonl")
    with pytest.raises(ValueError, match=rf"data.val_sources 'v': {chat} is also training data \('data'\)"):
        check_data(DataConfig(paths=[chat], val_sources=[SourceConfig("v", [chat])]), tokenizer)
    with pytest.raises(ValueError, match="data.val_sources 'v': .* is also training data .*split validation"):
        check_data(DataConfig(val_sources=[SourceConfig("v", split="train")]), tokenizer)
    check_data(DataConfig(paths=[chat], val_sources=[SourceConfig("v", [str(files / "val_chat.jsonl")])]), tokenizer)
    check_data(DataConfig(val_sources=[SourceConfig("v", split="validation")]), tokenizer)  # the default job's
    with pytest.raises(FileNotFoundError, match="data.chat_template='nowhere.jinja': no such file"):
        check_data(DataConfig(paths=[chat], chat_template="nowhere.jinja"), tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": 3}]}) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:1: messages\[0\]'s content is a int, not a string"):
        check_data(DataConfig(paths=[str(bad)], format="chat"), tokenizer)
