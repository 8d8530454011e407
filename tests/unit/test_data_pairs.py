"""Preference pairs, the third kind of source: TRL's three formats (strings, conversational, implicit prompt) packed
as the contract with the preference objective says (tokens, labels, positions, cu_seqlens, doc_prefix, completions,
pair_counts, pair_ids), the prompt shared or repeated (``data.share_prompt``), pairs never split across rows,
mixtures with chat and text, exact resume mid-epoch, the context-parallel shard of ``completions``, bad records (one
line each, naming ``file:line``) and pairs longer than a row (``data.overlong``), ``format=auto``, and the embedded
preference corpus.

The expected tokens are built by hand, independently of the template and of the encoder: the ChatML text of each
prompt (with the generation prompt) and answer written out and tokenized; the expected rows come from a layout
written out by hand (a small case) and from ``testbed.pairs.pack_pairs``, the preference objective's own packing of
token lists, written apart from the loader.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import islice
from pathlib import Path

import pytest
import torch

from lctrain.attention import SequencePlace, unshard_sequence
from lctrain.data import DataConfig, PackedLoader, SourceConfig, check_data, load_tokenizer
from lctrain.data.packing import IGNORE_INDEX, Packer, Pair
from lctrain.data.pairs import PairEncoder, pair_id, parse_pair
from lctrain.data.sources import DocumentSource, embedded_files
from lctrain.data.stdlib_pairs import stdlib_pairs
from testbed.corpus import write_chat_corpus, write_corpus, write_pair_corpus
from testbed.pairs import pack_pairs

ROW_KEYS = ("input_ids", "labels", "position_ids", "sources", "completions")
HOST_KEYS = ("cu_seqlens", "doc_prefix", "pair_ids")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):  # noqa: ANN001, ANN201
    return load_tokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    write_pair_corpus(root / "pairs.jsonl", 60)
    write_pair_corpus(root / "val_pairs.jsonl", 12, seed=5)
    write_corpus(root / "text.jsonl", 60)
    write_chat_corpus(root / "chat.jsonl", 60)
    return root


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def as_lists(batch: dict) -> dict:
    """A batch's fields as plain lists (the host lists' tensors too), for equality."""
    out = {key: batch[key].tolist() for key in ROW_KEYS if key in batch}
    out |= {key: [t.tolist() for t in batch[key]] for key in HOST_KEYS if key in batch}
    out["pair_counts"] = batch.get("pair_counts")
    return out


# ----------------------------------------------------------------------------------------------- the layout


def test_pairs_pack_as_the_layout_written_out_by_hand() -> None:
    """Two pairs, one with a three-token prompt and one with a one-token prompt (no prompt document), then padding
    (the third pair does not fit): every field of the row, shared and unshared."""
    pairs = [
        Pair(torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30]), pair_id=5),
        Pair(torch.tensor([40]), torch.tensor([50]), torch.tensor([60, 61]), source=1, pair_id=-3),
        Pair(torch.arange(70, 75), torch.tensor([80, 81]), torch.tensor([90, 91])),  # does not fit: the next row's
    ]
    row = next(Packer(iter(pairs), 20, pad_id=7))
    x = IGNORE_INDEX
    assert row.input_ids.tolist() == [10, 11, 12, 20, 21, 12, 30, 40, 50, 40, 60, 61] + [7] * 8
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2] + list(range(8))
    assert row.labels.tolist() == [x, x, 20, 21, x, 30, x, 50, x, 60, 61, x] + [x] * 8
    assert row.completions.tolist() == [-1, -1, 0, 0, -1, 1, -1, 2, -1, 3, 3, -1] + [-1] * 8
    assert row.sources.tolist() == [0] * 7 + [1] * 5 + [0] * 8
    assert row.cu_seqlens.tolist() == [0, 2, 5, 7, 9, 12, 20]
    assert row.doc_prefix.tolist() == [-1, 0, 0, -1, -1, -1]
    assert row.pair_ids.tolist() == [5, -3]

    unshared = [Pair(p.prompt, p.chosen, p.rejected, p.source, p.pair_id, shared=False) for p in pairs]
    row = next(Packer(iter(unshared), 20, pad_id=7))
    assert row.input_ids.tolist() == [10, 11, 12, 20, 21, 10, 11, 12, 30, 40, 50, 40, 60, 61] + [7] * 6
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 0, 1, 2] + list(range(6))
    assert row.labels.tolist() == [x, x, 20, 21, x, x, x, 30, x, 50, x, 60, 61, x] + [x] * 6
    assert row.completions.tolist() == [-1, -1, 0, 0, -1, -1, -1, 1, -1, 2, -1, 3, 3, -1] + [-1] * 6
    assert row.cu_seqlens.tolist() == [0, 5, 9, 11, 14, 20]
    assert row.doc_prefix.tolist() == [-1] * 5
    assert [len(p) for p in pairs] == [7, 5, 10] and [len(p) for p in unshared] == [9, 5, 14]


def test_a_pair_that_does_not_fit_waits_for_the_next_row() -> None:
    """A text document fills part of the row; the pair that does not fit in the rest starts the next row, whole."""
    pair = Pair(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6]))
    rows = Packer(iter([torch.arange(100, 106), pair, pair]), 8, pad_id=0)
    first, second = next(rows), next(rows)
    assert first.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 0, 0] and first.pair_ids.tolist() == []
    assert first.completions.eq(-1).all() and first.doc_prefix.tolist() == [-1, -1]
    assert second.input_ids.tolist() == [1, 2, 3, 4, 5, 3, 6, 0] and second.completions.tolist()[:7] == [
        -1,
        -1,
        0,
        0,
        -1,
        1,
        -1,
    ]
    assert rows.holds_document  # the second pair waits for the third row


# ------------------------------------------------------------------------------------ formats through the loader


def chatml(messages: list[dict], generation_prompt: bool = False) -> str:
    """The embedded tokenizer's ChatML, written out."""
    text = "<|bos|>" + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Which is larger, 3 or 5?"}]
YES = [{"role": "assistant", "content": "5 is larger."}]
NO = [{"role": "assistant", "content": "3 is larger, surely."}]
RECORDS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome, of course."},
    {"prompt": USER, "chosen": YES, "rejected": NO},
    {"chosen": USER + YES, "rejected": USER + NO},  # implicit prompt: the common messages
]


def expected_tokens(tokenizer, record: dict) -> tuple[list[int], list[int], list[int]]:  # noqa: ANN001
    if isinstance(record.get("prompt"), str):  # strings: [BOS] prompt; answer [EOS]
        eos = [tokenizer.eos_token_id]
        prompt = [tokenizer.bos_token_id, *ids(tokenizer, record["prompt"])]
        return prompt, ids(tokenizer, record["chosen"]) + eos, ids(tokenizer, record["rejected"]) + eos
    prompt = ids(tokenizer, chatml(USER, generation_prompt=True))
    # what the template writes after the generation prompt: the content and <|im_end|>, not the newline after it
    return prompt, ids(tokenizer, YES[0]["content"] + "<|im_end|>"), ids(tokenizer, NO[0]["content"] + "<|im_end|>")


@pytest.mark.parametrize("share_prompt", [True, False])
def test_each_format_packs_as_the_objective_expects(
    tmp_path: Path, tokenizer_dir: Path, tokenizer, share_prompt: bool
) -> None:  # noqa: ANN001
    """Strings, conversational and implicit-prompt records in one file: the row equals ``pack_pairs`` of the tokens
    built by hand (its padding token aside), the pair ids are those tokens' (the implicit prompt's pair is the
    explicit one's, so it has its id)."""
    tokens = [expected_tokens(tokenizer, record) for record in RECORDS]
    assert tokens[1] == tokens[2]  # the implicit prompt is the explicit one
    # a row that holds the three pairs and not the next epoch's first one: the rest is padding
    used = pack_pairs(tokens, 1024, shared=share_prompt)["cu_seqlens"][-2].item()
    first = pack_pairs(tokens[:1], 1024, shared=share_prompt)["cu_seqlens"][-2].item()
    seq_len = 2 * ((used + first - 1) // 2)
    want = pack_pairs(tokens, seq_len, shared=share_prompt)
    path = write_jsonl(tmp_path / "pairs.jsonl", RECORDS)
    config = DataConfig(paths=[path], seq_len=seq_len, tokenizer=str(tokenizer_dir), share_prompt=share_prompt)
    loader = PackedLoader(config)
    assert loader.pairs and loader._sources[0].documents.format == "preference"  # format=auto recognised them
    batch = as_lists(next(iter(loader)))
    assert batch["input_ids"][0][:used] == want["input_ids"][:used].tolist()
    assert batch["input_ids"][0][used:] == [tokenizer.pad_token_id] * (seq_len - used)
    for key in ("labels", "position_ids", "completions", "sources"):
        assert batch[key][0] == want[key].tolist(), key
    assert batch["cu_seqlens"][0] == want["cu_seqlens"].tolist()
    assert batch["doc_prefix"][0] == want["doc_prefix"].tolist()
    assert batch["pair_counts"] == [3]
    assert batch["pair_ids"][0] == [pair_id(*(torch.tensor(t) for t in pair)) for pair in tokens]
    # the trained tokens decode to the answers as written
    labels, completions = torch.tensor(batch["labels"][0]), torch.tensor(batch["completions"][0])
    assert tokenizer.decode(labels[completions == 2]) == "5 is larger.<|im_end|>"
    assert tokenizer.decode(labels[completions == 5]) == "3 is larger, surely.<|im_end|>"


def test_a_template_of_another_kind_renders_the_prompt_once(tokenizer) -> None:  # noqa: ANN001
    """A Llama-3-like template (a BOS in the text, headers, no trailing newline): the answer is what follows the
    prompt rendered with the generation prompt."""
    template = (
        "{{- bos_token -}}{%- for m in messages -%}{{- '[' + m['role'] + ']' + m['content'] + '<|eos|>' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '[assistant]' -}}{%- endif -%}"
    )
    record = parse_pair({"prompt": USER, "chosen": YES, "rejected": NO}, "x.jsonl:1")
    (pair,) = PairEncoder(tokenizer, template=template).encode([record])
    assert pair.prompt.tolist() == ids(
        tokenizer, "<|bos|>[system]Be brief.<|eos|>[user]Which is larger, 3 or 5?<|eos|>[assistant]"
    )
    assert pair.chosen.tolist() == ids(tokenizer, "5 is larger.<|eos|>")


# ---------------------------------------------------------------------------------------------- pair identity


def test_a_pair_id_is_its_tokens_not_its_place(files: Path, tokenizer) -> None:  # noqa: ANN001
    """The same records read at other places of another source have the same ids; another pair (another token, the
    answers swapped, a token moved across the prompt's end) has another id, and so has every distinct pair of the
    corpus."""
    records = [parse_pair(record, f"a.jsonl:{line}") for line, record in enumerate(RECORDS, 1)]
    here = PairEncoder(tokenizer, source=0).encode(records)
    moved = [dataclasses.replace(record, where=f"/elsewhere/b.jsonl:{9 + line}") for line, record in enumerate(records)]
    assert [p.pair_id for p in PairEncoder(tokenizer, source=3).encode(moved)] == [p.pair_id for p in here]
    assert here[0].pair_id != here[1].pair_id == here[2].pair_id  # the implicit prompt's pair is the explicit one's
    prompt, chosen, rejected = torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])
    variants = [
        (prompt, chosen, rejected),
        (prompt, rejected, chosen),
        (prompt, chosen, torch.tensor([7])),
        (prompt[:2], torch.cat([prompt[2:], chosen]), rejected),
        (torch.cat([prompt, chosen[:1]]), chosen[1:], rejected),
    ]
    assert len({pair_id(*variant) for variant in variants}) == len(variants)
    lines = (files / "pairs.jsonl").read_text().splitlines()
    encoded = PairEncoder(tokenizer).encode([parse_pair(line, "x") for line in lines])
    distinct = {tuple(tuple(t.tolist()) for t in (p.prompt, p.chosen, p.rejected)) for p in encoded}
    assert len({p.pair_id for p in encoded}) == len(distinct) > 50


def test_pair_ids_do_not_depend_on_how_the_paths_are_spelled(
    files: Path, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One file named by its absolute path, a relative one, with ``./`` and ``..``, through a symlink and a glob, and
    as the second source of a mixture after text: the same pairs have the same ids, so the reference log-probs saved
    by pair id under one spelling serve the others."""
    from lctrain.train.reference import ReferenceCache

    (tmp_path / "data").mkdir()
    write_pair_corpus(tmp_path / "data" / "pairs.jsonl", 30)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "data" / "pairs.jsonl")
    monkeypatch.chdir(tmp_path)

    def pair_ids(config: DataConfig, batches: int) -> list[int]:
        return [i for batch in islice(PackedLoader(config), batches) for row in batch["pair_ids"] for i in row.tolist()]

    def single(path: str) -> DataConfig:
        return DataConfig(paths=[path], seq_len=64, batch_size=2, tokenizer=str(tokenizer_dir))

    spelled = pair_ids(single(str(tmp_path / "data" / "pairs.jsonl")), 4)
    for path in ("data/pairs.jsonl", "./data/../data/pairs.jsonl", "link.jsonl", "data/*.jsonl"):
        assert pair_ids(single(path), 4) == spelled, path
    sources = [SourceConfig("text", [str(files / "text.jsonl")]), SourceConfig("pairs", ["link.jsonl"])]
    mixed = pair_ids(DataConfig(sources=sources, seq_len=64, batch_size=2, tokenizer=str(tokenizer_dir)), 4)
    assert mixed and mixed == spelled[: len(mixed)]  # source 1 here, source 0 there
    cache = ReferenceCache(tmp_path / "run" / "dp0.pt", "the reference")
    cache.add(torch.tensor(spelled), torch.arange(2.0 * len(spelled), dtype=torch.float64))
    cache.save()
    loaded = ReferenceCache.load(tmp_path / "run" / "dp0.pt", "the reference")
    assert loaded is not None
    torch.testing.assert_close(
        loaded.lookup(torch.tensor(mixed), torch.device("cpu")),
        cache.lookup(torch.tensor(spelled[: len(mixed)]), torch.device("cpu")),
    )


# --------------------------------------------------------------------------- whole pairs, mixtures, resume, shard


def test_pairs_are_never_split_and_come_in_order(files: Path, tokenizer_dir: Path, tokenizer) -> None:  # noqa: ANN001
    """Over a whole epoch of 64-token rows: each row's completions 0..2K-1 hold exactly the answers of its K pairs,
    which are the encoder's pairs in file order, the overlong ones (dropped, counted) left out."""
    config = DataConfig(paths=[str(files / "pairs.jsonl")], seq_len=64, tokenizer=str(tokenizer_dir))
    lines = (files / "pairs.jsonl").read_text().splitlines()
    encoded = PairEncoder(tokenizer).encode([parse_pair(line, "x") for line in lines])
    fitting = [(p.chosen[:].tolist(), p.rejected.tolist()) for p in encoded if len(p) <= 64]
    assert 0 < len(fitting) < len(encoded)
    loader = PackedLoader(config)
    got = []
    for batch in loader:
        labels, completions = batch["labels"][0], batch["completions"][0]
        assert completions.max().item() == 2 * batch["pair_counts"][0] - 1
        for k in range(batch["pair_counts"][0]):
            got.append((labels[completions == 2 * k].tolist(), labels[completions == 2 * k + 1].tolist()))
        if loader.state_dict()["epoch"] == 1:
            break
    assert got[: len(fitting)] == fitting
    assert loader.skipped()["data"]["overlong"] == len(encoded) - len(fitting)


def test_mixture_of_pairs_chat_and_text(files: Path, tokenizer_dir: Path) -> None:
    """Pairs beside conversations and text in rows: completions only on the pairs' trained tokens (the others keep
    their labels), doc_prefix only on shared answers, each source's tokens tagged with its index; the counts of the
    end-of-run line in each kind's words."""
    sources = [
        SourceConfig("pairs", [str(files / "pairs.jsonl")], weight=2.0),
        SourceConfig("chat", [str(files / "chat.jsonl")]),
        SourceConfig("text", [str(files / "text.jsonl")]),
    ]
    loader = PackedLoader(DataConfig(sources=sources, seq_len=64, tokenizer=str(tokenizer_dir)))
    seen = set()
    for batch in islice(loader, 40):
        labels, completions, tagged = batch["labels"][0], batch["completions"][0], batch["sources"][0]
        trained = labels != IGNORE_INDEX
        assert ((completions >= 0) == (trained & (tagged == 0))).all()
        bounds, prefixes = batch["cu_seqlens"][0], batch["doc_prefix"][0]
        for document, prefix in enumerate(prefixes.tolist()):
            if prefix >= 0:  # an answer: it continues its prompt's positions and belongs to a pair
                start = bounds[document].item()
                assert tagged[start] == 0 and prefix < document
                assert batch["position_ids"][0][start] == bounds[prefix + 1] - bounds[prefix]
        seen |= set(tagged[trained].tolist())
    assert seen == {0, 1, 2}
    # the end-of-run line: each source's counts in the words of its kind, the text source's none
    pairs, chat = loader.skipped()["pairs"], loader.skipped()["chat"]
    assert (pairs["overlong"], chat["untrained"], chat["overlong"]) == (1, 1, 0)  # so far
    assert loader.skipped_line(loader.skipped()) == (
        "1 pair longer than data.seq_len dropped (data.overlong=drop) (pairs); "
        "1 conversation without a trained token skipped (chat)"
    )


@pytest.mark.parametrize("share_prompt", [True, False])
def test_resume_mid_epoch_with_pairs_is_exact(files: Path, tokenizer_dir: Path, share_prompt: bool) -> None:
    """A shuffled mixture of pairs and text on dp rank 1 of 2, ring 2 x ulysses 2, saved after every batch through
    json: a new loader yields exactly the next batches, at save points inside a text document and with a pair
    waiting for the next row."""
    sources = [
        SourceConfig("pairs", [str(files / "pairs.jsonl"), str(files / "val_pairs.jsonl")], weight=3.0),
        SourceConfig("text", [str(files / "text.jsonl")], weight=2.0),
    ]
    config = DataConfig(
        sources=sources,
        seq_len=64,
        batch_size=1,
        shuffle_buffer=8,
        seed=4,
        tokenizer=str(tokenizer_dir),
        share_prompt=share_prompt,
    )
    place = SequencePlace(ring_rank=1, ring_size=2, ulysses_rank=1, ulysses_size=2)
    loader = PackedLoader(config, dp_rank=1, dp_size=2, place=place)
    batches = iter(loader)
    run = []
    for _ in range(24):
        run.append((json.loads(json.dumps(loader.state_dict())), as_lists(next(batches))))
    offsets = [state["offset"] for state, _ in run]
    assert any(offsets) and not all(offsets)
    for index in (3, offsets.index(next(o for o in offsets if o)), len(run) - 4):
        resumed = PackedLoader(config, dp_rank=1, dp_size=2, place=place)
        resumed.load_state_dict(run[index][0])
        assert [as_lists(batch) for batch in islice(resumed, 3)] == [batch for _, batch in run[index : index + 3]]


def test_completions_are_sharded_like_labels(files: Path, tokenizer_dir: Path) -> None:
    """Each (ring, ulysses) rank's completions are its part of the global row's (zigzag): put back together they
    equal the whole row's, which keeps every completion token beside its label."""
    config = DataConfig(paths=[str(files / "pairs.jsonl")], seq_len=64, batch_size=2, tokenizer=str(tokenizer_dir))
    whole = next(iter(PackedLoader(config)))
    parts = {}
    for ring_rank in range(2):
        for ulysses_rank in range(2):
            place = SequencePlace(ring_rank=ring_rank, ring_size=2, ulysses_rank=ulysses_rank, ulysses_size=2)
            batch = next(iter(PackedLoader(config, place=place)))
            assert batch["completions"].shape == (2, 16)
            assert ((batch["completions"] >= 0) <= (batch["labels"] != IGNORE_INDEX)).all()
            for key in ("doc_prefix", "pair_ids"):
                assert all(torch.equal(a, b) for a, b in zip(batch[key], whole[key]))
            parts[ring_rank, ulysses_rank] = batch
    for key in ("completions", "labels"):
        pieces = [parts[r, u][key] for r in range(2) for u in range(2)]
        assert torch.equal(unshard_sequence(pieces, dim=1, ring_size=2, ulysses_size=2), whole[key]), key


# ------------------------------------------------------------------------------------- bad records, long pairs

BAD = [
    ("not json", "not valid JSON"),
    ('["a list"]', "not an object"),
    ({"prompt": "p", "chosen": "c"}, "has no 'rejected'"),
    ({"prompt": "p", "chosen": "", "rejected": "r"}, "'chosen' is empty"),
    ({"prompt": [], "chosen": YES, "rejected": NO}, "'prompt' is empty"),
    ({"chosen": "c", "rejected": "r"}, "has no 'prompt'"),
    ({"prompt": "p", "chosen": YES, "rejected": NO}, "give three strings (plain text) or three lists of messages"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "are identical"),
    ({"chosen": USER + YES, "rejected": USER + YES}, "are identical"),
    ({"chosen": USER + YES, "rejected": [{"role": "user", "content": "Other?"}, *NO]}, "no common prompt"),
    ({"chosen": USER + YES, "rejected": USER}, "'rejected' has no message after the prompt"),
    ({"prompt": USER, "chosen": [{"role": "robot", "content": "x"}], "rejected": NO}, "chosen[0] has the role"),
    ({"prompt": USER, "chosen": [{"content": "x"}], "rejected": NO}, "chosen[0] has no 'role'"),
    ({"prompt": "p", "chosen": 3, "rejected": "r"}, "'chosen' is not a string or a list of messages (a int)"),
]


@pytest.mark.parametrize(("record", "message"), BAD, ids=[m for _, m in BAD])
def test_each_bad_record_is_one_line_naming_file_and_line(
    tmp_path: Path, tokenizer_dir: Path, record: object, message: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], record])
    loader = PackedLoader(DataConfig(paths=[path], format="preference", seq_len=64, tokenizer=str(tokenizer_dir)))
    with pytest.raises(ValueError) as error:
        next(iter(loader))
    assert message in str(error.value) and f"{path}:2: " in str(error.value) and "\n" not in str(error.value)


def test_an_answer_the_template_does_not_write_after_its_prompt_is_one_line(tokenizer) -> None:  # noqa: ANN001
    """A template that writes the last message differently (its generation prompt is not a prefix of the turn)."""
    template = "{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}{%- if add_generation_prompt -%}>{%- endif -%}"
    record = parse_pair({"prompt": USER, "chosen": YES, "rejected": NO}, "x.jsonl:7")
    with pytest.raises(ValueError, match=r"^x\.jsonl:7: the chat template does not write 'chosen' after the prompt"):
        PairEncoder(tokenizer, template=template).encode([record])


@pytest.mark.parametrize("share_prompt", [True, False])
def test_pairs_longer_than_a_row_by_data_overlong(tmp_path: Path, tokenizer_dir: Path, share_prompt: bool) -> None:
    """drop: skipped and counted; error: one line naming the record; truncate: the prompt cut from its start until
    the pair fits the row exactly (its answers whole, the id that of the cut pair), and dropped when its answers
    alone do not fit. The end-of-run line counts the pairs dropped, in the words of each setting."""
    long = {"prompt": "word " * 80, "chosen": " yes", "rejected": " no"}
    huge = {"prompt": "p", "chosen": "yes " * 80, "rejected": " no"}
    path = write_jsonl(tmp_path / "long.jsonl", [long, RECORDS[0], huge, RECORDS[0]])

    def loader(overlong: str) -> PackedLoader:
        config = DataConfig(
            paths=[path], seq_len=48, overlong=overlong, tokenizer=str(tokenizer_dir), share_prompt=share_prompt
        )
        return PackedLoader(config)

    dropping = loader("drop")
    rows = iter(dropping)
    kept = [i for _ in range(2) for i in next(rows)["pair_ids"][0].tolist()]
    kept_pair = PairEncoder(dropping.tokenizer).encode([parse_pair(RECORDS[0], "x")])[0]
    assert kept[:2] == [kept_pair.pair_id] * 2  # lines 2 and 4: the same pair, the same id
    state = dropping.state_dict()  # lines 1 and 3 (items 0 and 2) dropped in every epoch
    assert state["overlong"] == 2 * state["epoch"] + (state["document"] > 0) + (state["document"] > 2) > 0
    assert state["overlong"] > 1
    line = f"{state['overlong']} pairs longer than data.seq_len dropped (data.overlong=drop)"
    assert dropping.skipped_line(dropping.skipped()) == line
    with pytest.raises(ValueError, match=rf"^{path}:1: a preference pair of \d+ tokens .* longer than data.seq_len=48"):
        next(iter(loader("error")))
    truncating = loader("truncate")
    (pair,) = PairEncoder(truncating.tokenizer, shared=share_prompt).encode([parse_pair(long, "x")])
    answers = len(pair.chosen) + len(pair.rejected)
    keep = 48 - 1 - answers if share_prompt else (48 - answers) // 2
    want = pack_pairs(
        [(pair.prompt[-keep:].tolist(), pair.chosen.tolist(), pair.rejected.tolist())], 48, shared=share_prompt
    )
    rows = iter(truncating)
    first = next(rows)
    # the prompt's end and the answers fill the row (a repeated prompt: but for one token)
    assert first["pair_counts"] == [1] and len(dataclasses.replace(pair, prompt=pair.prompt[-keep:])) in (47, 48)
    for key in ("labels", "position_ids", "completions"):
        assert first[key][0].tolist() == want[key].tolist(), key
    # the cut pair is another pair (its reference log-probs see the shorter prompt): its own id
    assert first["pair_ids"][0].tolist() == [pair_id(pair.prompt[-keep:], pair.chosen, pair.rejected)]
    assert first["pair_ids"][0].item() != pair.pair_id
    next(rows)
    state = truncating.state_dict()  # the pair whose answers alone are too long (item 2) is dropped
    assert state["overlong"] == state["epoch"] + (state["document"] > 2)
    assert state["overlong"] == 1
    line = "1 pair whose answers alone do not fit in data.seq_len dropped (data.overlong=truncate)"
    assert truncating.skipped_line(truncating.skipped()) == line


# ------------------------------------------------------------------------------- formats, checks, embedded corpus


def test_format_auto_and_preference(files: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    """auto: preference from a first record with chosen and rejected, in jsonl, json and parquet; a text source
    read as text names the format; data.format=preference checks the first record before any process group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in (files / "pairs.jsonl").read_text().splitlines()][:6]
    json_path = tmp_path / "pairs.json"
    json_path.write_text(json.dumps(records))
    strings = [r for r in records if isinstance(r.get("prompt"), str)]
    parquet_path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(strings), parquet_path)
    for path in (files / "pairs.jsonl", json_path, parquet_path):
        assert DocumentSource(paths=[str(path)], format="auto").format == "preference"
    with pytest.raises(ValueError, match="a preference record: use data.format=preference or auto"):
        DocumentSource(paths=[str(files / "pairs.jsonl")], format="text")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": "c"}])
    with pytest.raises(ValueError, match="has no 'rejected'"):
        check_data(DataConfig(paths=[bad], format="preference"), tokenizer)
    check_data(DataConfig(paths=[str(files / "pairs.jsonl")], format="preference"), tokenizer)


def test_embedded_preference_corpus_is_made_locally_and_holds_out_files(tokenizer_dir: Path) -> None:
    """The same records on every call, from the chat corpus's files and splits; every record a conversational pair
    whose rejected answer holds the chosen one's words in another order; the validation split packs too."""
    train, validation = embedded_files(True, "train"), embedded_files(True, "validation")
    first = list(islice(stdlib_pairs(train), 50))
    assert first == list(islice(stdlib_pairs(train), 50)) and not set(train) & set(validation)
    for item in first:
        record = parse_pair(item["record"], item["where"])
        assert record.conversational and record.chosen[0]["role"] == "assistant"
        chosen, rejected = record.chosen[0]["content"], record.rejected[0]["content"]
        assert chosen != rejected and sorted(chosen.split()) == sorted(rejected.split())
    config = DataConfig(
        format="preference",
        seq_len=1024,
        tokenizer=str(tokenizer_dir),
        val_sources=[SourceConfig("pairs", split="validation")],
    )
    batch = next(iter(PackedLoader(config)))
    assert batch["pair_counts"][0] >= 2
    check_data(config, load_tokenizer(str(tokenizer_dir)))


def test_share_prompt_and_format_are_settings() -> None:
    assert DataConfig().share_prompt is True and DataConfig(format="preference").format == "preference"
    with pytest.raises(ValueError, match="data.sources\\[0\\].format='pairs' must be one of auto, text, chat, pref"):
        DataConfig(sources=[SourceConfig("a", format="pairs")])
