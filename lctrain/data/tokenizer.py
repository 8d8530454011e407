"""Tokenizers: a Hugging Face tokenizer from a local directory, or the embedded default one trained on first use.

The default is a byte-level BPE (vocab 8192, special tokens ``<|bos|>`` ``<|eos|>`` ``<|pad|>`` and ChatML's
``<|im_start|>`` ``<|im_end|>``) trained with the ``tokenizers`` library on every 4th file of the Python standard
library (sorted; the first ~3 MB), deterministically and without downloading anything. It carries a ChatML chat
template (``CHAT_TEMPLATE``: ``<|im_start|>role\n ... <|im_end|>\n`` per message after ``<|bos|>``, the
assistant's turns marked with ``{% generation %}``), so an export of a model trained with it holds its template. It
is saved under ``<cache>/tokenizers/<name>``, where ``<cache>`` is the ``cache_dir`` argument, else
``$LCTRAIN_CACHE``, else ``~/.cache/lctrain``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lctrain.data.sources import read_text_files, stdlib_files

DEFAULT_VOCAB_SIZE = 8192
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
# ChatML after the BOS token; the assistant's content and its end-of-turn token are the {% generation %} span
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{%- else -%}"
    "{{- message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
_TRAIN_BYTES = 3_000_000
# tokenizer_config.json's class of a tokenizer.json saved as is (transformers 5 and 4 spell it differently)
TOKENIZER_FILE_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def default_tokenizer_name() -> str:
    """Names the default tokenizer after the Python version whose standard library it was trained on."""
    return f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-bpe{DEFAULT_VOCAB_SIZE}-chatml"


def _training_texts() -> Iterator[str]:
    size = 0
    for example in read_text_files(stdlib_files()[::4]):
        yield example["text"]
        size += len(example["text"])
        if size >= _TRAIN_BYTES:
            return


def train_default_tokenizer() -> PreTrainedTokenizerFast:
    """Train the default byte-level BPE; the same result on every call."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEFAULT_VOCAB_SIZE,
        special_tokens=[*SPECIAL_TOKENS.values(), *CHAT_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(), trainer=trainer)
    trained = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, **SPECIAL_TOKENS, additional_special_tokens=CHAT_TOKENS
    )
    trained.chat_template = CHAT_TEMPLATE
    return trained


def default_tokenizer_dir(cache_dir: str | Path | None = None) -> Path:
    """The directory of the default tokenizer, trained and saved there on first use (safe to race: the first
    complete directory to be renamed into place wins, and every process trains the same tokenizer)."""
    cache = Path(cache_dir or os.environ.get("LCTRAIN_CACHE") or Path.home() / ".cache" / "lctrain")
    target = cache / "tokenizers" / default_tokenizer_name()
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        train_default_tokenizer().save_pretrained(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / "tokenizer.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def load_tokenizer(path: str | Path | None) -> PreTrainedTokenizerBase:
    """The tokenizer of a local directory (``None``: the default tokenizer); it must have BOS and EOS.

    ``AutoTokenizer``, except for a directory whose ``tokenizer_config.json`` declares a plain ``tokenizer.json``
    (``TOKENIZER_FILE_CLASSES``, e.g. the default tokenizer in an lctrain export): that file is loaded as it is,
    since for some model types (``qwen2``) ``AutoTokenizer`` rebuilds the model type's own tokenizer from its vocabulary
    instead, with another pre-tokenizer and one more token.
    """
    if path is None:
        path = default_tokenizer_dir()
    elif not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer: the directory {str(path)!r} does not exist")
    tokenizer_config = Path(path) / "tokenizer_config.json"
    declared = json.loads(tokenizer_config.read_text()).get("tokenizer_class") if tokenizer_config.is_file() else None
    loader = PreTrainedTokenizerFast if declared in TOKENIZER_FILE_CLASSES else AutoTokenizer
    tokenizer = loader.from_pretrained(path)
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError(
            f"tokenizer: {str(path)!r} has no BOS or EOS token (bos={tokenizer.bos_token!r}, "
            f"eos={tokenizer.eos_token!r}); every document is framed by both"
        )
    return tokenizer


def tokenize_documents(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[Tensor]:
    """One int64 tensor ``[BOS, *tokens, EOS]`` per text."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encoded = tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False, verbose=False)
    return [torch.tensor([bos, *ids, eos], dtype=torch.int64) for ids in encoded["input_ids"]]
