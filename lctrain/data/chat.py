"""Conversations -> token ids and the trained-token mask, through the tokenizer's chat template.

A chat record is ``{"messages": [{"role", "content"}, ...]}`` (roles ``system``, ``user``, ``assistant``, ``tool``;
content a string; other keys of a message reach the template as they are), or a ``{"prompt", "completion"}`` pair
as TRL takes it: two lists of messages (the prompt's turns are context only, the completion's are trained) or two
strings (plain text, no template: ``[BOS] prompt completion [EOS]``, the completion and EOS trained).

Which tokens are trained (``data.train_on``): ``assistant`` (every assistant turn), ``last_assistant`` (the last
one) or ``all``. An assistant turn's trained tokens are its content and the end-of-turn tokens the template writes
after it; everything else gets no loss. They are found from the template itself, never by searching the rendered
text for the message (the same sentence may appear in several turns):

- a template that marks the assistant's tokens with ``{% generation %}`` ... ``{% endgeneration %}`` (the embedded
  tokenizer's does): ``apply_chat_template(..., return_assistant_tokens_mask=True)``, whose mask is one run of
  tokens per assistant turn;
- any other template (Llama 3, Qwen, Mistral ship none): the conversation is rendered once whole and once per
  prefix around each trained turn; turn k's characters run from the end of ``messages[:k]`` rendered with the
  generation prompt (the assistant header) to the end of ``messages[:k + 1]``, trailing whitespace left out
  (ChatML's newline after ``<|im_end|>``). The whole conversation is tokenized once, and those character ranges
  become token ranges through the offsets: the cost grows with the conversation's length, not turns x length.

A token is trained when its characters overlap a trained range (as ``return_assistant_tokens_mask`` decides), and
``trained[i]`` of a ``Document`` says whether token i is a target. Errors name the record (``file:line``) and the
fix, on one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from lctrain.data.config import TRAIN_ON
from lctrain.data.packing import Document

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")
_FORMAT_HELP = (
    'give each record "messages": [{"role": ..., "content": ...}, ...] or a "prompt" and a "completion" (docs/data.md)'
)


def is_chat_record(record: Any) -> bool:
    """Whether a record is a conversation: it has ``messages``, or ``prompt`` and ``completion``."""
    return isinstance(record, dict) and ("messages" in record or ("prompt" in record and "completion" in record))


@dataclass(frozen=True)
class Conversation:
    """A checked chat record: ``messages`` with the index of the first turn that may be trained (``trained_from``),
    or, for a plain-text pair, ``prompt`` and ``completion``; ``where`` names the record."""

    where: str
    messages: list[dict[str, Any]] | None = None
    trained_from: int = 0
    prompt: str | None = None
    completion: str | None = None


def _messages(value: Any, where: str, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {name!r} is not a non-empty list of messages; {_FORMAT_HELP}")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {name}[{index}] is a {type(message).__name__}, not a message; {_FORMAT_HELP}")
        missing = [key for key in ("role", "content") if message.get(key) is None]
        if missing:
            raise ValueError(
                f"{where}: {name}[{index}] has no {' or '.join(map(repr, missing))}; every message needs a role "
                f"({', '.join(ROLES)}) and a string content"
            )
        if message["role"] not in ROLES:
            raise ValueError(
                f"{where}: {name}[{index}] has the role {message['role']!r}; use one of {', '.join(ROLES)}"
            )
        if not isinstance(message["content"], str):
            raise ValueError(
                f"{where}: {name}[{index}]'s content is a {type(message['content']).__name__}, not a string; "
                f"lctrain trains on text: give the content as one string"
            )
    return value


def parse_conversation(line: str | dict[str, Any], where: str) -> Conversation:
    """A chat record (its JSON text, or the decoded object) checked and normalised; ``ValueError`` naming
    ``where`` and the fix otherwise."""
    if isinstance(line, str):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg}); write one JSON object per line") from None
    else:
        record = line
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the record is a {type(record).__name__}, not an object; {_FORMAT_HELP}")
    if "messages" in record:
        return Conversation(where, messages=_messages(record["messages"], where, "messages"))
    if "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return Conversation(where, prompt=prompt, completion=completion)
        if isinstance(prompt, list) and isinstance(completion, list):
            prompt = _messages(prompt, where, "prompt")
            return Conversation(
                where, messages=prompt + _messages(completion, where, "completion"), trained_from=len(prompt)
            )
        raise ValueError(
            f"{where}: 'prompt' and 'completion' are a {type(prompt).__name__} and a {type(completion).__name__}; "
            f"give two strings (plain text) or two lists of messages"
        )
    raise ValueError(
        f"{where}: the record has neither 'messages' nor 'prompt'/'completion' (its fields: {sorted(record)}); "
        f"{_FORMAT_HELP}"
    )


def has_generation_marks(template: str) -> bool:
    """Whether a chat template marks the assistant's tokens with ``{% generation %}``."""
    return _GENERATION.search(template) is not None


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Which tokens overlap one of the character ``spans`` ``[a, b)``: offsets ``[n, 2]`` (each token's character
    start and end, in order) -> ``[n]`` bool."""
    mask = np.zeros(len(offsets), dtype=bool)
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        first = np.searchsorted(ends, a, side="right")  # the first token ending after a
        stop = np.searchsorted(starts, b, side="left")  # the first token starting at or after b
        mask[first:stop] = True
    return mask


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` runs of ones in a 0/1 list."""
    flags = np.asarray(mask, dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


class ChatEncoder:
    """Conversations of one source -> ``Document`` s (tokens, trained mask, ``source``, never split across rows).

    ``template``: the chat template text (``data.chat_template``'s file), None = the tokenizer's own; a tokenizer
    without one and no template is an error, raised here (before any process group, where the trainer checks the
    data)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        template: str | None = None,
        train_on: str = "assistant",
        source: int = 0,
    ):
        if train_on not in TRAIN_ON:
            raise ValueError(f"data.train_on={train_on!r} must be one of {', '.join(TRAIN_ON)}")
        # how errors name the template: the file of data.chat_template, or the tokenizer's own
        self.template_name = "data.chat_template" if template else f"{tokenizer.name_or_path}'s template"
        template = template or tokenizer.chat_template
        if not template:
            raise ValueError(
                f"the tokenizer {tokenizer.name_or_path!r} has no chat template: set data.chat_template to a Jinja "
                f"template file (docs/data.md)"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.source = source
        self.marked = has_generation_marks(template)

    def _render(self, conversation: Conversation, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # jinja2's errors, and whatever a template raises (raise_exception)
            raise ValueError(
                f"{conversation.where}: the chat template ({self.template_name}) raised "
                f"{type(error).__name__}: {error}; fix the record or the template"
            ) from None

    def _trained_turns(self, conversation: Conversation) -> list[int]:
        messages = conversation.messages
        turns = [k for k in range(conversation.trained_from, len(messages)) if messages[k]["role"] == "assistant"]
        return turns[-1:] if self.train_on == "last_assistant" else turns

    def _marked(self, conversation: Conversation) -> Document:
        """Through ``return_assistant_tokens_mask``: one render and one tokenization."""
        try:
            out = self.tokenizer.apply_chat_template(
                conversation.messages,
                chat_template=self.template,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
        except Exception as error:
            raise ValueError(
                f"{conversation.where}: the chat template ({self.template_name}) raised "
                f"{type(error).__name__}: {error}; fix the record or the template"
            ) from None
        ids, mask = out["input_ids"], out["assistant_masks"]
        if self.train_on == "all":
            return self._document(ids, np.ones(len(ids), dtype=bool))
        assistant = [k for k, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        turns = self._trained_turns(conversation)
        if turns == assistant:
            return self._document(ids, np.asarray(mask, dtype=bool))
        runs = _runs(mask)
        if len(runs) != len(assistant):
            raise ValueError(
                f"{conversation.where}: the chat template's {{% generation %}} blocks mark {len(runs)} spans for "
                f"{len(assistant)} assistant turns; mark each assistant turn once ({self.template_name})"
            )
        spans = [runs[assistant.index(k)] for k in turns]
        trained = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            trained[a:b] = True
        return self._document(ids, trained)

    def _prefix_spans(self, conversation: Conversation) -> tuple[str, list[tuple[int, int]] | None]:
        """The rendered conversation and the character spans of its trained turns (None = every token)."""
        messages = conversation.messages
        full = self._render(conversation, messages, False)
        if self.train_on == "all":
            return full, None
        spans = []
        for k in self._trained_turns(conversation):
            start = len(self._prefix(conversation, full, messages[:k], True)) if k else 0
            end = len(self._prefix(conversation, full, messages[: k + 1], False))
            while end > start and full[end - 1].isspace():
                end -= 1
            spans.append((start, end))
        return full, spans

    def _prefix(self, conversation: Conversation, full: str, messages: list, generation_prompt: bool) -> str:
        rendered = self._render(conversation, messages, generation_prompt)
        if not full.startswith(rendered):
            raise ValueError(
                f"{conversation.where}: the chat template renders the first {len(messages)} messages"
                f"{' with the generation prompt' if generation_prompt else ''} differently from the start of the "
                f"whole conversation, so the assistant's tokens cannot be found by prefixes; use a template that "
                f"marks them with {{% generation %}} (data.chat_template)"
            )
        return rendered

    def encode(self, conversations: Sequence[Conversation]) -> list[Document]:
        """One ``Document`` per conversation (its ``trained`` mask may be all False: the caller skips it). The
        texts rendered here are tokenized in one call."""
        documents: list[Document | None] = [None] * len(conversations)
        texts, pending = [], []  # the texts to tokenize; (index, trained spans, framed by BOS/EOS) of each
        for index, conversation in enumerate(conversations):
            if conversation.messages is None:  # a plain-text prompt/completion pair
                text = conversation.prompt + conversation.completion
                spans = None if self.train_on == "all" else [(len(conversation.prompt), len(text))]
                texts.append(text)
                pending.append((index, spans, True))
            elif self.marked:
                documents[index] = self._marked(conversation)
            else:
                text, spans = self._prefix_spans(conversation)
                texts.append(text)
                pending.append((index, spans, False))
        if texts:
            encoded = self.tokenizer(
                texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False
            )
            for (index, spans, framed), ids, offsets in zip(pending, encoded["input_ids"], encoded["offset_mapping"]):
                offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
                trained = np.ones(len(ids), dtype=bool) if spans is None else token_mask(offsets, spans)
                if framed:  # [BOS] prompt completion [EOS]: the EOS ends the completion
                    ids = [self.tokenizer.bos_token_id, *ids, self.tokenizer.eos_token_id]
                    trained = np.concatenate([[False], trained, [True]])
                documents[index] = self._document(ids, trained)
        return documents

    def _document(self, ids: Sequence[int], trained: np.ndarray) -> Document:
        trained = torch.from_numpy(np.ascontiguousarray(trained, dtype=bool))
        trained[:1] = False  # nothing predicts the first token
        return Document(torch.tensor(ids, dtype=torch.int64), trained, source=self.source, splittable=False)
