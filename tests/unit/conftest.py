"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lctrain.data import default_tokenizer_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tokenizer, trained once per session (a few seconds)."""
    return default_tokenizer_dir(tmp_path_factory.getbasetemp() / "lctrain-cache")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread in the pytest process for each unit test module (as ``make test-fast``'s timing in
    ``docs/testing.md`` was taken, with ``OMP_NUM_THREADS=1``), the previous count restored after it. The tests'
    tensors are tiny: a second OpenMP thread only spins, and on a machine whose other core is busy every small
    operation waits for it. On 2 cores of an AMD EPYC, a 64 x 128 linear layer on 50 tokens took 0.9 ms (load 3) to
    6 ms (load 13) on 2 threads against 0.03 ms on one; ``tests/unit tests/repository -m "not slow"`` (1179 tests)
    ran in 256 s instead of 355 s (226 s of CPU instead of 350 s) under a load of 5-8 (2026-12-06). Only here, not
    for the distributed suites: their single-process references are compared with the ranks at tolerances that some
    cases meet with either thread count but not by a wide margin (``test_linear_attention``'s qwen3_next ring 2 case
    is off by 6e-5 against 5e-5 on one thread), so they keep the thread count they were checked with, except where
    a helper asks for one (``tests/helpers/reference_training.one_thread``). Worker processes choose their own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
