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
tokenized, and the answer tokens are the tokens of the second after their longest common prefix
(``lctrain.ruler.prompt.answer_tokens``). They start at the first token that covers an answer character, whatever
the merges. The filling is ``lctrain.ruler.example.fill``'s, the filler RULER's noise. ``labels`` hold each answer
token at the position before it (labels are shifted, as in ``lctrain.data.packing``) and -100 everywhere else.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.data import IGNORE_INDEX
from lctrain.ruler.example import fill
from lctrain.ruler.haystack import NOISE as FILLER
from lctrain.ruler.haystack import units
from lctrain.ruler.prompt import Frame, answer_tokens, encode

INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it."
)
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


def passkey_sample(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, key: str) -> PasskeySample:
    """A sample of exactly ``length`` tokens with ``key`` at ``depth`` (module docstring)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1] (the fraction of the filler before the needle)")
    intro = encode(tokenizer, INTRO)
    needle = encode(tokenizer, " " + NEEDLE.format(key=key))
    question, answer = answer_tokens(tokenizer, " " + QUESTION, " " + key)
    frame = Frame([tokenizer.bos_token_id, *intro], question, answer, ((0, len(answer)),))
    filler = units([encode(tokenizer, " " + sentence) for sentence in FILLER], None)
    line_break = encode(tokenizer, "\n")[-1]
    filled = fill(length, frame, filler, [(depth, needle)], line_break, task="passkey", setting="eval.lengths")
    input_ids = torch.tensor(filled.ids, dtype=torch.int64)
    answer_start = length - len(answer)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[answer_start - 1 : length - 1] = input_ids[answer_start:]
    needle_start = filled.insert_starts[0]
    return PasskeySample(
        input_ids=input_ids,
        labels=labels,
        key=key,
        answer_start=answer_start,
        needle_start=needle_start,
        needle_end=needle_start + len(needle),
        needle_depth=filled.insert_depths[0],
        filler_tokens=filled.haystack_tokens,
    )


def passkey_text(tokenizer: PreTrainedTokenizerBase, length: int, depth: float, key: str) -> str:
    """The text of a sample (without BOS), e.g. a training document; re-tokenized it has about ``length`` tokens."""
    return tokenizer.decode(passkey_sample(tokenizer, length, depth, key).input_ids[1:])
