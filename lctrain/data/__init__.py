"""The streaming packed data pipeline: sources (text, chat or preference pairs, mixed by weight) -> tokenize
(conversations through the chat template, with their trained-token mask; pairs as one unit of documents) -> pack ->
dp shard -> context-parallel shard.

The names below are imported from their modules when first used (``lctrain.lazy``): ``lctrain.data.config``, the
``data`` section of a job's config, imports without torch, transformers or ``datasets``.
"""

from lctrain.lazy import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "chat": ("ChatEncoder", "parse_conversation"),
        "checks": ("check_data",),
        "config": ("DataConfig", "SourceConfig", "data_sources"),
        "loader": ("PackedLoader",),
        "packing": ("IGNORE_INDEX", "Document", "PackedRow", "Packer", "Pair"),
        "pairs": ("PairEncoder", "parse_pair"),
        "sources": ("DocumentSource",),
        "tokenizer": ("default_tokenizer_dir", "load_tokenizer", "tokenize_documents"),
    },
)
