"""The small, deterministic jsonl corpora of the end-to-end training tests and of the planner check
(``benchmarks/validate_planner.py``).

The embedded default corpus tokenizes up to 64 standard-library files (megabytes of text) on every rank before the
first batch: seconds of CPU per rank and launch. These documents are excerpts of one standard-library file: mostly
short ones (a few to ~30 tokens, so a row packs several documents of varied lengths) and one in five longer than a
short row (continued in the next one). They tokenize in milliseconds with the default tokenizer.
"""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path


def write_corpus(
    path: Path, documents: int = 200, *, long_fraction: float = 0.2, short: tuple = (1, 100), long: tuple = (250, 800)
) -> Path:
    """Write ``documents`` jsonl records ``{"text": ...}`` to ``path``: a ``long_fraction`` of them ``long`` characters
    long, the others ``short`` (inclusive ranges); returns ``path``."""
    text = Path(textwrap.__file__).read_text()
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(documents):
            length = rng.randint(*long) if rng.random() < long_fraction else rng.randint(*short)
            start = rng.randrange(len(text) - length)
            piece = text[start : start + length]
            f.write(json.dumps({"text": piece if piece.strip() else "x"}) + "\n")
    return path


def corpus_overrides(path: Path) -> list[str]:
    """Hydra overrides that train on the corpus at ``path`` (with the default tokenizer)."""
    return [f"data.paths=['{path}']"]


def write_chat_corpus(path: Path, conversations: int = 120, *, seed: int = 1) -> Path:
    """Write ``conversations`` jsonl chat records (``{"messages": [...]}``) made of excerpts of one standard-library
    file to ``path``; returns ``path``. One in four opens with a system prompt; they have one or two user / assistant
    exchanges of a few to ~15 tokens a turn, so a 64-token row packs one to three of them and some are longer than
    such a row (dropped). The first one's user turn is ~30 tokens and its answer short, and the next two are longer
    than the rest of a 64-token row: the first row's first and last quarters hold only tokens without loss (its ring
    rank 0 of 2 has no trained token). One in ten has no assistant turn (nothing to train: skipped). ``seed`` picks
    the excerpts."""
    text = Path(textwrap.__file__).read_text()
    rng = random.Random(seed)

    def excerpt(low: int, high: int) -> str:
        length = rng.randint(low, high)
        start = rng.randrange(len(text) - length)
        return text[start : start + length].strip() or "x"

    records = [[{"role": "user", "content": excerpt(110, 120)}, {"role": "assistant", "content": excerpt(10, 15)}]]
    records += [
        [{"role": "user", "content": excerpt(60, 70)}, {"role": "assistant", "content": excerpt(60, 70)}]
        for _ in range(2)
    ]
    while len(records) < conversations:
        messages = [{"role": "system", "content": excerpt(5, 20)}] if rng.random() < 0.25 else []
        answered = rng.random() > 0.1
        for _ in range(rng.choice([1, 1, 2])):
            messages.append({"role": "user", "content": excerpt(3, 25)})
            if answered:
                messages.append({"role": "assistant", "content": excerpt(3, 40)})
        records.append(messages)
    with path.open("w") as f:
        for messages in records:
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
