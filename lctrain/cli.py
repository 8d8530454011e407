"""``python -m lctrain <command> [arguments]``; commands: ``train`` and ``eval`` (Hydra overrides, under torchrun
for several ranks), ``prepare`` (the training data tokenized once; the same overrides), ``plan`` (a layout planner;
``--help`` lists its options), ``probe`` (measures the cluster's links and attention kernel for the planner, under
torchrun)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import MutableMapping

# command -> the module whose main(argv) runs it (imported only when used: torch and transformers load slowly)
COMMANDS = {
    "train": "lctrain.train.trainer",
    "prepare": "lctrain.train.prepare",
    "eval": "lctrain.eval.run",
    "plan": "lctrain.planner.cli",
    "probe": "lctrain.planner.probe",
}
USAGE = (
    "usage: python -m lctrain train|eval [recipe=NAME] [section.field=value ...]   (under torchrun for several ranks)\n"
    "       python -m lctrain prepare [recipe=NAME] [section.field=value ...] data.prepared=DIR\n"
    "       python -m lctrain plan --help\n"
    "       python -m lctrain probe --help   (under torchrun, like train)"
)


# CUDA's caching allocator for long sequences: activations of many sizes, allocated and freed every layer, fragment
# fixed-size segments; expandable segments grow in place (`benchmarks/bench_trainer.py --device cuda` measures it)
ALLOCATOR_SETTINGS = "expandable_segments:True"


def set_allocator_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the allocator (that variable, or
    ``PYTORCH_ALLOC_CONF``, its newer name). Must run before torch initialises CUDA: here, before torch is imported
    (``scripts/launch.sh`` does the same for the processes torchrun starts)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(USAGE)
    set_allocator_defaults()
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
