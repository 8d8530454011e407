"""The suite's examples (``lctrain.ruler``) scored on the job's mesh without generation, by teacher forcing.

Greedy decoding writes the answer exactly when, at every answer position, the argmax of the model's distribution
given the prompt and the answer tokens before it is the answer's next token, which is what one teacher-forced forward
computes at every answer position at once. So each example's ``match`` is greedy decoding's exact match (ties of
the argmax aside), and the answer's log-probability is read from the same forward.

Examples of one length are packed into rows, each a document of its own (its positions from 0, attending only to
itself, so it is scored exactly as alone; fewer, longer forwards cost less than many short ones). A row
(``[1, S_local]``: this rank's part of it, cut by the rank's ``SequencePlace`` as training rows are) goes through the
model's forward ending in ``answer_head`` (``lctrain.train.forward``: the whole model, or a forward-only pipeline
schedule whose last stage runs the head), which computes logits in fp32 at the answer positions this rank holds
only. Per answer token: whether the argmax is the answer token, its log-probability and the argmax token; for a
multiple-choice example the log-probabilities of the four letters at the answer. These are summed over every rank:
context-parallel ranks hold disjoint answer positions, dp ranks disjoint rows (``dp_turns``: row i of a length on dp
rank i mod dp), and pipeline stages before the last contribute zeros. So the scores do not depend on the mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.attention import SequencePlace
from lctrain.data import IGNORE_INDEX
from lctrain.ruler.example import Example
from lctrain.train.forward import Batch, RowsForward
from lctrain.train.validate import dp_turns

ROW_FIELDS = ("labels", "answer_index", "choices")
CHOICES = 4


def packed_row(examples: Sequence[Example], slots: int, width: int, place: SequencePlace) -> Batch:
    """Examples of one length, each a document of its own (its positions from 0, its attention its own), in one row
    of ``slots`` examples (a padding document for the missing ones), as one row of a micro-batch: this rank's part of
    ``input_ids``, ``position_ids``, ``labels`` and ``answer_index`` (``slot * width + i`` at the position that
    predicts answer token i, -1 elsewhere), ``[1, S_local]``; the global document bounds; the multiple-choice
    letters' tokens ``[1, slots * 4]`` (-1 for the other tasks)."""
    length = examples[0].length
    answer_index = torch.full((slots * length,), -1, dtype=torch.int64)
    choices = torch.full((slots, CHOICES), -1, dtype=torch.int64)
    bounds = [0]
    for slot, example in enumerate(examples):
        start = slot * length + example.answer_start - 1
        answer_index[start : (slot + 1) * length - 1] = slot * width + torch.arange(length - example.answer_start)
        if example.choices:
            choices[slot] = torch.tensor(example.choices)
        bounds += (example.cu_seqlens[1:] + slot * length).tolist()
    missing = (slots - len(examples)) * length
    pad = [torch.zeros(missing, dtype=torch.int64)]
    ids = torch.cat([e.input_ids for e in examples] + pad)[None]
    positions = torch.cat([e.position_ids for e in examples] + [torch.arange(missing)])[None]
    labels = torch.cat([e.labels for e in examples] + [torch.full((missing,), IGNORE_INDEX)])[None]
    return {
        "input_ids": place.shard(ids, dim=1),
        "position_ids": place.shard(positions, dim=1),
        "labels": place.shard(labels, dim=1),
        "answer_index": place.shard(answer_index[None], dim=1),
        "cu_seqlens": [torch.tensor(bounds + ([slots * length] if missing else []), dtype=torch.int32)],
        "choices": choices.reshape(1, -1),
    }


def answer_head(width: int) -> Callable[[Tensor, Tensor, dict[str, Any]], Tensor]:
    """The head of a scoring forward: from a row's final hidden states ``[1, S_local, H]`` and the LM head's weight
    ``[V, H]``, float64 ``[slots * (3 * width + 4)]``: per example (slot) and answer index (``width`` at most)
    whether the argmax is the answer token, its log-probability and the argmax token, where this rank holds that
    answer position (0 elsewhere); then the log-probabilities of the four choice letters at the first answer position
    (multiple choice only)."""

    def head(hidden: Tensor, weight: Tensor, row: dict[str, Any]) -> Tensor:
        choices = row["choices"].reshape(-1, CHOICES).to(hidden.device)  # [slots, 4]
        index = row["answer_index"].reshape(-1)
        where = index >= 0  # the answer positions this rank holds (often none)
        logprobs = torch.log_softmax(hidden[0, where].float() @ weight.float().t(), dim=-1)  # [answers here, V]
        targets = row["labels"].reshape(-1)[where]
        argmax = logprobs.argmax(dim=-1)
        slot, answer = index[where] // width, index[where] % width
        out = torch.zeros(len(choices), 3, width, dtype=torch.float64, device=hidden.device)
        out[slot, 0, answer] = (argmax == targets).double()
        out[slot, 1, answer] = logprobs.gather(1, targets[:, None]).squeeze(1).double()
        out[slot, 2, answer] = argmax.double()
        letters = torch.zeros(len(choices), CHOICES, dtype=torch.float64, device=hidden.device)
        first = (answer == 0) & (choices[slot, 0] >= 0)  # a multiple-choice example's letter, if held here
        letters[slot[first]] = logprobs[first].gather(1, choices[slot[first]]).double()
        return torch.cat([out.reshape(len(choices), -1), letters], dim=1).reshape(-1)

    return head


@torch.no_grad()
def score_examples(
    examples: Sequence[Example],
    forward: RowsForward,
    *,
    pack_tokens: int,
    rows_per_run: int,
    place: SequencePlace,
    dp_rank: int,
    dp: int,
    device: torch.device,
    tokenizer: PreTrainedTokenizerBase,
) -> list[dict[str, Any]]:
    """Every example scored (module docstring): one record each, the same on every rank. Examples of one length L
    go ``pack_tokens // L`` (at least one) to a row; ``forward`` runs the rows ``rows_per_run`` at a time (a
    pipeline's micro-batches)."""
    width = max(e.length - e.answer_start for e in examples)
    head, per_example = answer_head(width), 3 * width + CHOICES
    sums = torch.zeros(len(examples), per_example, dtype=torch.float64, device=device)
    for length in dict.fromkeys(e.length for e in examples):
        indices = [i for i, e in enumerate(examples) if e.length == length]
        slots = max(1, pack_tokens // length)
        rows = [indices[i : i + slots] for i in range(0, len(indices), slots)]
        turns = list(dp_turns(len(rows), dp_rank, dp))  # every dp rank the same number of rows
        turns += [(0, False)] * (-len(turns) % rows_per_run)
        for start in range(0, len(turns), rows_per_run):
            run = turns[start : start + rows_per_run]
            batches = [packed_row([examples[i] for i in rows[k]], slots, width, place) for k, _ in run]
            outputs = forward(batches, ROW_FIELDS, head)
            if outputs is None:  # a pipeline stage before the last
                continue
            for output, (k, keep) in zip(outputs, run):
                if keep:
                    sums[rows[k]] = output.view(slots, per_example)[: len(rows[k])]
    dist.all_reduce(sums)  # cp ranks: disjoint answer positions; dp ranks: disjoint rows; pp: the last stage's
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
