"""What contexts are made of: haystack units (sentences) and made-up words, all generated locally.

- ``noise``: RULER's repeated sentences ("The grass is green. The sky is blue. ..."), in order.
- ``corpus``: the sentences of a corpus, from a seeded starting sentence on (and around again): the user's files
  (``ruler.corpus_paths``: txt files, or jsonl/json records with a ``text``), or by default the docstrings of the
  Python standard library's public functions (English prose, read with ``ast``, nothing imported or downloaded).
  Sentences longer than ``MAX_WORDS`` words are cut, so the line breaks that complete a context stay few.
- ``pseudo_words``: pronounceable made-up words (keys, list entries, coded words), distinct within an example.
"""

from __future__ import annotations

import glob
import itertools
import json
import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
MAX_WORDS = 40
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvz", "aeiou"


def corpus_texts(paths: Sequence[str]) -> Iterator[str]:
    """The texts of ``ruler.corpus_paths`` (globs allowed), file by file in order; [] = the standard library's
    docstrings."""
    if not paths:
        from lctrain.data.sources import stdlib_files
        from lctrain.data.stdlib_chat import documented_functions

        for path in stdlib_files():
            try:
                yield from (doc for _, _, doc in documented_functions(Path(path).read_text(encoding="utf-8")))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
        return
    for pattern in paths:
        files = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in "*?[") else [pattern]
        if not files or not all(Path(f).is_file() for f in files):
            raise FileNotFoundError(f"ruler.corpus_paths: no such file {pattern!r}")
        for file in files:
            suffix = Path(file).suffix
            if suffix == ".txt":
                yield Path(file).read_text(encoding="utf-8")
            elif suffix in (".jsonl", ".json"):
                text = Path(file).read_text(encoding="utf-8")
                lines = text.splitlines()
                records = json.loads(text) if suffix == ".json" else [json.loads(line) for line in lines if line]
                for number, record in enumerate(records, start=1):
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"ruler.corpus_paths: {file} record {number} has no string field 'text'")
                    yield record["text"]
            else:
                raise ValueError(f"ruler.corpus_paths: {file} is not a .txt, .jsonl or .json file")


def corpus_units(tokenizer: PreTrainedTokenizerBase, paths: Sequence[str], tokens: int) -> list[list[int]]:
    """The corpus's sentences as tokens (each with a leading space), enough for a context of ``tokens`` tokens (the
    whole corpus if it is shorter; contexts then go around it again)."""
    sentences: list[str] = []
    characters = 0
    for text in corpus_texts(paths):
        for sentence in _SENTENCE_END.split(text):
            words = sentence.split()
            for start in range(0, len(words), MAX_WORDS):
                sentences.append(" ".join(words[start : start + MAX_WORDS]))
                characters += len(sentences[-1]) + 1
        if characters > 8 * tokens:  # tokens take 3-5 characters of prose; twice as much as needed
            break
    if not sentences:
        raise ValueError(f"ruler.corpus_paths={list(paths)}: the corpus has no text")
    return tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]


def units(haystack: list[list[int]], rng: random.Random | None) -> Iterator[list[int]]:
    """The haystack's units around and around, from a ``rng``-drawn start (None: the first)."""
    start = rng.randrange(len(haystack)) if rng is not None else 0
    return itertools.islice(itertools.cycle(haystack), start, None)


def pseudo_words(rng: random.Random, count: int, *, avoid: Sequence[str] = ()) -> list[str]:
    """``count`` distinct made-up words of 2 or 3 syllables (consonant, vowel, sometimes a closing consonant)."""
    words: dict[str, None] = {}
    taken = set(avoid)
    while len(words) < count:
        word = "".join(
            rng.choice(_CONSONANTS) + rng.choice(_VOWELS) + (rng.choice(_CONSONANTS) if rng.random() < 0.3 else "")
            for _ in range(rng.randint(2, 3))
        )
        if word not in taken:
            words[word] = None
    return list(words)
