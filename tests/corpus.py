"""A small, deterministic jsonl corpus for end-to-end training tests.

The embedded default corpus tokenizes up to 64 standard-library files (megabytes of text) on every rank before the
first batch: seconds of CPU per rank and launch. These documents are short (1-40 lines of code-like words, so rows
pack several documents of varied lengths) and tokenize in milliseconds with the default tokenizer.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "def return self import class for in if else while with as lambda yield value index count total result items "
    "data path name model step loss batch shard rank ring heads tokens = ( ) : , . + - * [ ] 0 1 2"
).split()


def write_corpus(path: Path, documents: int = 300, seed: int = 0) -> Path:
    """Write ``documents`` jsonl records ``{"text": ...}`` to ``path``; returns ``path``."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(documents):
            lines = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(rng.randint(1, 40))]
            f.write(json.dumps({"text": "\n".join(lines)}) + "\n")
    return path


def corpus_overrides(path: Path) -> list[str]:
    """Hydra overrides that train on the corpus at ``path`` (with the default tokenizer)."""
    return [f"data.paths=['{path}']"]
