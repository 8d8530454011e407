"""Preference records -> ``Pair`` s (prompt, chosen and rejected token ids), in TRL's preference formats.

A record holds ``chosen`` and ``rejected``, and the ``prompt`` they answer:

- strings: ``{"prompt": str, "chosen": str, "rejected": str}``, plain text without a template: the prompt is
  ``[BOS] + prompt``, each answer ``answer + [EOS]`` (each text tokenized on its own, as TRL does);
- conversational: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of messages (usually one assistant
  message), rendered with the chat template: the prompt is the prompt's messages rendered with the generation prompt,
  an answer what the template writes after it for the answer's messages, end-of-turn included and trailing
  whitespace left out: the rule of inference that chat turns are trained by (``lctrain.data.chat_turns``: an
  answer of one message is found where the template writes it as the last turn, even when the template writes
  the prompt's messages otherwise then);
- implicit prompt: ``{"chosen": [messages], "rejected": [messages]}``, two whole conversations; the prompt is their
  longest common prefix of messages, the answers what follows it.

A bad record (not an object; a field missing, empty or of the wrong type; a bad message; no common prompt; chosen
identical to rejected; an answer the template does not write after its prompt) is a ``ValueError`` of one line
naming the record (``file:line``) and the fix. A pair's identity (``pair_id``) is a hash of its token ids, so it
names what the pair is, not where it was read: the same in every epoch, on every mesh and in every shuffle, whatever
the source's index or the spelling of its paths; two identical pairs share it, as they share their reference log-probs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.data.chat import _messages, decoded_record
from lctrain.data.chat_turns import UnreachableTurn, inference_turn
from lctrain.data.packing import Pair

ANSWERS = ("chosen", "rejected")
_FORMAT_HELP = (
    'give each record a "prompt" and its "chosen" and "rejected" answers (strings, or lists of messages), or '
    '"chosen" and "rejected" as whole conversations (docs/preference.md)'
)


def is_pair_record(record: Any) -> bool:
    """Whether a record is a preference pair: it has ``chosen`` and ``rejected``."""
    return isinstance(record, dict) and "chosen" in record and "rejected" in record


def pair_id(prompt: Tensor, chosen: Tensor, rejected: Tensor) -> int:
    """The int64 identity of the pair of these token ids (``[P]``, ``[C]``, ``[R]`` int64): a hash of the three
    lengths and the tokens, which are all the reference log-probs of the pair depend on (not its file, line or
    source). A collision among n pairs has probability about n² / 2⁶⁵."""
    tokens = torch.cat([torch.tensor([len(prompt), len(chosen), len(rejected)]), prompt, chosen, rejected])
    digest = hashlib.blake2b(tokens.to(torch.int64).numpy().astype("<i8").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass(frozen=True)
class PairRecord:
    """A checked preference record: ``prompt``, ``chosen`` and ``rejected`` as three strings, or as three lists of
    messages (the implicit prompt split off); ``where`` names the record."""

    where: str
    prompt: str | list[dict[str, Any]]
    chosen: str | list[dict[str, Any]]
    rejected: str | list[dict[str, Any]]

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _field(record: dict[str, Any], name: str, where: str) -> Any:
    if name not in record:
        raise ValueError(f"{where}: the record has no {name!r} (its fields: {sorted(record)}); {_FORMAT_HELP}")
    value = record[name]
    if value is None or (isinstance(value, (str, list)) and not value):
        raise ValueError(f"{where}: {name!r} is empty; give it text (or messages), or leave the record out")
    if not isinstance(value, (str, list)):
        raise ValueError(
            f"{where}: {name!r} is not a string or a list of messages (a {type(value).__name__}); {_FORMAT_HELP}"
        )
    return value


def parse_pair(line: str | dict[str, Any], where: str) -> PairRecord:
    """A preference record (its JSON text, or the decoded object) checked and normalised; ``ValueError`` naming
    ``where`` and the fix otherwise."""
    record = decoded_record(line, where, _FORMAT_HELP)
    chosen, rejected = (_field(record, name, where) for name in ANSWERS)
    if chosen == rejected:
        raise ValueError(f"{where}: 'chosen' and 'rejected' are identical; a pair needs two different answers")
    if "prompt" not in record and isinstance(chosen, list) and isinstance(rejected, list):
        return _implicit(where, _messages(chosen, where, "chosen"), _messages(rejected, where, "rejected"))
    prompt = _field(record, "prompt", where)
    kinds = {type(value) for value in (prompt, chosen, rejected)}
    if len(kinds) > 1:
        raise ValueError(
            f"{where}: 'prompt', 'chosen' and 'rejected' are a {type(prompt).__name__}, a {type(chosen).__name__} "
            f"and a {type(rejected).__name__}; give three strings (plain text) or three lists of messages"
        )
    if isinstance(prompt, list):
        prompt, chosen, rejected = (_messages(record[name], where, name) for name in ("prompt", *ANSWERS))
    return PairRecord(where, prompt, chosen, rejected)


def _implicit(where: str, chosen: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> PairRecord:
    """The implicit-prompt form: the prompt is the longest common prefix of the two conversations' messages."""
    common = 0
    while common < min(len(chosen), len(rejected)) and chosen[common] == rejected[common]:
        common += 1
    if not common:
        raise ValueError(
            f"{where}: 'chosen' and 'rejected' share no first message, so there is no common prompt; give a "
            f"'prompt' of its own, or conversations that start alike"
        )
    for name, messages in zip(ANSWERS, (chosen, rejected)):
        if common == len(messages):
            raise ValueError(
                f"{where}: {name!r} has no message after the prompt the two conversations share; a pair needs two "
                f"answers after it"
            )
    return PairRecord(where, chosen[:common], chosen[common:], rejected[common:])


class PairEncoder:
    """Preference records of source ``source`` -> ``Pair`` s (``shared``: the answers share the prompt, the layout
    of ``lctrain.data.packing``). ``template``: the chat template text for conversational records (None = the
    tokenizer's own; needed only when such a record comes)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, template: str | None = None, shared: bool = True, source: int = 0
    ):
        self.tokenizer = tokenizer
        self.template = template or tokenizer.chat_template
        self.template_name = "data.chat_template" if template else f"{tokenizer.name_or_path}'s template"
        self.shared = shared
        self.source = source

    def _render(self, record: PairRecord, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        if not self.template:
            raise ValueError(
                f"{record.where}: a conversational pair, and the tokenizer {self.tokenizer.name_or_path!r} has no "
                f"chat template: set data.chat_template to a Jinja template file (docs/data.md)"
            )
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # jinja2's errors, and whatever a template raises (raise_exception)
            raise ValueError(
                f"{record.where}: the chat template ({self.template_name}) raised {type(error).__name__}: {error}; "
                f"fix the record or the template"
            ) from None

    def _texts(self, record: PairRecord) -> tuple[str, str, str]:
        """The prompt's and the answers' texts, each tokenized on its own."""
        if not record.conversational:
            return record.prompt, record.chosen, record.rejected

        def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
            return self._render(record, messages, generation_prompt)

        prompt = render(record.prompt, True)
        answers = []
        for name, answer in zip(ANSWERS, (record.chosen, record.rejected)):
            try:
                if len(answer) == 1:  # one message: where the template writes it as the conversation's last turn
                    answers.append(inference_turn(render, record.prompt + answer, len(record.prompt)).completion)
                    continue
                whole = render(record.prompt + answer, False)
                if not whole.startswith(prompt):
                    raise UnreachableTurn(f"the prompt with the generation prompt is not the start of {name!r}")
                answers.append(whole[len(prompt) :].rstrip())
            except UnreachableTurn as error:
                raise ValueError(
                    f"{record.where}: the chat template does not write {name!r} after the prompt rendered with the "
                    f"generation prompt ({error}), so its tokens cannot be found as at inference; use a template "
                    f"that writes each answer after its generation prompt (data.chat_template)"
                ) from None
        return prompt, *answers

    def encode(self, records: Sequence[PairRecord]) -> list[Pair]:
        """One ``Pair`` per record; the texts of all records are tokenized in one call."""
        texts = [text for record in records for text in self._texts(record)]
        ids = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        bos, eos = self.tokenizer.bos_token_id, self.tokenizer.eos_token_id
        pairs = []
        for index, record in enumerate(records):
            prompt, chosen, rejected = ids[3 * index : 3 * index + 3]
            if not record.conversational:  # plain text: [BOS] prompt, each answer ends with EOS
                prompt = ([bos] if bos is not None else []) + prompt
                chosen, rejected = ([*answer, *([eos] if eos is not None else [])] for answer in (chosen, rejected))
            for name, tokens in zip(("prompt", *ANSWERS), (prompt, chosen, rejected)):
                if not tokens:
                    raise ValueError(f"{record.where}: {name!r} has no tokens; give it text, or leave the record out")
            tensors = [torch.tensor(tokens, dtype=torch.int64) for tokens in (prompt, chosen, rejected)]
            pairs.append(Pair(*tensors, source=self.source, pair_id=pair_id(*tensors), shared=self.shared))
        return pairs
