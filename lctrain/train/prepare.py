"""``python -m lctrain prepare [recipe=NAME] [section.field=value ...] data.prepared=DIR``: the job's training data
(the same Hydra config as ``train``: its data section, its tokenizer, chat template and preference settings) rendered
and tokenized once into ``DIR`` (``lctrain.data.prepare``), which ``train data.prepared=DIR`` then reads."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from lctrain.build import tokenizer_path
from lctrain.data.prepare import prepare
from lctrain.runtime import load_config_or_exit, setup_logging


def main(argv: Sequence[str]) -> None:
    """The ``prepare`` command: a bad config, setting or record ends it with one line and exit status 1."""
    cfg = load_config_or_exit(argv)
    setup_logging(0)
    data = dataclasses.replace(cfg.data, tokenizer=tokenizer_path(cfg))
    try:
        prepare(data, data.tokenizer, progress=cfg.logging.progress_bar)
    except (ValueError, FileNotFoundError) as error:
        print(f"lctrain: {error}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
