"""The streaming packed data pipeline: source -> tokenize -> pack -> dp shard -> context-parallel shard."""

from lctrain.data.loader import DataConfig, PackedLoader
from lctrain.data.packing import IGNORE_INDEX, PackedRow, Packer
from lctrain.data.sources import DocumentSource
from lctrain.data.tokenizer import default_tokenizer_dir, load_tokenizer, tokenize_documents

__all__ = [
    "IGNORE_INDEX",
    "DataConfig",
    "DocumentSource",
    "PackedLoader",
    "PackedRow",
    "Packer",
    "default_tokenizer_dir",
    "load_tokenizer",
    "tokenize_documents",
]
