"""The generated tasks, RULER's formats: each function makes one example of exactly ``length`` tokens from its own
seeded generator (``example_rng``), so an example depends on (seed, task, length, depth, index) alone.

- ``niah_single``: one needle "One of the special magic numbers for {key} is: {value}." (a 7-digit value) at the
  requested depth; the answer is its value.
- ``niah_multikey``: ``NEEDLES`` needles of distinct keys, the asked one at the depth, the others at drawn depths.
- ``niah_multivalue``: ``NEEDLES`` needles of one key, the first at the depth; the answer is every value, in the
  order of the text.
- ``niah_multiquery``: ``NEEDLES`` needles of distinct keys, all asked, the first at the depth; the values in the
  order asked.
- ``vt`` (variable tracking): a chain "VAR A = 12345." "VAR B = VAR A." ... of ``VT_VARIABLES`` assignments at
  drawn depths in the noise; the answer is every variable of the chain, in order.
- ``cwe`` (common words): a numbered list where ``CWE_WORDS`` words appear ``f`` times each and the others
  ``max(1, f // 10)`` times (f = 30 for long lists, fewer for short ones, as in RULER); the answer is the common
  words in the order they first appear.
- ``fwe`` (frequent words): coded words drawn with Zipf frequencies (word r appears ``floor(C / r**2)`` times,
  shuffled); the answer is the three most frequent, most frequent first.

An answer of several parts is scored part by part (``lctrain.ruler.prompt``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

from transformers import PreTrainedTokenizerBase

from lctrain.ruler.example import Example, example_rng, fill, make_example
from lctrain.ruler.haystack import NOISE, corpus_units, pseudo_words, units
from lctrain.ruler.prompt import Frame, encode, encode_many, frame

NEEDLES = 4
VT_VARIABLES = 5
CWE_WORDS = 10
FWE_WORDS = 3

NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. I will quiz you about "
    "the numbers afterwards."
)
NEEDLE = " One of the special magic numbers for {key} is: {value}."


@dataclass
class TaskMaker:
    """Makes the examples of every task with one tokenizer; the haystacks are tokenized once."""

    tokenizer: PreTrainedTokenizerBase
    seed: int
    haystack: str = "noise"  # the needle tasks': noise or corpus
    corpus_paths: tuple[str, ...] = ()
    corpus_tokens: int = 0  # the longest context the corpus must fill
    chat: bool = False

    @cached_property
    def line_break(self) -> int:
        return encode(self.tokenizer, "\n")[-1]

    @cached_property
    def noise(self) -> list[list[int]]:
        return [encode(self.tokenizer, " " + sentence) for sentence in NOISE]

    @cached_property
    def corpus(self) -> list[list[int]]:
        return corpus_units(self.tokenizer, self.corpus_paths, self.corpus_tokens)

    def frame(self, instruction: str, question: str, answer_prefix: str, parts: list[str], sep: str = ", ") -> Frame:
        return frame(
            self.tokenizer,
            instruction=instruction,
            question=question,
            answer_prefix=answer_prefix,
            parts=parts,
            separator=sep,
            chat=self.chat,
        )

    def make(self, task: str, length: int, depth: float | None, index: int) -> Example:
        """Example ``index`` of the cell (task, length, depth)."""
        rng = example_rng(self.seed, task, length, depth, index)
        if task.startswith("niah_"):
            return self.niah(task, length, depth, index, rng)
        return getattr(self, task)(length, index, rng)

    def niah(self, task: str, length: int, depth: float, index: int, rng: random.Random) -> Example:
        count = 1 if task == "niah_single" else NEEDLES
        words = pseudo_words(rng, 2 * count)  # distinct keys
        keys = [f"{words[2 * i]}-{words[2 * i + 1]}" for i in range(count)]
        if task == "niah_multivalue":
            keys = keys[:1] * count
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(count)]
        depths = [depth] + [rng.random() for _ in range(count - 1)]
        needles = [(d, encode(self.tokenizer, NEEDLE.format(key=k, value=v))) for d, k, v in zip(depths, keys, values)]
        if task == "niah_multiquery":
            asked = " and ".join([", ".join(keys[:-1]), keys[-1]])
            answer = values
        elif task == "niah_multivalue":
            asked = keys[0]
            answer = [values[i] for i in sorted(range(count), key=lambda i: (depths[i], i))]  # the text's order
        else:
            asked, answer = keys[0], values[:1]
        if len(answer) > 1:
            question = f"What are all the special magic numbers for {asked} mentioned in the provided text?"
            prefix = f"The special magic numbers for {asked} mentioned in the provided text are"
        else:
            question = f"What is the special magic number for {asked} mentioned in the provided text?"
            prefix = f"The special magic number for {asked} mentioned in the provided text is"
        frame_ = self.frame(NIAH_INSTRUCTION, question, prefix, answer)
        haystack = units(self.noise, None) if self.haystack == "noise" else units(self.corpus, rng)
        filled = fill(length, frame_, haystack, needles, self.line_break, task=task)
        start = filled.insert_starts[0]
        return make_example(
            task, length, depth, index, frame_, filled.ids, ", ".join(answer),
            needle_depth=filled.insert_depths[0], needle_span=(start, start + len(needles[0][1])),
        )  # fmt: skip

    def vt(self, length: int, index: int, rng: random.Random) -> Example:
        variables: dict[str, None] = {}  # distinct names, in the order drawn
        while len(variables) < VT_VARIABLES:
            variables["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))] = None
        names = list(variables)
        value = str(rng.randint(10_000, 99_999))
        statements = [f" VAR {names[0]} = {value}."] + [
            f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, VT_VARIABLES)
        ]
        depths = sorted(rng.random() for _ in statements)
        frame_ = self.frame(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.",
            f"Question: Find all variables that are assigned the value {value} in the text above.",
            f"Answer: According to the chain(s) of variable assignment in the text above, {VT_VARIABLES} variables "
            f"are assigned the value {value}, they are:",
            names,
            sep=" ",
        )
        inserts = [(d, encode(self.tokenizer, s)) for d, s in zip(depths, statements)]
        filled = fill(length, frame_, units(self.noise, None), inserts, self.line_break, task="vt")
        return make_example("vt", length, None, index, frame_, filled.ids, " ".join(names))

    def cwe(self, length: int, index: int, rng: random.Random) -> Example:
        words = pseudo_words(rng, length // 2 + CWE_WORDS)  # more than a list of this length holds
        common, others = words[:CWE_WORDS], words[CWE_WORDS:]
        # the answer's tokens depend a little on the order of the words (merges at the separators): room for that
        budget = length - self.frame(*_cwe_text(), common).fixed - 8
        word_tokens = dict(zip(words, map(len, encode_many(self.tokenizer, [" " + w for w in words]))))
        numbers = encode_many(self.tokenizer, [f"\n{i}." for i in range(1, length)])
        number_tokens = list(map(len, numbers))

        def list_tokens(frequency: int, count: int) -> int:
            rare = max(1, frequency // 10)
            listed = number_tokens[: CWE_WORDS * frequency + rare * count]
            return (
                sum(listed)
                + sum(word_tokens[w] for w in common) * frequency
                + sum(word_tokens[w] for w in others[:count]) * rare
            )

        frequency = 30  # RULER's; fewer when the list is short, so that other words fill at least half of it
        while frequency > 2 and list_tokens(frequency, CWE_WORDS * frequency // max(1, frequency // 10)) > budget:
            frequency -= 1
        if list_tokens(frequency, 1) > budget:
            raise ValueError(f"ruler.lengths: {length} tokens is too short for the task cwe; give longer lengths")
        low, high = 1, len(others)  # the most other words that fit
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if list_tokens(frequency, middle) <= budget else (low, middle - 1)
        entries = common * frequency + others[:low] * max(1, frequency // 10)
        rng.shuffle(entries)
        order = list(dict.fromkeys(w for w in entries if w in common))
        frame_ = self.frame(*_cwe_text(), order)
        spelled = dict(
            zip(common + others[:low], encode_many(self.tokenizer, [" " + w for w in common + others[:low]]))
        )
        listed = [number + spelled[w] for number, w in zip(numbers, entries)]
        filled = fill(length, frame_, iter(listed), [], self.line_break, task="cwe")
        assert filled.haystack_tokens == sum(map(len, listed)), "the whole list fits"
        return make_example("cwe", length, None, index, frame_, filled.ids, ", ".join(order))

    def fwe(self, length: int, index: int, rng: random.Random) -> Example:
        words = pseudo_words(rng, int(length**0.5) + 2)
        frame_ = self.frame(*_fwe_text(), words[:FWE_WORDS])
        budget = length - frame_.fixed
        spelled = encode_many(self.tokenizer, [" " + w for w in words])
        sizes = list(map(len, spelled))

        def counts(top: int) -> list[int]:  # Zipf: word r appears top // r**2 times
            return [top // r**2 for r in range(1, int(top**0.5) + 1)]

        top = 9  # the least that gives the three most frequent words distinct counts (9, 2, 1)
        if sum(c * s for c, s in zip(counts(top), sizes)) > budget:
            raise ValueError(f"ruler.lengths: {length} tokens is too short for the task fwe; give longer lengths")
        while sum(c * s for c, s in zip(counts(top + 1), sizes)) <= budget:
            top += 1
        text = [w for w, c in zip(words, counts(top)) for _ in range(c)]
        rng.shuffle(text)
        filled = fill(length, frame_, (dict(zip(words, spelled))[w] for w in text), [], self.line_break, task="fwe")
        assert filled.haystack_tokens == sum(c * s for c, s in zip(counts(top), sizes)), "every word fits"
        return make_example("fwe", length, None, index, frame_, filled.ids, ", ".join(words[:FWE_WORDS]))


def _cwe_text() -> tuple[str, str, str]:
    return (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
        "that appear most often.",
        f"Question: What are the {CWE_WORDS} most common words in the above list, in the order they first appear?",
        f"Answer: The top {CWE_WORDS} words that appear most often in the list are:",
    )


def _fwe_text() -> tuple[str, str, str]:
    return (
        "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
        "appeared coded words.",
        "Question: What are the three most frequently appeared words in the above coded text, the most frequent first?",
        "Answer: According to the coded text above, the three most frequently appeared words are:",
    )
