"""Fixtures shared by the distributed trainer tests."""

from __future__ import annotations

import pytest

from testbed.corpus import write_corpus


@pytest.fixture(scope="module")
def parity_workdir(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> str:
    """A work directory for one test module, holding the parity corpus ``corpus.jsonl``."""
    root = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1])
    write_corpus(root / "corpus.jsonl")
    return str(root)
