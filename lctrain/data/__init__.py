"""The streaming packed data pipeline: sources (text or chat, mixed by weight) -> tokenize (conversations through the
chat template, with their trained-token mask) -> pack -> dp shard -> context-parallel shard."""

from lctrain.data.chat import ChatEncoder, parse_conversation
from lctrain.data.loader import DataConfig, PackedLoader, SourceConfig, check_data, check_data_config, data_sources
from lctrain.data.packing import IGNORE_INDEX, Document, PackedRow, Packer
from lctrain.data.sources import DocumentSource
from lctrain.data.tokenizer import default_tokenizer_dir, load_tokenizer, tokenize_documents

__all__ = [
    "IGNORE_INDEX",
    "ChatEncoder",
    "DataConfig",
    "Document",
    "DocumentSource",
    "PackedLoader",
    "PackedRow",
    "Packer",
    "SourceConfig",
    "check_data",
    "check_data_config",
    "data_sources",
    "default_tokenizer_dir",
    "load_tokenizer",
    "parse_conversation",
    "tokenize_documents",
]
