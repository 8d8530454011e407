"""The suite's examples (``lctrain.ruler``) scored on the job's mesh without generation: one forward per example.

Greedy decoding writes the answer exactly when, at every answer position, the argmax of the model's distribution
given the prompt and the answer tokens before it is the answer's next token, which is what one teacher-forced forward
computes at every answer position at once. So each example's ``match`` is greedy decoding's exact match (ties of
the argmax aside), and the answer's log-probability is read from the same forward.

Each example is one row (``[1, S_local]``: this rank's part of it, cut by the rank's ``SequencePlace`` as training
rows are) through the model's forward ending in ``answer_head`` (``lctrain.train.forward``: the whole model, or a
forward-only pipeline schedule whose last stage runs the head), which computes logits in fp32 at the answer
positions this rank holds only. Per answer token: whether the argmax is the answer token, its log-probability and the
argmax token; for a multiple-choice example the log-probabilities of the four letters at the answer. The rows are
summed over every rank: context-parallel ranks hold disjoint answer positions, dp ranks disjoint examples (``dp_turns``:
example i of a length on dp rank i mod dp), and pipeline stages before the last contribute zeros. So the scores do not
depend on the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.attention import SequencePlace
from lctrain.ruler.example import Example
from lctrain.train.forward import Batch, RowsForward
from lctrain.train.validate import dp_turns

ROW_FIELDS = ("labels", "answer_index", "choices")
CHOICES = 4


def example_row(example: Example, place: SequencePlace) -> Batch:
    """``example`` as one row of a micro-batch: this rank's part of ``input_ids``, ``position_ids``, ``labels`` and
    ``answer_index`` (each answer token's index at the position that predicts it, -1 elsewhere), ``[1, S_local]``;
    the global document bounds; the multiple-choice letters' tokens ``[1, 4]`` (-1 for the other tasks)."""
    answer_index = torch.full((example.length,), -1, dtype=torch.int64)
    answer_index[example.answer_start - 1 : example.length - 1] = torch.arange(example.length - example.answer_start)
    choices = torch.tensor(example.choices or (-1,) * CHOICES, dtype=torch.int64)[None]
    return {
        "input_ids": place.shard(example.input_ids[None], dim=1),
        "position_ids": place.shard(example.position_ids[None], dim=1),
        "labels": place.shard(example.labels[None], dim=1),
        "answer_index": place.shard(answer_index[None], dim=1),
        "cu_seqlens": [example.cu_seqlens],
        "choices": choices,
    }


def answer_head(width: int) -> Callable[[Tensor, Tensor, dict[str, Any]], Tensor]:
    """The head of a scoring forward: from a row's final hidden states ``[1, S_local, H]`` and the LM head's weight
    ``[V, H]``, float64 ``[3 * width + 4]``: per answer index (``width`` at most) whether the argmax is the answer
    token, its log-probability and the argmax token, where this rank holds that answer position (0 elsewhere); then
    the log-probabilities of the four choice letters at the first answer position (multiple choice only)."""

    def head(hidden: Tensor, weight: Tensor, row: dict[str, Any]) -> Tensor:
        index = row["answer_index"].reshape(-1)
        where = index >= 0  # the answer positions this rank holds (often none)
        logprobs = torch.log_softmax(hidden[0, where].float() @ weight.float().t(), dim=-1)  # [answers here, V]
        targets = row["labels"].reshape(-1)[where]
        argmax = logprobs.argmax(dim=-1)
        out = torch.zeros(3, width, dtype=torch.float64, device=hidden.device)
        out[0, index[where]] = (argmax == targets).double()
        out[1, index[where]] = logprobs.gather(1, targets[:, None]).squeeze(1).double()
        out[2, index[where]] = argmax.double()
        letters = torch.zeros(CHOICES, dtype=torch.float64, device=hidden.device)
        choices = row["choices"].reshape(-1).to(hidden.device)
        first = index[where] == 0
        if choices[0] >= 0 and bool(first.any()):
            letters = logprobs[first][0, choices].double()
        return torch.cat([out.reshape(-1), letters])

    return head


@torch.no_grad()
def score_examples(
    examples: Sequence[Example],
    forward_for: Callable[[int], RowsForward],
    *,
    rows_per_run: int,
    place: SequencePlace,
    dp_rank: int,
    dp: int,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase,
) -> list[dict[str, Any]]:
    """Every example scored (module docstring): one record each, the same on every rank. ``forward_for(length)`` is
    the forward for rows of that length, run ``rows_per_run`` rows at a time (a pipeline's micro-batches)."""
    width = max(e.length - e.answer_start for e in examples)
    head = answer_head(width)
    sums = torch.zeros(len(examples), 3 * width + CHOICES, dtype=torch.float64, device=device)
    for length in dict.fromkeys(e.length for e in examples):
        indices = [i for i, e in enumerate(examples) if e.length == length]
        turns = list(dp_turns(len(indices), dp_rank, dp))  # every dp rank the same number of rows
        turns += [(0, False)] * (-len(turns) % rows_per_run)
        forward = forward_for(length)
        for start in range(0, len(turns), rows_per_run):
            run = turns[start : start + rows_per_run]
            outputs = forward([example_row(examples[indices[k]], place) for k, _ in run], ROW_FIELDS, head)
            if outputs is None:  # a pipeline stage before the last
                continue
            for row, (k, keep) in enumerate(run):
                if keep:
                    sums[indices[k]] = outputs[row]
    dist.all_reduce(sums)  # cp ranks: disjoint answer positions; dp ranks: disjoint examples; pp: the last stage's
    return [record(example, row, width, tokenizer) for example, row in zip(examples, sums.cpu())]


def record(example: Example, sums: Tensor, width: int, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """One example's scores and everything needed to score it again with another tool."""
    answers = example.length - example.answer_start
    correct, logprobs, predicted = sums[:answers], sums[width : width + answers], sums[2 * width : 2 * width + answers]
    parts = [bool(correct[a:b].all()) for a, b in example.parts]
    result: dict[str, Any] = {
        "task": example.task,
        "length": example.length,
        "depth": example.depth,
        "index": example.index,
        "needle_depth": example.needle_depth,
        "answer": example.answer,
        "predicted": tokenizer.decode(predicted.long()),
        "match": bool(correct.all()),
        "parts_correct": parts,
        "score": sum(parts) / len(parts),
        "logprob": float(logprobs.sum()),
        "prompt_start": example.start,
        "prompt_ids": example.input_ids[: example.answer_start].tolist(),
        "answer_ids": example.answer_ids.tolist(),
        "predicted_ids": predicted.long().tolist(),
    }
    if example.choices:
        letters = sums[3 * width :]
        result["choice_logprobs"] = letters.tolist()
        result["score"] = float(int(letters.argmax()) == example.correct_choice)
    return result
