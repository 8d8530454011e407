"""Opening a training or validation source, the one way the loader and the data check both use: from the prepared
set (``data.prepared``, ``lctrain.data.prepared``) when it holds the source, else from its files, as the class of
its kind (``lctrain.data.kinds``)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lctrain.data.config import DataConfig, SourceConfig
from lctrain.data.kinds import ChatSource, PairSource, TextSource, source_of_kind
from lctrain.data.prepared import PreparedShards, PreparedSource, check_entry, read_manifest
from lctrain.data.sources import DocumentSource


def open_source(
    source: SourceConfig,
    config: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    index: int,
    template: str | None,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> TextSource | ChatSource | PairSource | PreparedSource:
    """``source`` (its format and text field filled: ``lctrain.data.config.filled_source``) opened for dp rank
    ``dp_rank`` of ``dp_size``: from ``data.prepared`` when the set holds it (by name; checked against the job's
    settings), else from its files as the class of its kind (``format=auto``: the kind of its first record). Its
    documents are of source ``index``, chat (and conversational pairs) rendered with ``template``
    (``lctrain.data.kinds.read_chat_template``)."""
    if config.prepared:
        entry = read_manifest(config.prepared)["sources"].get(source.name)
        if entry is not None:
            check_entry(entry, source, config, tokenizer, template)
            folder = Path(config.prepared) / entry["folder"]
            shards = PreparedShards(folder, entry, config, index=index, dp_rank=dp_rank, dp_size=dp_size)
            return PreparedSource(shards, source_of_kind(shards, config, None, index=index, template=None))
    documents = DocumentSource(
        paths=source.paths,
        dataset=source.dataset,
        dataset_config=source.dataset_config,
        split=source.split,
        text_field=source.text_field,
        format=source.format,
        shuffle_buffer=config.shuffle_buffer,
        seed=config.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    return source_of_kind(documents, config, tokenizer, index=index, template=template)
