"""A tiny Llama trained, in the test, on the multiple-choice format of the ``choice`` task, and the records it is
trained and scored on.

A record (LongBench v2's fields) hides its answer in the context: "so the key is C and" among filler words, the
only place a letter follows a space (the choices list writes "(C)"), so one attention head that finds that token and
maps it to the letter answers it. Trained with plain PyTorch on the letter's loss only (120 steps of 16 examples),
the model answers every record of up to 90 filler words (60 in training); an untrained one is at chance (0.25).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from lctrain.data import load_tokenizer
from lctrain.ruler.choice import LETTERS, choice_example

FILLER = "the here we go and back again is of to in it on at by for with as from that this be or".split()
STEPS, BATCH, WORDS = 120, 16, 60


def choice_record(rng: random.Random, words: int, needle_within: int | None = None) -> dict[str, str]:
    """A record whose context is ``words`` filler words with the needle among the first ``needle_within`` (all)."""
    letter = rng.choice(LETTERS)
    filler = [rng.choice(FILLER) for _ in range(words)]
    at = rng.randrange(min(words, needle_within or words) + 1)
    context = "Text: " + " ".join([*filler[:at], f"so the key is {letter} and", *filler[at:]])
    choices = {f"choice_{x}": name for x, name in zip(LETTERS, ("alpha", "beta", "gamma", "delta"))}
    return {"context": context, "question": "Which is the key?", **choices, "answer": letter}


def write_choices(path: Path, seed: int, count: int, words: tuple[int, int], needle_within: int) -> list[dict]:
    """``count`` records of ``words`` (low, high) filler words as a jsonl file."""
    rng = random.Random(seed)
    records = [choice_record(rng, rng.randint(*words), needle_within) for _ in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def choice_text(tokenizer: PreTrainedTokenizerBase, record: dict[str, str]) -> str:
    """A record rendered as the task renders it, followed by its answer: a training or validation document."""
    example = choice_example(tokenizer, record, 1024, 0, chat=False)
    return tokenizer.decode(example.input_ids[example.start + 1 :]) + ")"  # without BOS: documents get their own


def train_choice_model(directory: Path) -> None:
    """The model, trained on the letter after the prompt (``STEPS`` steps, seeded), saved with ``save_pretrained``
    with the embedded tokenizer."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer(None)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(0)
    for _ in range(STEPS):
        examples = [choice_example(tokenizer, choice_record(rng, WORDS), 512, 0, chat=False) for _ in range(BATCH)]
        ids = torch.stack([e.input_ids[e.start :] for e in examples])  # the same length: one-token filler words
        letters = torch.tensor([e.choices[e.correct_choice] for e in examples])
        logits = model(input_ids=ids[:, :-1], logits_to_keep=1).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, letters)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
