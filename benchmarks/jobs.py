"""The jobs the benchmarks run (lists of Hydra overrides, later ones win): on CPU the tiny job (``testbed/jobs.py``),
on one GPU Llama-3.2-1B's sizes with an untied head."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

from lctrain.cli import set_allocator_defaults
from testbed.jobs import QUIET, tiny_job

REPO = Path(__file__).resolve().parents[1]
# the model's sizes by the names the benchmarks' flags use
SHAPE_SETTINGS = {
    "hidden": "model.hidden_size",
    "intermediate": "model.intermediate_size",
    "layers": "model.num_layers",
    "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads",
    "vocab": "model.vocab_size",
}
LLAMA_1B_UNTIED = {"hidden": 2048, "intermediate": 8192, "layers": 16, "heads": 32, "kv_heads": 8, "vocab": 128256}


def shape_overrides(shape: Mapping[str, int | None]) -> list[str]:
    """The ``model.*`` overrides of ``shape`` (keys of ``SHAPE_SETTINGS``; a None size keeps the job's)."""
    return [f"{SHAPE_SETTINGS[key]}={value}" for key, value in shape.items() if value is not None]


def bench_job(device: str, *changes: str) -> list[str]:
    """A benchmark's job on ``device``, never resumed: on CPU the tiny job (fp32), on CUDA ``LLAMA_1B_UNTIED`` on
    the embedded corpus (lctrain's default bf16 there); then ``changes``."""
    if device == "cpu":
        base = tiny_job("train.device=cpu")
    else:
        base = [*QUIET, f"train.device={device}", *shape_overrides(LLAMA_1B_UNTIED)]
    return [*base, "checkpoint.resume=none", *changes]


def add_job_args(parser: argparse.ArgumentParser) -> None:
    """The device, model-shape and job flags of the comparison benchmarks (``bench_trainer``, ``bench_context``)."""
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides train")
    group = parser.add_argument_group("model shape (default: the tiny recipe's on CPU; Llama-3.2-1B, untied, on CUDA)")
    for key, setting in SHAPE_SETTINGS.items():
        group.add_argument(f"--{key.replace('_', '-')}", type=int, help=setting)
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="a Hydra override of both sides' job"
    )
    parser.add_argument("--peak-tflops", type=float, help="peak FLOP/s for MFU (default: known GPUs; none on CPU)")


def job_from_args(args: argparse.Namespace, *changes: str) -> list[str]:
    """The job of ``args`` (device, shape flags, ``--override``), then ``changes``."""
    shape = {key: getattr(args, key) for key in SHAPE_SETTINGS}
    return bench_job(args.device, *shape_overrides(shape), *args.override, *changes)


def process_env(allocator: str | None = None) -> dict[str, str]:
    """A child process's environment: this one's, the repository importable, output unbuffered; its
    ``PYTORCH_CUDA_ALLOC_CONF`` ``allocator``, or where None as ``python -m lctrain`` sets it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.setdefault("PYTHONUNBUFFERED", "1")
    if allocator is not None:
        env.pop("PYTORCH_ALLOC_CONF", None)
        env["PYTORCH_CUDA_ALLOC_CONF"] = allocator
    set_allocator_defaults(env)
    return env
