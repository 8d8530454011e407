"""The data checked against the files, before any process group (the settings alone are checked when the
``DataConfig`` is made)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from lctrain.data.config import DataConfig, SourceConfig, data_sources, filled_source
from lctrain.data.kinds import read_chat_template
from lctrain.data.opening import open_source
from lctrain.data.sources import embedded_files, resolve_paths


def _files(source: SourceConfig) -> set[str]:
    """The files a source reads (the embedded corpus's too), for the check that validation is held out."""
    if source.dataset:
        return set()
    if source.paths:
        return {str(Path(p).resolve()) for p in resolve_paths(source.paths)}
    return set(embedded_files(source.format in ("chat", "preference"), source.split))


def check_data(config: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Every source (and validation source) opened, the first record of every chat or preference source encoded
    (conversations rendered with the template), and no validation file that is also a training file. ``ValueError``
    / ``FileNotFoundError`` naming the setting. Returns each source's format as read (text, chat or preference;
    training sources, then validation sources)."""
    template = read_chat_template(config)
    train = data_sources(config)
    val = [filled_source(source, config) for source in config.val_sources]
    formats = []
    unprepared = replace(config, prepared=None)  # validation reads its files
    for index, source in enumerate(train + val):
        opened = open_source(
            source, config if index < len(train) else unprepared, tokenizer, index=index, template=template
        )
        opened.check()
        formats.append(opened.documents.format)
    for source in val:
        for other in train:
            same_hub = source.dataset and (source.dataset, source.dataset_config, source.split) == (
                other.dataset,
                other.dataset_config,
                other.split,
            )
            shared = sorted(_files(source) & _files(other))
            if shared or same_hub:
                what = shared[0] if shared else f"dataset={source.dataset!r} split {source.split!r}"
                raise ValueError(
                    f"data.val_sources {source.name!r}: {what} is also training data ({other.name!r}); validate on "
                    f"held-out files (the embedded corpus: split validation)"
                )
    return formats
