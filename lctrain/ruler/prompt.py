"""The fixed parts of an example as tokens: what comes before the context (BOS, the chat template's opening, the
task's instruction) and after it (the question, the template's closing and the answer's opening words), and the answer.

Every piece is tokenized on its own and the token lists are concatenated, so the context between them can be filled
to an exact length. The answer is never tokenized alone (tokenizers merge digits and spaces across the boundary): the
text before it and the same text followed by the answer are tokenized, and the answer tokens are those after their
longest common prefix (``answer_tokens``). An answer of several parts (several values or words) says which answer
tokens each part's characters fall in (the tokenizer's offsets), so each part can be scored on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

CONTEXT_MARK = "\x00CONTEXT\x00"  # where the context goes in the rendered chat template


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The tokens of ``text`` without special tokens added."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_many(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[list[int]]:
    """The tokens of each of ``texts`` (one batched call)."""
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []


def answer_tokens(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt tokens, answer tokens) of ``prompt + answer`` tokenized as one text: the answer tokens are those after
    the longest common prefix with the tokens of ``prompt`` alone (the module docstring)."""
    prompt_ids, answer_ids, _ = _split(tokenizer, prompt, answer)
    return prompt_ids, answer_ids


def _split(tokenizer: PreTrainedTokenizerBase, prompt: str, answer: str) -> tuple[list[int], list[int], list]:
    """``answer_tokens`` and the character span of each answer token in ``prompt + answer``."""
    full = tokenizer(prompt + answer, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = full["input_ids"], full["offset_mapping"]
    alone = encode(tokenizer, prompt)
    common = 0
    while common < min(len(ids), len(alone)) and ids[common] == alone[common]:
        common += 1
    if common == len(ids) or answer.strip() not in tokenizer.decode(ids[common:]):
        raise ValueError(
            f"cannot locate the answer {answer!r} in the tokens of {prompt + answer!r}: {ids} (without the answer: "
            f"{alone})"
        )
    return ids[:common], ids[common:], offsets[common:]


@dataclass(frozen=True)
class Frame:
    """An example's fixed tokens around its context: ``head`` + context + ``tail`` + ``answer``."""

    head: list[int]  # BOS (unless the template writes it), the template's opening, the instruction
    tail: list[int]  # the question, the template's closing and generation prompt, the answer's opening words
    answer: list[int]  # the answer tokens, which end the example
    parts: tuple[tuple[int, int], ...]  # each answer part's tokens: [start, stop) within ``answer``

    @property
    def fixed(self) -> int:
        return len(self.head) + len(self.tail) + len(self.answer)


def frame(
    tokenizer: PreTrainedTokenizerBase,
    *,
    instruction: str,
    question: str,
    answer_prefix: str,
    parts: Sequence[str],
    separator: str = ", ",
    lead: str = " ",
    chat: bool = False,
) -> Frame:
    """The frame of a prompt ``instruction`` (context) ``question`` whose answer ``answer_prefix`` is followed by
    ``lead`` and ``part1, part2, ...`` (``separator`` between the parts). With ``chat`` the instruction, context and
    question are the user's message rendered by the tokenizer's chat template with the generation prompt, and the
    answer's opening words start the assistant's reply."""
    answer = lead + separator.join(parts)
    if chat:
        if not tokenizer.chat_template:
            raise ValueError("ruler.chat=true: the tokenizer has no chat template; set ruler.chat=false (a base model)")
        content = f"{instruction}\n{CONTEXT_MARK}\n{question}"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        opening, closing = rendered.split(CONTEXT_MARK)
        tail_text = closing + answer_prefix
    else:
        opening, tail_text = instruction + "\n", f"\n{question} {answer_prefix}"
    head = encode(tokenizer, opening)
    if not (tokenizer.bos_token and opening.startswith(tokenizer.bos_token)):
        head = [tokenizer.bos_token_id, *head]
    tail, answer_ids, offsets = _split(tokenizer, tail_text, answer)
    spans, start = [], len(tail_text) + len(lead)
    for part in parts:  # each part's tokens: those whose characters overlap the part's
        stop = start + len(part)
        tokens = [i for i, (a, b) in enumerate(offsets) if a < stop and b > start]
        spans.append((tokens[0], tokens[-1] + 1))
        start = stop + len(separator)
    return Frame(head, tail, answer_ids, tuple(spans))
