"""The ``choice`` task: a user's multiple-choice file in LongBench v2's fields (``context``, ``question``,
``choice_A`` ... ``choice_D``, ``answer`` one of A-D; ``_id`` kept when present), as jsonl or one json array, scored
by the answer letter's probability against the other letters'.

Each record is rendered with LongBench v2's prompt, ending in "The correct answer is (" so the next token is the
letter. At a length L, a record longer than L has its context cut in the middle (LongBench v2's truncation: the first
and last halves of the context's tokens are kept) to exactly L tokens; a shorter one is preceded by a padding document
of its own (line breaks, positions from 0 again) to L tokens, so the record is scored exactly as alone.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from lctrain.ruler.example import Example, make_example
from lctrain.ruler.prompt import Frame, encode, frame

LETTERS = ("A", "B", "C", "D")
FIELDS = ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer")
INSTRUCTION = "Please read the following text and answer the question below.\n\n<text>"
QUESTION = (
    "</text>\n\nWhat is the correct answer to this question: {question}\nChoices:\n(A) {choice_A}\n(B) {choice_B}\n"
    '(C) {choice_C}\n(D) {choice_D}\n\nFormat your response as follows: "The correct answer is (insert answer here)".'
)
ANSWER_PREFIX = "The correct answer is ("


def read_choices(path: str) -> list[dict[str, Any]]:
    """The records of ``ruler.choice_path``, each checked for LongBench v2's fields."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"ruler.choice_path: no such file {path!r}")
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json" and text.lstrip().startswith("["):
        records = list(enumerate(json.loads(text), start=1))
        where = "record"
    else:
        records = [(n, json.loads(line)) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
        where = "line"
    for number, record in records:
        missing = [name for name in FIELDS if not isinstance(record, dict) or not isinstance(record.get(name), str)]
        if missing:
            raise ValueError(
                f"ruler.choice_path: {path} {where} {number} lacks the field(s) {', '.join(missing)}: each record "
                f"needs {', '.join(FIELDS)} (LongBench v2's)"
            )
        if record["answer"] not in LETTERS:
            raise ValueError(f"ruler.choice_path: {path} {where} {number} has answer={record['answer']!r}; give A-D")
    if not records:
        raise ValueError(f"ruler.choice_path: {path} holds no record")
    return [record for _, record in records]


@functools.lru_cache(maxsize=16)
def letter_frames(tokenizer: PreTrainedTokenizerBase, question: str, chat: bool) -> tuple[Frame, ...]:
    """The frame of a record's prompt with each letter as the answer (kept: every length of a record uses them)."""
    frames = tuple(
        frame(
            tokenizer,
            instruction=INSTRUCTION,
            question=question,
            answer_prefix=ANSWER_PREFIX,
            parts=[x],
            lead="",
            chat=chat,
        )
        for x in LETTERS
    )
    if any(len(f.answer) != 1 or f.tail != frames[0].tail for f in frames):
        raise ValueError(
            "ruler.tasks: choice needs each answer letter to be one token after the prompt's tokens, and this "
            "tokenizer merges a letter with the text before it; leave choice out of ruler.tasks"
        )
    return frames


def choice_example(
    tokenizer: PreTrainedTokenizerBase, record: dict[str, Any], length: int, index: int, *, chat: bool
) -> Example:
    """Record ``index`` as an example of exactly ``length`` tokens (module docstring)."""
    letter = record["answer"]
    frames = letter_frames(tokenizer, QUESTION.format(**record), chat)
    frame_ = frames[LETTERS.index(letter)]
    choices = tuple(f.answer[0] for f in frames)
    context = encode(tokenizer, record["context"])
    room = length - frame_.fixed
    if room < 2:
        raise ValueError(f"ruler.lengths: {length} tokens cannot hold the question of choice record {index}")
    if len(context) > room:
        context = context[: room // 2] + context[len(context) - (room - room // 2) :]
    pad = room - len(context)
    ids = encode(tokenizer, "\n")[-1:] * pad + frame_.head + context + frame_.tail + frame_.answer
    return make_example(
        "choice",
        length,
        None,
        index,
        frame_,
        ids,
        letter,
        start=pad,
        choices=choices,
        correct_choice=LETTERS.index(letter),
    )
