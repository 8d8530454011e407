"""``python -m lctrain <command> [arguments]``; commands: ``train`` and ``eval`` (Hydra overrides, under torchrun
for several ranks), ``plan`` (a layout planner; ``--help`` lists its options)."""

from __future__ import annotations

import importlib
import sys

# command -> the module whose main(argv) runs it (imported only when used: torch and transformers load slowly)
COMMANDS = {"train": "lctrain.train.trainer", "eval": "lctrain.eval.run", "plan": "lctrain.planner.cli"}
USAGE = (
    "usage: python -m lctrain train|eval [recipe=NAME] [section.field=value ...]   (under torchrun for several ranks)\n"
    "       python -m lctrain plan --help"
)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(USAGE)
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
