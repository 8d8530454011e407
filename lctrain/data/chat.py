"""Conversations -> token ids and the trained-token mask, through the tokenizer's chat template.

A chat record is ``{"messages": [{"role", "content"}, ...]}`` (roles ``system``, ``developer`` (OpenAI's name for
the system prompt: gpt-oss's template takes either), ``user``, ``assistant``, ``tool``; content a string; other keys
of a message reach the template as they are: ``thinking``, ``tool_calls``, ...), or a ``{"prompt", "completion"}``
pair as TRL takes it: two lists of messages (the prompt's turns are context only, the completion's are trained) or two
strings (plain text, no template: ``[BOS] prompt completion [EOS]``, the completion and EOS trained).

Which tokens are trained (``data.train_on``): ``assistant`` (every assistant turn), ``last_assistant`` (the last
one) or ``all``. A trained turn's tokens are what the model writes at inference after the turn's history rendered
with the generation prompt: its content and the end-of-turn tokens the template writes after it, never the header
the prompt supplies (``lctrain.data.chat_turns`` finds that text from renderings of the conversation's prefixes,
never by searching the rendered text for the message: the same sentence may appear in several turns). When the
whole conversation's rendering holds every trained turn so (most templates), it is the one document, tokenized once,
and each turn's character range becomes a token range through the offsets: the cost grows with the conversation's
length, not turns x length. A template that marks the assistant's tokens with ``{% generation %}`` ...
``{% endgeneration %}`` (the embedded tokenizer's does) has each marked span trimmed to that text (a mark around
the role header leaves the header out). Otherwise the conversation is divergent and becomes one document per
divergent turn (``data.divergent_turns``), and a turn no generation prompt leads to is refused or skipped
(``data.unreachable_turns``).

A token is trained when its characters overlap a trained range (as ``return_assistant_tokens_mask`` decides), and
``trained[i]`` of a ``Document`` says whether token i is a target. Errors name the record (``file:line``) and the
fix, on one line.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lctrain.data.chat_turns import DEFAULT_TURNS, DIVERGENT, TrainedText, TurnSettings, plan_turns
from lctrain.data.config import TRAIN_ON
from lctrain.data.packing import Document

logger = logging.getLogger("lctrain")

ROLES = ("system", "developer", "user", "assistant", "tool")
TOKENIZE_CHARACTERS = 4_000_000  # one tokenizer call: enough to share its threads, bounds its lists' memory
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


def decoded_record(line: str | dict[str, Any], where: str, format_help: str) -> dict[str, Any]:
    """A record's object from its JSON text (or the object itself); ``ValueError`` naming ``where`` and the fix
    (``format_help``: the record's form) when it is not JSON or not an object."""
    if isinstance(line, str):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg}); write one JSON object per line") from None
    else:
        record = line
    if not isinstance(record, dict):
        raise ValueError(f"{where}: the record is a {type(record).__name__}, not an object; {format_help}")
    return record


def parse_conversation(line: str | dict[str, Any], where: str) -> Conversation:
    """A chat record (its JSON text, or the decoded object) checked and normalised; ``ValueError`` naming
    ``where`` and the fix otherwise."""
    record = decoded_record(line, where, _FORMAT_HELP)
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


class ChatEncoder:
    """Conversations of one source -> ``Document`` s (tokens, trained mask, ``source``, never split across rows).

    ``template``: the chat template text (``data.chat_template``'s file), None = the tokenizer's own; a tokenizer
    without one and no template is an error, raised here (before any process group, where the trainer checks the
    data). ``turns``: what to do with divergent conversations and unreachable turns (``lctrain.data.chat_turns``)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        template: str | None = None,
        train_on: str = "assistant",
        turns: TurnSettings = DEFAULT_TURNS,
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
        self.turns = turns
        self.source = source
        self.marked = has_generation_marks(template)
        self._reported_divergent = False

    def _render(
        self, conversation: Conversation, messages: list[dict[str, Any]], generation_prompt: bool, marks: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The text and (``marks``) its ``{% generation %}`` character spans, else []."""
        try:
            texts, runs = render_jinja_template(
                [messages],
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                return_assistant_tokens_mask=marks,
                **self.tokenizer.special_tokens_map,
            )
        except Exception as error:  # jinja2's errors, and whatever a template raises (raise_exception)
            raise ValueError(
                f"{conversation.where}: the chat template ({self.template_name}) raised "
                f"{type(error).__name__}: {error}; fix the record or the template"
            ) from None
        return texts[0], runs[0] if marks else []

    def _trained_turns(self, conversation: Conversation) -> list[int]:
        messages = conversation.messages
        turns = [k for k in range(conversation.trained_from, len(messages)) if messages[k]["role"] == "assistant"]
        return turns[-1:] if self.train_on == "last_assistant" else turns

    def _plan(self, conversation: Conversation) -> list[TrainedText | str]:
        """The texts that train the conversation, with the counts among them (``plan_turns``)."""
        messages = conversation.messages
        if self.train_on == "all":
            return [TrainedText(self._render(conversation, messages, False)[0], None)]
        turns = self._trained_turns(conversation)
        (whole, marked), runs = self._render(conversation, messages, False, marks=self.marked), None
        if self.marked:
            assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
            if len(marked) != len(assistant):
                raise ValueError(
                    f"{conversation.where}: the chat template's {{% generation %}} blocks mark {len(marked)} spans "
                    f"for {len(assistant)} assistant turns; mark each assistant turn once ({self.template_name})"
                )
            runs = [marked[assistant.index(k)] for k in turns]

        def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self._render(conversation, messages, generation_prompt)[0]

        plan = plan_turns(render, messages, turns, self.turns, where=conversation.where, whole=whole, runs=runs)
        if DIVERGENT in plan and not self._reported_divergent:
            logger.info(
                "%s: the whole conversation is not what the model sees at inference for every trained turn; it "
                "becomes %d documents (data.divergent_turns=%s; the count is logged at the end)",
                conversation.where,
                sum(isinstance(part, TrainedText) for part in plan),
                self.turns.divergent,
            )
            self._reported_divergent = True
        return plan

    def encode(self, conversations: Sequence[Conversation]) -> list[Document | list[Document | str]]:
        """One ``Document`` per conversation (its ``trained`` mask may be all False: the caller skips it), or, for a
        divergent one or one with a turn left out, a list of documents and counts (``DIVERGENT``, ``UNREACHABLE``).
        The texts rendered here are tokenized together (``_tokenized``)."""
        plans: list[list[TrainedText | str]] = []
        for conversation in conversations:
            if conversation.messages is not None:
                plans.append(self._plan(conversation))
                continue
            # a plain-text prompt/completion pair: framed by BOS and EOS below, the EOS ends the completion
            text = conversation.prompt + conversation.completion
            spans = None if self.train_on == "all" else ((len(conversation.prompt), len(text)),)
            plans.append([TrainedText(text, spans)])
        tokenized = self._tokenized([part.text for plan in plans for part in plan if isinstance(part, TrainedText)])
        documents: list[Document | list[Document | str]] = []
        for conversation, plan in zip(conversations, plans):
            parts: list[Document | str] = []
            for part in plan:
                if not isinstance(part, TrainedText):
                    parts.append(part)
                    continue
                ids, offsets = next(tokenized)
                trained = np.ones(len(ids), dtype=bool) if part.spans is None else token_mask(offsets, part.spans)
                if conversation.messages is None:
                    ids = [self.tokenizer.bos_token_id, *ids, self.tokenizer.eos_token_id]
                    trained = np.concatenate([[False], trained, [True]])
                parts.append(self._document(ids, trained))
            documents.append(parts[0] if len(parts) == 1 else parts)
        return documents

    def _tokenized(self, texts: list[str]) -> Iterator[tuple[list[int], np.ndarray]]:
        """Each text's token ids and character offsets ``[n, 2]``, in tokenizer calls of up to
        ``TOKENIZE_CHARACTERS`` characters (a conversation rendered once per turn is turns x its length)."""
        start = 0
        while start < len(texts):
            stop, characters = start, 0
            while stop < len(texts) and (stop == start or characters + len(texts[stop]) <= TOKENIZE_CHARACTERS):
                characters += len(texts[stop])
                stop += 1
            encoded = self.tokenizer(
                texts[start:stop], add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False
            )
            for ids, offsets in zip(encoded["input_ids"], encoded["offset_mapping"]):
                yield ids, np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            start = stop

    def _document(self, ids: Sequence[int], trained: np.ndarray) -> Document:
        trained = torch.from_numpy(np.ascontiguousarray(trained, dtype=bool))
        trained[:1] = False  # nothing predicts the first token
        return Document(torch.tensor(ids, dtype=torch.int64), trained, source=self.source, splittable=False)
