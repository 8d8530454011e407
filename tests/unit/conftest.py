"""Fixtures shared by the unit tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from lctrain.data import default_tokenizer_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tokenizer, trained once per session (a few seconds)."""
    return default_tokenizer_dir(tmp_path_factory.getbasetemp() / "lctrain-cache")
