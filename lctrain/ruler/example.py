"""One example of the suite, and how a context is filled to an exact length.

An example is ``length`` tokens: ``head`` + context + ``tail`` + ``answer`` (``lctrain.ruler.prompt.Frame``), the
answer ending it. A context is a haystack of whole units (sentences, or list entries) with inserts (needles, variable
assignments) placed at unit boundaries, filled to ``length - frame.fixed - inserts`` tokens: as many whole units as
fit (W tokens), then the few tokens left (fewer than one unit) as line breaks before the question. An insert asked at
depth d goes at the boundary nearest to ``d · W`` (0 = right after the instruction, 1 = after the last unit).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lctrain.data import IGNORE_INDEX
from lctrain.ruler.prompt import Frame


def example_rng(seed: int, *names: object) -> random.Random:
    """A generator seeded by ``seed`` and ``names`` (task, length, depth, index) alone: the same example on any mesh,
    in any order."""
    digest = hashlib.sha256(":".join(map(repr, (seed, *names))).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


@dataclass(frozen=True)
class Example:
    """One example; token indices are positions in ``input_ids``."""

    task: str
    length: int
    depth: float | None  # the needle tasks' requested depth; None for the others
    index: int  # the example's number in its cell (task, length[, depth])
    input_ids: Tensor  # [length] int64
    answer_start: int  # the first answer token; the answer runs to the end
    parts: tuple[tuple[int, int], ...]  # each answer part's tokens, [start, stop) counted from answer_start
    answer: str  # the answer's text
    start: int = 0  # tokens before it are a padding document of their own (a short multiple-choice record)
    needle_depth: float | None = None  # where the first asked needle landed: haystack tokens before it / W
    needle_span: tuple[int, int] | None = None  # that needle's tokens [start, stop)
    choices: tuple[int, ...] = ()  # choice: the tokens of the letters A, B, C, D at the answer
    correct_choice: int = -1  # choice: the answer's index in ``choices``

    @property
    def answer_ids(self) -> Tensor:
        return self.input_ids[self.answer_start :]

    @property
    def labels(self) -> Tensor:
        """``[length]``: answer token i at position ``answer_start + i - 1`` (shifted), IGNORE_INDEX elsewhere."""
        labels = torch.full_like(self.input_ids, IGNORE_INDEX)
        labels[self.answer_start - 1 : self.length - 1] = self.input_ids[self.answer_start :]
        return labels

    @property
    def cu_seqlens(self) -> Tensor:
        """The documents' bounds: the example, after its padding document if it has one."""
        bounds = [0, self.start, self.length] if self.start else [0, self.length]
        return torch.tensor(bounds, dtype=torch.int32)

    @property
    def position_ids(self) -> Tensor:
        """``[length]``: positions from 0 in each document."""
        return torch.cat([torch.arange(self.start), torch.arange(self.length - self.start)])


@dataclass(frozen=True)
class Filled:
    ids: list[int]  # the whole example
    insert_starts: list[int]  # each insert's first token in ``ids``
    insert_depths: list[float]  # where each insert landed: haystack tokens before it / W
    haystack_tokens: int  # W


def fill(
    length: int,
    frame: Frame,
    units: Iterator[list[int]],
    inserts: Sequence[tuple[float, list[int]]],
    line_break: int,
    *,
    task: str,
    setting: str = "ruler.lengths",
) -> Filled:
    """``frame``'s head, the context (``units`` taken whole in order, each of ``inserts`` (depth, tokens) at its
    boundary), line breaks, the tail and the answer: exactly ``length`` tokens (module docstring)."""
    budget = length - frame.fixed - sum(len(tokens) for _, tokens in inserts)
    if budget < 0:
        raise ValueError(
            f"{setting}: {length} tokens is too short for the task {task}: its fixed parts take "
            f"{length - budget} tokens; give longer lengths"
        )
    haystack: list[int] = []
    bounds = [0]
    for unit in units:
        if len(haystack) + len(unit) > budget:
            break
        haystack += unit
        bounds.append(len(haystack))
    width = len(haystack)
    at = [min(bounds, key=lambda b: (abs(b - depth * width), b)) for depth, _ in inserts]
    # in the order of their depths (at one boundary too), so the text's order of the inserts is known beforehand
    order = sorted(range(len(inserts)), key=lambda i: (at[i], inserts[i][0], i))
    ids, starts, previous = list(frame.head), [0] * len(inserts), 0
    for i in order:
        ids += haystack[previous : at[i]]
        starts[i], previous = len(ids), at[i]
        ids += inserts[i][1]
    ids += haystack[previous:] + [line_break] * (budget - width) + frame.tail + frame.answer
    assert len(ids) == length, (len(ids), length)
    depths = [b / width if width else depth for b, (depth, _) in zip(at, inserts)]
    return Filled(ids, starts, depths, width)


def make_example(
    task: str, length: int, depth: float | None, index: int, frame: Frame, ids: list[int], answer: str, **fields
) -> Example:
    """An ``Example`` of ``ids`` whose last tokens are ``frame``'s answer."""
    return Example(
        task=task,
        length=length,
        depth=depth,
        index=index,
        input_ids=torch.tensor(ids, dtype=torch.int64),
        answer_start=length - len(frame.answer),
        parts=frame.parts,
        answer=answer,
        **fields,
    )
