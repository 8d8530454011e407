"""The streaming packed data pipeline: sources (text or chat, mixed by weight) -> tokenize (conversations through the
chat template, with their trained-token mask) -> pack -> dp shard -> context-parallel shard.

The names below are imported from their modules when first used, so that ``lctrain.data.config`` (the ``data``
section of a job's config) can be imported without torch, transformers or ``datasets``.
"""

from importlib import import_module

_MODULES = {
    "ChatEncoder": "chat",
    "parse_conversation": "chat",
    "check_data": "checks",
    "DataConfig": "config",
    "SourceConfig": "config",
    "data_sources": "config",
    "PackedLoader": "loader",
    "IGNORE_INDEX": "packing",
    "Document": "packing",
    "PackedRow": "packing",
    "Packer": "packing",
    "DocumentSource": "sources",
    "default_tokenizer_dir": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenize_documents": "tokenizer",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> object:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULES[name]}"), name)
