"""The ``eval`` command: passkey retrieval and perplexity of ``model.path`` on the job's mesh.

    torchrun --standalone --nproc-per-node 4 -m lctrain eval recipe=tiny_cpu model.path=runs/tiny_cpu/hf \\
        'eval.lengths=[1024,2048,4096]' 'eval.depths=[0,0.5,1]'

writes ``<train.run_dir>/eval/`` (or ``eval.out_dir``): ``passkey.json``, ``passkey.png``, ``perplexity.json``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lctrain.config import JobConfig
from lctrain.eval.evaluator import Evaluator, build_eval_job, prepare_eval
from lctrain.eval.report import passkey_table, plot_passkey, write_json
from lctrain.runtime import run_command

logger = logging.getLogger("lctrain")


def out_dir(cfg: JobConfig) -> Path:
    return Path(cfg.eval.out_dir or Path(cfg.train.run_dir) / "eval")


def evaluate(cfg: JobConfig) -> dict[str, Any]:
    """Run ``eval.tasks`` on an initialized default process group; rank 0 writes the files. Every rank returns the
    same ``{"passkey": [cells], "perplexity": [lengths]}`` (a task not run is absent)."""
    evaluator = Evaluator(build_eval_job(cfg))
    dims = evaluator.dims
    meta = {
        "model": cfg.model.path,
        "tokenizer": evaluator.tokenizer_path,
        "mesh": {"dp": dims.dp, "ring": dims.ring, "ulysses": dims.ulysses, "layout": dims.layout},
        "eval": dataclasses.asdict(cfg.eval),
    }
    results: dict[str, Any] = {}
    directory = out_dir(cfg)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    if "passkey" in cfg.eval.tasks:
        results["passkey"] = evaluator.passkey()
        if dist.get_rank() == 0:
            write_json(directory / "passkey.json", {**meta, "cells": results["passkey"]})
            mesh = f"dp {dims.dp} × ring {dims.ring} × ulysses {dims.ulysses}"
            plot_passkey(results["passkey"], directory / "passkey.png", f"passkey: {cfg.model.path} ({mesh})")
            logger.info("passkey accuracy:\n%s", passkey_table(results["passkey"]))
    if "perplexity" in cfg.eval.tasks:
        results["perplexity"] = evaluator.perplexity()
        if dist.get_rank() == 0:
            data = {"paths": cfg.data.paths, "dataset": cfg.data.dataset}
            write_json(directory / "perplexity.json", {**meta, "data": data, "lengths": results["perplexity"]})
    logger.info("evaluation written to %s", directory)
    return results


def main(argv: Sequence[str]) -> None:
    """``python -m lctrain eval [recipe=NAME] model.path=DIR [eval.*=...]`` (``lctrain.runtime.run_command``: a bad
    config, a missing file or a fault ends the job with one line and exit status 1)."""
    run_command(argv, check=prepare_eval, job=evaluate)
