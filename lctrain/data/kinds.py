"""One class per kind of source: what its items are (``items(epoch)``, read by a ``DocumentSource``) and how a batch
of them becomes documents (``encode``), so that the loader mixes, packs and shards documents of any kind alike.

- ``TextSource``: an item is a text, tokenized whole into one document ``[BOS, *tokens, EOS]``.
- ``ChatSource``: an item is a chat record, rendered through the chat template with its trained-token mask
  (``ChatEncoder``); a conversation whose whole rendering is not what the model sees at inference becomes one
  document per trained turn (``lctrain.data.chat_turns``); each document longer than a row is dropped, cut or an
  error (``data.overlong``), and one without a trained token is skipped.
- ``PairSource``: an item is a preference record (``lctrain.data.pairs``), encoded into one ``Pair``, a unit of
  documents never split across rows; a pair longer than a row is dropped, has its prompt cut from its start, or is
  an error (``data.overlong``).

``encode`` gives one ``Encoded`` per item: a ``Document`` (or ``Pair``), the reason the item gives none
(``lctrain.data.mixture.SKIP_REASONS``), or a conversation's parts (documents and such reasons, with the counts
``divergent`` and ``unreachable``), which the stream counts in the data state. ``counted`` puts those counts in the
words of the kind: a text source counts nothing, a chat source conversations and turns, a preference source pairs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from lctrain.data.chat import ChatEncoder, parse_conversation
from lctrain.data.chat_turns import TurnSettings
from lctrain.data.config import DataConfig
from lctrain.data.mixture import Encoded
from lctrain.data.packing import Document, Pair
from lctrain.data.pairs import PairEncoder, pair_id, parse_pair
from lctrain.data.sources import DocumentSource
from lctrain.data.tokenizer import tokenize_documents

logger = logging.getLogger("lctrain")


def _phrases(counts: Mapping[str, int], words: dict[str, tuple[str, str]]) -> list[str]:
    """``"<count> <noun(s)> <rest>"`` for each nonzero count of ``counts`` that ``words`` names (its noun and the
    rest), in ``words``' order."""
    return [
        f"{counts[name]} {noun}{'' if counts[name] == 1 else 's'} {rest}"
        for name, (noun, rest) in words.items()
        if counts[name]
    ]


class TextSource:
    """Text documents; each becomes one document of source ``index``."""

    def __init__(self, documents: DocumentSource, tokenizer: PreTrainedTokenizerBase, index: int):
        self.documents, self.tokenizer, self.index = documents, tokenizer, index
        self.description = documents.description

    def items(self, epoch: int) -> Iterator[str]:
        return self.documents.texts(epoch)

    def encode(self, texts: list[str]) -> list[Encoded]:
        return self.fit(self.tokenize(texts), texts)

    def tokenize(self, texts: list[str]) -> list[Tensor]:
        """Each text's tokens ``[BOS, *tokens, EOS]``: what ``lctrain prepare`` stores."""
        return tokenize_documents(self.tokenizer, texts)

    def fit(self, tokenized: list[Tensor], items: list) -> list[Encoded]:
        """The documents of ``tokenize``'s tensors (whatever the row length)."""
        return [Document(tokens, source=self.index) for tokens in tokenized]

    def check(self) -> None:
        """Nothing beyond opening: the source checked its text field when it was opened."""

    def counted(self, counts: Mapping[str, int]) -> list[str]:
        """Nothing: every text gives a document (empty ones are left out as they are read)."""
        return []


class RecordSource:
    """What the sources of records (chat and preference) share: the records with where they are, and what happens to
    an item longer than a row (``overlong``: ``data.overlong``)."""

    def __init__(self, documents: DocumentSource, encoder: ChatEncoder | PairEncoder, *, seq_len: int, overlong: str):
        self.documents, self.encoder = documents, encoder
        self.seq_len, self.overlong = seq_len, overlong
        self.description = documents.description
        self._reported_overlong = False

    def items(self, epoch: int) -> Iterator[tuple[str, str]]:
        return self.documents.records(epoch)

    def _refuse_overlong(self, where: str, item: str) -> None:
        """With ``data.overlong=error``, ``item`` (e.g. "a conversation of 9000 tokens") longer than a row is one
        line naming it."""
        if self.overlong == "error":
            raise ValueError(
                f"{where}: {item} is longer than data.seq_len={self.seq_len}; set data.overlong=drop or truncate, or "
                f"raise data.seq_len"
            )

    def _dropped(self, where: str, item: str) -> str:
        """``item`` longer than a row, dropped: the first one logged; the reason it gives no document."""
        if not self._reported_overlong:
            logger.info(
                "%s: %s is longer than data.seq_len=%d and is dropped (data.overlong=%s; the count is logged at the "
                "end)",
                where,
                item,
                self.seq_len,
                self.overlong,
            )
            self._reported_overlong = True
        return "overlong"


class ChatSource(RecordSource):
    """Chat records; each conversation becomes one document (never split over rows), or one per trained turn
    (``data.divergent_turns``), each of ``seq_len`` tokens at most by ``overlong`` (``data.overlong``): ``drop``
    (logged once, counted), ``truncate`` or ``error``."""

    def encode(self, records: list[tuple[str, str]]) -> list[Encoded]:
        return self.fit(self.tokenize(records), records)

    def tokenize(self, records: list[tuple[str, str]]) -> list[Document | list[Document | str]]:
        """Each record's conversation rendered and tokenized (``ChatEncoder.encode``), whatever the row length:
        what ``lctrain prepare`` stores."""
        return self.encoder.encode([parse_conversation(record, where) for record, where in records])

    def fit(self, tokenized: list[Document | list[Document | str]], records: list[tuple[Any, str]]) -> list[Encoded]:
        """``tokenize``'s conversations fitted to a row (``data.overlong``); ``records`` name them (``where``)."""
        encoded: list[Encoded] = []
        for (_, where), parts in zip(records, tokenized):
            if isinstance(parts, list):
                encoded.append([self._fitted(where, p) if isinstance(p, Document) else p for p in parts])
            else:
                encoded.append(self._fitted(where, parts))
        return encoded

    def _fitted(self, where: str, document: Document) -> Encoded:
        """A conversation's document, or why it gives none."""
        if len(document) > self.seq_len:
            item = f"a conversation of {len(document)} tokens"
            self._refuse_overlong(where, item)
            if self.overlong == "drop":
                return self._dropped(where, item)
            document = replace(
                document, tokens=document.tokens[: self.seq_len], trained=document.trained[: self.seq_len]
            )
        return document if document.trained.any() else "untrained"

    def check(self) -> None:
        """The first record rendered with the template: a bad record or template fails before any process group."""
        record, where = next(self.items(0))
        self.encoder.encode([parse_conversation(record, where)])

    def counted(self, counts: Mapping[str, int]) -> list[str]:
        """The nonzero ``counts`` (``lctrain.data.mixture.COUNTS``) in words, one phrase each."""
        return _phrases(
            counts,
            {
                "overlong": ("conversation", "longer than data.seq_len dropped (data.overlong=drop)"),
                "untrained": ("conversation", "without a trained token skipped"),
                "divergent": ("conversation", "rendered once per divergent turn (data.divergent_turns)"),
                "unreachable": ("turn", "no generation prompt leads to left out (data.unreachable_turns=skip)"),
            },
        )


class PairSource(RecordSource):
    """Preference records; each pair becomes one ``Pair`` (its documents never split over rows) of ``seq_len`` tokens
    at most, by ``overlong`` (``data.overlong``): ``drop`` (logged once, counted), ``truncate`` (the prompt cut from
    its start, keeping at least its last token; a pair whose answers alone do not fit is dropped) or ``error``."""

    def encode(self, records: list[tuple[str, str]]) -> list[Encoded]:
        return self.fit(self.tokenize(records), records)

    def tokenize(self, records: list[tuple[str, str]]) -> list[Pair]:
        """Each record's pair encoded (``PairEncoder.encode``), whatever the row length: what ``lctrain prepare``
        stores."""
        return self.encoder.encode([parse_pair(record, where) for record, where in records])

    def fit(self, tokenized: list[Pair], records: list[tuple[Any, str]]) -> list[Encoded]:
        """``tokenize``'s pairs fitted to a row (``data.overlong``); ``records`` name them (``where``)."""
        return [self._fitted(where, pair) for (_, where), pair in zip(records, tokenized)]

    def _fitted(self, where: str, pair: Pair) -> Encoded:
        if len(pair) <= self.seq_len:
            return pair
        item = f"a preference pair of {len(pair)} tokens (as data.share_prompt packs it)"
        self._refuse_overlong(where, item)
        if self.overlong == "truncate":
            answers = len(pair.chosen) + len(pair.rejected)
            # the prompt's length that fits: shared (P + 1 + C + R) or repeated (2P + C + R)
            keep = self.seq_len - 1 - answers if pair.shared else (self.seq_len - answers) // 2
            if keep >= 1:  # another pair: its own identity (its reference log-probs see the shorter prompt)
                prompt = pair.prompt[len(pair.prompt) - keep :]
                return replace(pair, prompt=prompt, pair_id=pair_id(prompt, pair.chosen, pair.rejected))
        return self._dropped(where, item)

    def check(self) -> None:
        """The first record encoded: a bad record or template fails before any process group."""
        record, where = next(self.items(0))
        self.encoder.encode([parse_pair(record, where)])

    def counted(self, counts: Mapping[str, int]) -> list[str]:
        """The pairs dropped (``overlong``; a pair always has trained tokens and no turns) in words."""
        if self.overlong == "truncate":
            dropped = "whose answers alone do not fit in data.seq_len dropped (data.overlong=truncate)"
        else:
            dropped = "longer than data.seq_len dropped (data.overlong=drop)"
        return _phrases(counts, {"overlong": ("pair", dropped)})


def read_chat_template(config: DataConfig) -> str | None:
    """The text of ``data.chat_template``'s file; None = the tokenizer's own template."""
    if config.chat_template is None:
        return None
    path = Path(config.chat_template)
    if not path.is_file():
        raise FileNotFoundError(f"data.chat_template={config.chat_template!r}: no such file (a Jinja chat template)")
    return path.read_text()


def source_of_kind(
    documents: Any, config: DataConfig, tokenizer: PreTrainedTokenizerBase | None, *, index: int, template: str | None
) -> TextSource | ChatSource | PairSource:
    """The class of ``documents.format``'s kind over ``documents`` (a ``DocumentSource``, or anything with its
    ``description``, ``format`` and items: ``lctrain.data.prepared``); ``tokenizer`` None: one that only fits
    documents already tokenized (``fit``)."""
    if tokenizer is None:
        encoder = None
    elif documents.format == "chat":
        turns = TurnSettings(config.divergent_turns, config.unreachable_turns)
        encoder = ChatEncoder(tokenizer, template=template, train_on=config.train_on, turns=turns, source=index)
    elif documents.format == "preference":
        encoder = PairEncoder(tokenizer, template=template, shared=config.share_prompt, source=index)
    if documents.format == "chat":
        return ChatSource(documents, encoder, seq_len=config.seq_len, overlong=config.overlong)
    if documents.format == "preference":
        return PairSource(documents, encoder, seq_len=config.seq_len, overlong=config.overlong)
    return TextSource(documents, tokenizer, index)
