"""The small, deterministic jsonl corpus of the end-to-end training tests.

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
