"""The cluster suite (``make test-cluster``): a real slurm cluster and two network "hosts" on this machine.

It runs only when ``LCTRAIN_CLUSTER_TESTS=1`` (set by ``make test-cluster``), so that ``make test`` (``pytest
tests``, no root needed) does not collect it; without root or Debian's packages each test is skipped with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("LCTRAIN_CLUSTER_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("LCTRAIN_CLUSTER_TESTS") != "1":
        return
    from tests.cluster.harness import unavailable

    reason = unavailable()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=f"cluster suite: {reason}"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testbed.corpus import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.jsonl")


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> list[dict[str, Any]]:
    """The uninterrupted job on one node (4 processes, ``--standalone``): its records of every step."""
    from tests.cluster.training import run_reference

    return run_reference(tmp_path_factory.mktemp("reference"), corpus)
