"""The small, deterministic jsonl corpora (text, chat, preference pairs) of the end-to-end training tests, the data
tests and the planner check (``benchmarks/validate_planner.py``).

The embedded default corpus tokenizes up to 64 standard-library files (megabytes of text) on every rank before the
first batch: seconds of CPU per rank and launch. These documents are excerpts of one standard-library file: mostly
short ones (a few to ~30 tokens, so a row packs several documents of varied lengths) and one in five longer than a
short row (continued in the next one). They tokenize in milliseconds with the default tokenizer.
"""

from __future__ import annotations

import json
import random
import textwrap
from collections.abc import Callable
from pathlib import Path


def write_corpus(
    path: Path, documents: int = 200, *, long_fraction: float = 0.2, short: tuple = (1, 100), long: tuple = (250, 800)
) -> Path:
    """Write ``documents`` jsonl records ``{"text": ...}`` to ``path``: a ``long_fraction`` of them ``long`` characters
    long, the others ``short`` (inclusive ranges); returns ``path``."""
    text = Path(textwrap.__file__).read_text()
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(documents):
            length = rng.randint(*long) if rng.random() < long_fraction else rng.randint(*short)
            start = rng.randrange(len(text) - length)
            piece = text[start : start + length]
            f.write(json.dumps({"text": piece if piece.strip() else "x"}) + "\n")
    return path


def corpus_overrides(path: Path) -> list[str]:
    """Hydra overrides that train on the corpus at ``path`` (with the default tokenizer)."""
    return [f"data.paths=['{path}']"]


def excerpts(rng: random.Random) -> Callable[[int, int], str]:
    """``excerpt(low, high)``: a stripped excerpt of one standard-library file, ``low`` to ``high`` characters long
    (``"x"`` for a blank one), drawn with ``rng``."""
    text = Path(textwrap.__file__).read_text()

    def excerpt(low: int, high: int) -> str:
        length = rng.randint(low, high)
        start = rng.randrange(len(text) - length)
        return text[start : start + length].strip() or "x"

    return excerpt


def write_chat_corpus(path: Path, conversations: int = 120, *, seed: int = 1) -> Path:
    """Write ``conversations`` jsonl chat records (``{"messages": [...]}``) made of excerpts of one standard-library
    file to ``path``; returns ``path``. One in four opens with a system prompt; they have one or two user / assistant
    exchanges of a few to ~15 tokens a turn, so a 64-token row packs one to three of them and some are longer than
    such a row (dropped). The first one's user turn is ~30 tokens and its answer short, and the next two are longer
    than the rest of a 64-token row: the first row's first and last quarters hold only tokens without loss (its ring
    rank 0 of 2 has no trained token). One in ten has no assistant turn (nothing to train: skipped). ``seed`` picks
    the excerpts."""
    rng = random.Random(seed)
    excerpt = excerpts(rng)

    records = [[{"role": "user", "content": excerpt(110, 120)}, {"role": "assistant", "content": excerpt(10, 15)}]]
    records += [
        [{"role": "user", "content": excerpt(60, 70)}, {"role": "assistant", "content": excerpt(60, 70)}]
        for _ in range(2)
    ]
    while len(records) < conversations:
        messages = [{"role": "system", "content": excerpt(5, 20)}] if rng.random() < 0.25 else []
        answered = rng.random() > 0.1
        for _ in range(rng.choice([1, 1, 2])):
            messages.append({"role": "user", "content": excerpt(3, 25)})
            if answered:
                messages.append({"role": "assistant", "content": excerpt(3, 40)})
        records.append(messages)
    with path.open("w") as f:
        for messages in records:
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_pair_corpus(path: Path, pairs: int = 60, *, seed: int = 2) -> Path:
    """Write ``pairs`` jsonl preference records made of excerpts of one standard-library file to ``path``, in turn
    in TRL's three forms: strings (``prompt``, ``chosen``, ``rejected``), conversational (lists of messages, one in
    four prompts opening with a system prompt) and implicit-prompt (two whole conversations sharing their first
    messages). Prompts of ~3 to ~40 tokens and answers of ~1 to ~15, so a 64-token row packs one to three pairs and
    one in ten is longer than such a row (dropped). Returns ``path``."""
    rng = random.Random(seed)
    excerpt = excerpts(rng)

    with path.open("w") as f:
        for index in range(pairs):
            long = rng.random() < 0.1
            prompt, chosen, rejected = excerpt(150, 200) if long else excerpt(10, 120), excerpt(3, 40), excerpt(3, 40)
            while rejected == chosen:
                rejected = excerpt(3, 40)
            if index % 3 == 0:
                record = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            else:
                messages = [{"role": "system", "content": excerpt(5, 20)}] if rng.random() < 0.25 else []
                messages.append({"role": "user", "content": prompt})
                answers = [[{"role": "assistant", "content": answer}] for answer in (chosen, rejected)]
                if index % 3 == 1:
                    record = {"prompt": messages, "chosen": answers[0], "rejected": answers[1]}
                else:
                    record = {"chosen": messages + answers[0], "rejected": messages + answers[1]}
            f.write(json.dumps(record) + "\n")
    return path


# A chat template that drops the reasoning of the assistant turns before the last user message (as Qwen3's does):
# every multi-turn conversation with reasoning is rendered once per earlier turn (lctrain.data.chat_turns).
REASONING_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' and '</think>' in m['content'] and loop.index0 < ns.last_user -%}"
    "{{- m['content'].split('</think>')[-1].lstrip('\\n') -}}"
    "{%- else -%}{{- m['content'] -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


# Gemma 3's chat format, written for these tests (the published template also takes list contents and checks that
# the roles alternate): the system prompt at the start of the first user turn, the assistant's role written `model`.
GEMMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}"
    "{{- (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)
GEMMA3_TOKENS = ["<start_of_turn>", "<end_of_turn>"]

# gpt-oss's harmony format, written for these tests (the published template also writes the date, the reasoning
# effort and tool definitions into its messages): a system message always first; a first message of the system or
# developer role as the developer's instructions; each message `<|start|>` role `<|message|>` text `<|end|>`. An
# answer is its reasoning (the message's `thinking`) on the analysis channel, then its content on the final channel:
# only the conversation's last message, when the assistant's and without a generation prompt (a training example),
# keeps the reasoning and ends with `<|return|>`; earlier answers are their final channel, ended by `<|end|>`. A tool
# call (`tool_calls`, one a message) keeps its reasoning until an answer follows it, and ends with `<|call|>`; a tool
# message answers the last call. The generation prompt is `<|start|>assistant`.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: low<|end|>' -}}"
    "{%- set ns = namespace(call='') -%}"
    "{%- set rest = messages -%}"
    "{%- if messages[0]['role'] in ['system', 'developer'] -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0]['content'] + '<|end|>' -}}"
    "{%- set rest = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for m in rest -%}"
    "{%- set analysis = '<|start|>assistant<|channel|>analysis<|message|>' + (m['thinking'] or '') + '<|end|>' -%}"
    "{%- if m['role'] == 'user' -%}{{- '<|start|>user<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>' -}}"
    "{{- m['content'] + '<|end|>' -}}"
    "{%- elif m['tool_calls'] is defined -%}"
    "{%- set ns.call = m['tool_calls'][0]['function']['name'] -%}"
    "{%- set answers = rest[loop.index:] | selectattr('role', 'eq', 'assistant') -%}"
    "{%- set answers = answers | rejectattr('tool_calls', 'defined') | list -%}"
    "{%- if m['thinking'] is defined and not answers -%}{{- analysis -}}{%- endif -%}"
    "{{- '<|start|>assistant to=functions.' + ns.call + '<|channel|>commentary json<|message|>' -}}"
    "{{- m['tool_calls'][0]['function']['arguments'] + '<|call|>' -}}"
    "{%- elif loop.last and not add_generation_prompt -%}"
    "{%- if m['thinking'] is defined -%}{{- analysis -}}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|return|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m['content'] + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"]


def write_reasoning_chats(path: Path, conversations: int = 40, *, seed: int = 4, thinking: bool = False) -> Path:
    """Write ``conversations`` jsonl chat records of one to three user / assistant exchanges, each answer with its
    reasoning (``<think>\\n...\\n</think>\\n\\n`` before it; with ``thinking``, in the message's ``thinking`` field,
    where gpt-oss's templates read it), a few tokens a turn, to ``path``; returns ``path``. Through
    ``REASONING_TEMPLATE`` a conversation of k exchanges is k documents of at most ~60 tokens; the first has two."""
    text = Path(textwrap.__file__).read_text()
    rng = random.Random(seed)

    def excerpt() -> str:
        start = rng.randrange(len(text) - 12)
        return text[start : start + rng.randint(3, 12)].strip() or "x"

    with path.open("w") as f:
        for index in range(conversations):
            messages = []
            for _ in range(2 if index == 0 else rng.randint(1, 3)):
                messages.append({"role": "user", "content": excerpt()})
                why, answer = excerpt(), excerpt()
                if thinking:
                    messages.append({"role": "assistant", "content": answer, "thinking": why})
                else:
                    messages.append({"role": "assistant", "content": f"<think>\n{why}\n</think>\n\n{answer}"})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path
