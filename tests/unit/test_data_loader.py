"""PackedLoader: dp sharding, context-parallel sharding, the embedded default corpus, bad inputs, exact resume."""

import json
import os
import random
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

import lctrain
from lctrain.attention import SequencePlace, unshard_sequence
from lctrain.data import DataConfig, DocumentSource, PackedLoader, default_tokenizer_dir, load_tokenizer
from lctrain.data.packing import IGNORE_INDEX
from lctrain.data.sources import read_text_files, stdlib_files

PLACE = ("ring_rank", "ring_size", "ulysses_rank", "ulysses_size")
WORDS = "alpha beta gamma delta def return class import lambda yield while 0 1 42 (x) [y] {z} + - * / ==".split()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    """Two jsonl files of 15 documents each (8 to 200 words); returns (files, texts in file order)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    files, texts = [], []
    for f in range(2):
        path = root / f"part{f}.jsonl"
        with open(path, "w") as out:
            for i in range(15):
                text = f"doc {f}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
                out.write(json.dumps({"id": f * 15 + i, "text": text, "meta": "x"}) + "\n")
                texts.append(text)
        files.append(str(path))
    return files, texts


def make_loader(corpus, tokenizer_dir, **kwargs) -> PackedLoader:
    """A loader of ``corpus``: ``dp_rank``/``dp_size`` and the place's ranks and sizes are taken from ``kwargs``, the
    rest is its ``DataConfig``."""
    dp = {k: kwargs.pop(k) for k in ("dp_rank", "dp_size") if k in kwargs}
    place = SequencePlace(**{k: kwargs.pop(k) for k in (*PLACE, "layout") if k in kwargs})
    return PackedLoader(DataConfig(paths=corpus[0], tokenizer=str(tokenizer_dir), **kwargs), **dp, place=place)


def framed(tokenizer, text: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


# ---------------------------------------------------------------------------------------------- dp sharding


@pytest.mark.parametrize("shuffle_buffer", [0, 8])
@pytest.mark.parametrize("dp_size", [2, 3])  # 2 files over 2 ranks: split by file; over 3: by document
def test_dp_sharding_is_disjoint_and_complete(corpus, dp_size: int, shuffle_buffer: int) -> None:
    for epoch in (0, 1):
        per_rank = [
            list(
                DocumentSource(
                    paths=corpus[0], shuffle_buffer=shuffle_buffer, seed=5, dp_rank=r, dp_size=dp_size
                ).texts(epoch)
            )
            for r in range(dp_size)
        ]
        union = [t for texts in per_rank for t in texts]
        assert sorted(union) == sorted(corpus[1])  # complete and, texts being distinct, disjoint
        assert all(len(texts) >= 30 // dp_size for texts in per_rank)
    if shuffle_buffer:
        source = DocumentSource(paths=corpus[0], shuffle_buffer=shuffle_buffer, seed=5)
        assert list(source.texts(0)) != corpus[1]  # shuffled ...
        assert list(source.texts(0)) == list(source.texts(0))  # ... deterministically ...
        assert list(source.texts(1)) != list(source.texts(0))  # ... and differently every epoch


def test_txt_files_are_documents_and_parquet_rows_are_documents(corpus, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = corpus[1][:5]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text + "\nsecond line\n")
    assert list(DocumentSource(paths=[str(tmp_path / "*.txt")]).texts(0)) == [t + "\nsecond line\n" for t in texts]
    pq.write_table(pa.table({"body": texts, "n": list(range(5))}), tmp_path / "data.parquet")
    assert list(DocumentSource(paths=[str(tmp_path / "data.parquet")], text_field="body").texts(0)) == texts
    with pytest.raises(ValueError, match="mix formats"):
        DocumentSource(paths=[str(tmp_path / "0.txt"), str(tmp_path / "data.parquet")])


def test_rows_are_the_rank_documents_framed_and_packed(corpus, tokenizer_dir) -> None:
    """Rows of dp rank 1 of 2 = its documents, each as BOS tokens EOS, end to end, epoch after epoch."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    texts = list(DocumentSource(paths=corpus[0], dp_rank=1, dp_size=2).texts(0))
    docs = [framed(tokenizer, t) for t in texts] * 2  # two epochs, same order without shuffling
    tokens = [t for d in docs for t in d]
    labels = [d[j + 1] if j + 1 < len(d) else IGNORE_INDEX for d in docs for j in range(len(d))]
    positions = [j for d in docs for j in range(len(d))]
    seq_len, batch_size = 96, 2
    steps = len(tokens) // (seq_len * batch_size)
    batches = list(
        islice(make_loader(corpus, tokenizer_dir, seq_len=seq_len, batch_size=batch_size, dp_rank=1, dp_size=2), steps)
    )
    n = steps * seq_len * batch_size
    assert torch.cat([b["input_ids"].flatten() for b in batches]).tolist() == tokens[:n]
    assert torch.cat([b["labels"].flatten() for b in batches]).tolist() == labels[:n]
    assert torch.cat([b["position_ids"].flatten() for b in batches]).tolist() == positions[:n]
    for b in batches:
        assert b["input_ids"].shape == (batch_size, seq_len) and b["input_ids"].dtype == torch.int64
        for row_positions, cu in zip(b["position_ids"], b["cu_seqlens"]):
            starts = (row_positions[1:] == 0).nonzero().flatten() + 1
            assert cu.dtype == torch.int32 and cu.tolist() == [0, *starts.tolist(), seq_len]


# ------------------------------------------------------------------------------------- context parallelism


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring_size,ulysses_size", [(1, 2), (2, 1), (2, 2), (4, 1)])
def test_cp_shards_reassemble_the_rows(corpus, tokenizer_dir, ring_size, ulysses_size, layout) -> None:
    settings = dict(seq_len=64, batch_size=2, shuffle_buffer=4, layout=layout)
    steps = 3
    full = list(islice(make_loader(corpus, tokenizer_dir, **settings), steps))
    sizes = dict(ring_size=ring_size, ulysses_size=ulysses_size)
    shards = [  # ring-major, as unshard_sequence expects
        list(islice(make_loader(corpus, tokenizer_dir, ring_rank=r, ulysses_rank=u, **sizes, **settings), steps))
        for r in range(ring_size)
        for u in range(ulysses_size)
    ]
    local = 64 // (ring_size * ulysses_size)
    for step in range(steps):
        for key in ("input_ids", "labels", "position_ids"):
            parts = [rank[step][key] for rank in shards]
            assert all(p.shape == (2, local) for p in parts)
            rebuilt = unshard_sequence(parts, dim=1, ring_size=ring_size, ulysses_size=ulysses_size, layout=layout)
            assert torch.equal(rebuilt, full[step][key])
        for rank in shards:  # cu_seqlens stay global
            assert [c.tolist() for c in rank[step]["cu_seqlens"]] == [c.tolist() for c in full[step]["cu_seqlens"]]


# ---------------------------------------------------------------------------------- embedded default corpus


def test_default_corpus_and_tokenizer(tokenizer_dir, monkeypatch) -> None:
    monkeypatch.setenv("LCTRAIN_CACHE", str(tokenizer_dir.parents[1]))  # the session's trained tokenizer
    loader = PackedLoader(DataConfig(seq_len=256, batch_size=1), place=SequencePlace(ring_size=2, ulysses_size=2))
    assert Path(loader.tokenizer.name_or_path) == tokenizer_dir
    assert len(loader.tokenizer) == 8192
    assert loader.tokenizer.convert_ids_to_tokens(
        [loader.tokenizer.bos_token_id, loader.tokenizer.eos_token_id, loader.tokenizer.pad_token_id]
    ) == ["<|bos|>", "<|eos|>", "<|pad|>"]
    first = next(t["text"] for t in read_text_files(stdlib_files()) if t["text"])  # sorted: the first file
    tokens = loader.tokenizer.encode(first, add_special_tokens=False)
    batch = next(iter(loader))
    # Ring rank 0, Ulysses rank 0 of zigzag R=2, U=2 holds chunk 0 of 4: the first 64 tokens of the row, which
    # all belong to the first file (it is longer than that).
    assert batch["input_ids"].shape == (1, 64) and len(tokens) > 64
    assert batch["input_ids"][0].tolist() == [loader.tokenizer.bos_token_id, *tokens][:64]
    assert batch["position_ids"][0].tolist() == list(range(64))
    assert loader.tokenizer.decode(tokens) == first  # byte-level BPE round-trips source text


def test_default_tokenizer_is_deterministic(tokenizer_dir, tmp_path) -> None:
    again = default_tokenizer_dir(tmp_path)
    assert again != tokenizer_dir
    assert (again / "tokenizer.json").read_text() == (tokenizer_dir / "tokenizer.json").read_text()


# --------------------------------------------------------------------------------------------- bad inputs


def test_missing_files_empty_data_bad_fields_and_lengths_name_the_setting(corpus, tokenizer_dir, tmp_path) -> None:
    tok = str(tokenizer_dir)
    with pytest.raises(FileNotFoundError, match="paths: no such file"):
        PackedLoader(DataConfig(paths=[str(tmp_path / "missing.jsonl")], tokenizer=tok))
    with pytest.raises(FileNotFoundError, match="paths: the glob .* matches no files"):
        PackedLoader(DataConfig(paths=[str(tmp_path / "*.parquet")], tokenizer=tok))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="the dataset has no documents"):
        PackedLoader(DataConfig(paths=[str(tmp_path / "empty.jsonl")], tokenizer=tok))
    with pytest.raises(ValueError, match=r"text_field='content' .* available fields: \['id', 'meta', 'text'\]"):
        PackedLoader(DataConfig(paths=corpus[0], text_field="content", tokenizer=tok))
    with pytest.raises(FileNotFoundError, match="tokenizer: the directory .*nowhere.* does not exist"):
        PackedLoader(DataConfig(paths=corpus[0], tokenizer=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"seq_len=100 is not divisible by 8 .* multiple of 8, e.g. 96"):
        PackedLoader(
            DataConfig(paths=corpus[0], seq_len=100, tokenizer=tok), place=SequencePlace(ring_size=2, ulysses_size=2)
        )
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "lonely"}) + "\n")
    loader = PackedLoader(DataConfig(paths=[str(tmp_path / "one.jsonl")], tokenizer=tok), dp_rank=1, dp_size=2)
    with pytest.raises(ValueError, match="dp rank 1 of 2 received no documents"):
        next(iter(loader))


# ------------------------------------------------------------------------------------------- exact resume

_RESUME = """
import json, sys, torch
from lctrain.attention import SequencePlace
from lctrain.data import DataConfig, PackedLoader
out = []
for case in json.load(open(sys.argv[1])):
    loader = PackedLoader(DataConfig(**case["config"]), **case["dp"], place=SequencePlace(**case["place"]))
    loader.load_state_dict(case["state"])
    batches = iter(loader)
    out.append([next(batches) for _ in range(case["steps"])])
torch.save(out, sys.argv[2])
"""


def test_resume_in_a_new_process_is_exact(corpus, tokenizer_dir, tmp_path) -> None:
    cases = [  # shuffled, dp rank 1 of 2, zigzag ring 2 x ulysses 2, saved in epoch 1 inside a document
        (
            {"seq_len": 64, "batch_size": 2, "shuffle_buffer": 8, "seed": 7},
            {"dp_rank": 1, "dp_size": 2},
            {"ring_rank": 1, "ring_size": 2, "ulysses_rank": 1, "ulysses_size": 2},
        ),
        (
            {"seq_len": 48, "batch_size": 1, "shuffle_buffer": 8, "seed": 7, "truncate": True},
            {"dp_rank": 0, "dp_size": 3},
            {},
        ),
    ]
    after, jobs, expected = 3, [], []
    for config, dp, place in cases:
        config = {**config, "paths": corpus[0], "tokenizer": str(tokenizer_dir)}
        loader = PackedLoader(DataConfig(**config), **dp, place=SequencePlace(**place))
        batches = iter(loader)
        for _ in range(200):  # run until the save point: in epoch 1, inside a document (unless truncating)
            next(batches)
            state = loader.state_dict()
            if state["epoch"] == 1 and state["document"] >= 2 and (state["offset"] > 0 or config.get("truncate")):
                break
        else:
            pytest.fail(f"no save point found for {config}")
        expected.append([next(batches) for _ in range(after)])
        jobs.append({"config": config, "dp": dp, "place": place, "state": state, "steps": after})
    assert jobs[0]["state"]["offset"] > 0  # a document spans the row boundary at the save point
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    path = os.pathsep.join([str(Path(lctrain.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    subprocess.run(
        [sys.executable, "-c", _RESUME, str(tmp_path / "jobs.json"), str(tmp_path / "out.pt")],
        check=True,
        env=env,
        timeout=120,
    )
    resumed = torch.load(tmp_path / "out.pt")
    for want_batches, got_batches in zip(expected, resumed):
        for want, got in zip(want_batches, got_batches):
            for key in ("input_ids", "labels", "position_ids"):
                assert torch.equal(got[key], want[key]), key
            assert [c.tolist() for c in got["cu_seqlens"]] == [c.tolist() for c in want["cu_seqlens"]]
