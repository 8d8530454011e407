"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lctrain.data import default_tokenizer_dir
from tests.helpers.reference_training import one_thread


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tokenizer, trained once per session (a few seconds)."""
    return default_tokenizer_dir(tmp_path_factory.getbasetemp() / "lctrain-cache")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Each unit module with torch on one thread in the pytest process (``one_thread``; as ``make test-fast`` was
    timed, with ``OMP_NUM_THREADS=1``): the tensors are tiny and a second thread only spins. ``tests/unit
    tests/repository -m "not slow"`` (1179 tests): 355 s on 2 threads, 256 s on one (226 s of CPU instead of 350 s), 2
    cores of an AMD EPYC under a load of 5-8 (2026-12-06). Not the distributed suites: some of their references meet
    their tolerance on either thread count but not by much (``test_linear_attention``'s qwen3_next ring 2 case is
    6e-5 off against 5e-5 on one thread)."""
    with one_thread():
        yield
