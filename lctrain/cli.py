"""``python -m lctrain <command> [hydra overrides]``; commands: ``train``."""

from __future__ import annotations

import sys

USAGE = "usage: python -m lctrain train [recipe=NAME] [section.field=value ...]   (under torchrun for several ranks)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("train",):
        sys.exit(USAGE)
    from lctrain.train.trainer import main as train

    train(argv[1:])


if __name__ == "__main__":
    main()
