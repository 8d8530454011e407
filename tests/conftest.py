"""Settings of the pytest process shared by every suite.

Torch runs on one thread in the pytest process once the tests are collected (as ``make test-fast``'s timing in
``docs/testing.md`` was taken, with ``OMP_NUM_THREADS=1``). The tests' models and tensors are tiny: a second OpenMP
thread only spins, and on a machine whose other core is busy (another process, or the ranks of a process group) every
small operation waits for it. On 2 cores of an AMD EPYC, a 64 x 128 linear layer on 50 tokens took 0.9 ms (load 3)
to 6 ms (load 13) on 2 threads against 0.03 ms on one; five unit files (``test_lora``, ``test_moe``,
``test_model_build``, ``test_sinks``, ``test_checkpoint_layouts``: 112 tests) ran in 30 s instead of 48 s, and
``tests/unit tests/repository -m "not slow"`` (1179 tests) in 256 s instead of 355 s (226 s of CPU instead of 350 s),
under a load of 5-8 (2026-12-06). Only the pytest process: the environment is left as it is, so worker processes the
tests start choose their own threads (``lctrain.testing.run_distributed``'s ranks, and the launches that set
``OMP_NUM_THREADS=1``, use one anyway).
"""

from __future__ import annotations

import sys

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    torch = sys.modules.get("torch")  # imported by the collected tests, if any needs it
    if torch is not None:
        torch.set_num_threads(1)
