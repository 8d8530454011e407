"""Passkey retrieval ("needle in a haystack") samples of an exact token length, generated locally from a seed.

A sample is, as tokens:

    [BOS] intro | filler before | needle | filler after | question | answer

- intro: "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize
  it. I will quiz you about it."
- filler: the sentences of ``FILLER`` repeated in order ("The grass is green. The sky is blue. ...").
- needle: "The pass key is 68231. Remember it. 68231 is the pass key." (the key: ``digits`` random digits).
- question: "What is the pass key? The pass key is", then the answer " 68231" ends the sample.

Length. Every piece is tokenized on its own (each starts with a space, so byte-level BPE splits there anyway) and
the token lists are concatenated. The filler budget is ``F = length - (BOS + intro + needle + question + answer)``
tokens: as many whole filler sentences as fit (W tokens), then ``F - W`` line-break tokens (fewer than one
sentence) before the question, so the sample is exactly ``length`` tokens. The needle goes at the sentence boundary
nearest to ``depth · W`` (0 = right after the intro, 1 = after the last filler sentence); ``needle_depth`` records
where it landed (filler tokens before it / W).

Answer. Tokenizers merge digits in various ways (the embedded BPE gives " 68231" -> " 6" "8" "231"; Llama 3 splits
groups of three), so the answer is never tokenized alone: the question and the question followed by the answer are
tokenized, and the answer tokens are the tokens of the second after their longest common prefix. They start at the
first token that covers an answer character, whatever the merges. ``labels`` hold each answer token at the
position before it (labels are shifted, as in ``lctrain.data.packing``) and -100 everywhere else.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.data import IGNORE_INDEX

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it."
)
FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeySample:
    """One sample; token indices are positions in ``input_ids``."""

    input_ids: Tensor  # [length] int64, starting with BOS
    labels: Tensor  # [length] int64: answer token i at position answer_start + i - 1, IGNORE_INDEX elsewhere
    key: str  # the pass key (digits)
    answer_start: int  # the first answer token; the answer runs to the end of the sample
    needle_start: int  # the first and one-past-last token of the needle
    needle_end: int
    needle_depth: float  # where the needle landed: filler tokens before it / filler_tokens
    filler_tokens: int  # tokens of the whole filler sentences (W; the line breaks before the question excluded)

    @property
    def answer_ids(self) -> Tensor:
        return self.input_ids[self.answer_start :]


def sample_key(seed: int, length: int, depth: float, index: int, digits: int) -> str:
    """The pass key of sample ``index`` of the cell (length, depth): it depends on nothing else (not on the mesh
    or the order of evaluation). The first digit is not 0."""
    digest = hashlib.sha256(f"{seed}:{length}:{depth!r}:{index}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "little"))
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_tokens(tokenizer: PreTrainedTokenizerBase, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt tokens, answer tokens) of ``question + answer`` tokenized as one text: the answer tokens are those
    after the longest common prefix with the tokens of ``question`` alone (module docstring)."""
    full = _encode(tokenizer, question + answer)
    alone = _encode(tokenizer, question)
    common = 0
    while common < min(len(full), len(alone)) and full[common] == alone[common]:
        common += 1
    if common == len(full) or answer.strip() not in tokenizer.decode(full[common:]):
        raise ValueError(
            f"cannot locate the answer {answer!r} in the tokens of {question + answer!r}: {full} (question alone: "
            f"{alone})"
        )
    return full[:common], full[common:]


def passkey_sample(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, key: str) -> PasskeySample:
    """A sample of exactly ``length`` tokens with ``key`` at ``depth`` (module docstring)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (the fraction of the filler before the needle)")
    intro = _encode(tokenizer, INTRO)
    needle = _encode(tokenizer, " " + NEEDLE.format(key=key))
    question, answer = answer_tokens(tokenizer, " " + QUESTION, " " + key)
    fixed = 1 + len(intro) + len(needle) + len(question) + len(answer)
    budget = length - fixed
    if budget < 0:
        raise ValueError(f"length={length} is too short for a passkey sample: it needs at least {fixed} tokens")
    sentences = [_encode(tokenizer, " " + sentence) for sentence in FILLER]

    # whole filler sentences, in order, as many as fit in the budget; `bounds` are the sentence boundaries
    filler: list[int] = []
    bounds = [0]
    while True:
        sentence = sentences[(len(bounds) - 1) % len(sentences)]
        if len(filler) + len(sentence) > budget:
            break
        filler += sentence
        bounds.append(len(filler))
    before = min(bounds, key=lambda b: (abs(b - depth * len(filler)), b))
    # the few tokens left (fewer than a sentence) are line breaks before the question
    padding = _encode(tokenizer, "\n")[-1:] * (budget - len(filler))
    ids = [tokenizer.bos_token_id, *intro, *filler[:before], *needle, *filler[before:], *padding, *question, *answer]
    assert len(ids) == length, (len(ids), length)
    input_ids = torch.tensor(ids, dtype=torch.int64)
    answer_start = length - len(answer)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[answer_start - 1 : length - 1] = input_ids[answer_start:]
    needle_start = 1 + len(intro) + before
    return PasskeySample(
        input_ids=input_ids,
        labels=labels,
        key=key,
        answer_start=answer_start,
        needle_start=needle_start,
        needle_end=needle_start + len(needle),
        needle_depth=before / len(filler) if filler else depth,
        filler_tokens=len(filler),
    )


def passkey_text(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, key: str) -> str:
    """The text of a sample (without BOS), e.g. a training document; re-tokenized it has about ``length`` tokens."""
    return tokenizer.decode(passkey_sample(tokenizer, length, depth, key).input_ids[1:])
