"""The suite of a job: every example of ``ruler.tasks`` at each length (and each depth, for the needle tasks), made
before any process group exists, in the order task, length, depth, index; and its checks."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from lctrain.config.ruler import NEEDLE_TASKS, RulerConfig
from lctrain.parallel.dims import ParallelDims
from lctrain.ruler.choice import choice_example, read_choices
from lctrain.ruler.example import Example
from lctrain.ruler.tasks import TaskMaker


def check_suite(
    ruler: RulerConfig,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int],
    dims: ParallelDims,
    max_positions: int | None,
) -> None:
    """Each length cut whole over the context-parallel ranks and within the model's positions; the multiple-choice
    file readable with its fields; one example of each generated task made at the shortest length (a length too
    short for a task is refused here). ``RulerConfig`` checks its own settings."""
    for length in lengths:
        dims.check_sequence_length(length, setting="ruler.lengths")
        if max_positions is not None and length > max_positions:
            raise ValueError(
                f"ruler.lengths: {length} tokens is beyond the model's {max_positions} positions "
                f"(max_position_embeddings); give shorter lengths, or extend the model (model.rope_scaling, "
                f"model.max_position_embeddings)"
            )
    if ruler.choice_path is not None:
        read_choices(ruler.choice_path)
    maker = task_maker(ruler, tokenizer, lengths)
    for task in ruler.tasks:
        if task != "choice":
            maker.make(task, min(lengths), ruler.depths[0] if task in NEEDLE_TASKS else None, 0)


def task_maker(ruler: RulerConfig, tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int]) -> TaskMaker:
    return TaskMaker(
        tokenizer,
        seed=ruler.seed,
        haystack=ruler.haystack,
        corpus_paths=tuple(ruler.corpus_paths),
        corpus_tokens=max(lengths),
        chat=ruler.chat,
    )


def build_suite(ruler: RulerConfig, tokenizer: PreTrainedTokenizerBase, lengths: Sequence[int]) -> list[Example]:
    """Every example of the suite (module docstring)."""
    maker = task_maker(ruler, tokenizer, lengths)
    records = read_choices(ruler.choice_path) if ruler.choice_path is not None else []
    examples = []
    for task in ruler.tasks:
        for length in lengths:
            if task == "choice":
                examples += [choice_example(tokenizer, r, length, i, chat=ruler.chat) for i, r in enumerate(records)]
                continue
            for depth in ruler.depths if task in NEEDLE_TASKS else [None]:
                examples += [maker.make(task, length, depth, index) for index in range(ruler.samples)]
    return examples
