"""A damaged checkpoint or one of another model fails on every rank with the same error, even when only one rank
can see the problem, and no rank is left waiting in a collective.

One spawned gloo group of 2 ranks (each process exits with a traceback dump if it is still running after
``WATCHDOG_S``: a rank left in a collective fails the test instead of hanging it). Small models, no FSDP:

- **corrupt**: a replicated model saved by both ranks; a byte flipped in a file of rank 1's share of the checksum
  work (so only rank 1 hashes it): ``read_extra`` and ``load`` raise the same ``ValueError`` on both ranks, naming
  the file;
- **mismatch**: rank 1's model has another hidden size (rank 0's matches the checkpoint): ``load`` raises the same
  ``ValueError`` on both, naming the weight and both shapes;
- **split**: each rank holds different layers (as pipeline stages do), so each saves and loads only its own keys:
  the round trip is exact (no rank's keys count as unknown to the model), and an optimizer entry crafted to run code
  when unpickled, in rank 1's keys only, makes DCP fail on rank 1 alone: both raise the same ``ValueError``, and
  the code does not run.
"""

from __future__ import annotations

import faulthandler
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lctrain.checkpoint.store as checkpoint_module
from lctrain.checkpoint import Checkpointer
from lctrain.checkpoint.checksums import read_manifest, spread
from lctrain.testing import run_distributed

WORLD = 2
WATCHDOG_S = 120


class MakesDir:
    """Unpickling it creates a directory: a stand-in for the code a crafted checkpoint would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple:
        return Path.mkdir, (self.path,)


def model_and_optimizer(seed: int, layers: dict[str, tuple[int, int]]) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers ``name -> (in, out)`` (each fed its own input) after one AdamW step."""
    torch.manual_seed(seed)
    model = nn.Sequential(OrderedDict((name, nn.Linear(*shape)) for name, shape in layers.items()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for layer in model:
        layer(torch.randn(5, layer.in_features)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def outcome(read: Any) -> tuple[str, str] | None:
    try:
        read()
    except (ValueError, FileNotFoundError) as error:
        return type(error).__name__, str(error)
    return None


REPLICATED = {"inp": (4, 8), "out": (8, 3)}
SPLIT = [{"inp": (4, 8)}, {"out": (8, 3)}]  # rank 0's layers, rank 1's


def run_cases(root: str) -> dict[str, Any]:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    rank, results = dist.get_rank(), {}

    # corrupt: a file only rank 1 verifies
    path = Checkpointer(f"{root}/corrupt", keep=1).save(1, *model_and_optimizer(0, REPLICATED), {"rank": rank})
    manifest = read_manifest(path)
    share = spread({name: size for name, (size, _) in manifest.items()}, WORLD)[1]
    results["corrupt_file"] = str(path / share[0])
    if rank == 0:
        data = bytearray((path / share[0]).read_bytes())
        data[len(data) // 2] ^= 0x80
        (path / share[0]).write_bytes(bytes(data))
    dist.barrier()
    results["corrupt_read_extra"] = outcome(lambda: Checkpointer(path.parent, keep=1).read_extra(path, rank))
    model, optimizer = model_and_optimizer(1, REPLICATED)
    results["corrupt_load"] = outcome(lambda: Checkpointer(path.parent, keep=1).load(path, model, optimizer))

    # mismatch: only rank 1's model differs
    path = Checkpointer(f"{root}/mismatch", keep=1).save(1, *model_and_optimizer(0, REPLICATED), {})
    model, optimizer = model_and_optimizer(1, REPLICATED if rank == 0 else {"inp": (4, 16), "out": (16, 3)})
    results["mismatch_load"] = outcome(lambda: Checkpointer(path.parent, keep=1).load(path, model, optimizer))

    # split: each rank its own layers
    saved_model, saved_optimizer = model_and_optimizer(0, SPLIT[rank])
    path = Checkpointer(f"{root}/split", keep=1).save(1, saved_model, saved_optimizer, {})
    model, optimizer = model_and_optimizer(1, SPLIT[rank])
    Checkpointer(path.parent, keep=1).load(path, model, optimizer)
    results["split_exact"] = all(
        torch.equal(a, b) for a, b in zip(saved_model.state_dict().values(), model.state_dict().values(), strict=True)
    ) and all(
        torch.equal(a, b)
        for state_a, state_b in zip(
            saved_optimizer.state_dict()["state"].values(), optimizer.state_dict()["state"].values(), strict=True
        )
        for a, b in zip(state_a.values(), state_b.values(), strict=True)
    )

    marker = Path(root) / "pwned"
    real = checkpoint_module.get_optimizer_state_dict

    def crafted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = real(*args, **kwargs)
        if rank == 1:
            state["param_groups.out.weight.lr"] = MakesDir(marker)
        return state

    checkpoint_module.get_optimizer_state_dict = crafted
    try:
        path = Checkpointer(f"{root}/crafted", keep=1).save(1, *model_and_optimizer(0, SPLIT[rank]), {})
    finally:
        checkpoint_module.get_optimizer_state_dict = real
    model, optimizer = model_and_optimizer(1, SPLIT[rank])
    results["crafted_load"] = outcome(lambda: Checkpointer(path.parent, keep=1).load(path, model, optimizer))
    results["crafted_ran"] = marker.exists()
    faulthandler.cancel_dump_traceback_later()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_cases, WORLD, str(tmp_path_factory.mktemp("integrity")))


@pytest.mark.parametrize("read", ["read_extra", "load"])
def test_corruption_seen_by_one_rank_fails_every_rank(results: list[dict[str, Any]], read: str) -> None:
    file = results[0]["corrupt_file"]
    kind, message = results[0][f"corrupt_{read}"]
    assert kind == "ValueError" and message.startswith(f"{file} is corrupted (its SHA-256 differs")
    assert results[1][f"corrupt_{read}"] == (kind, message)


def test_mismatch_on_one_rank_fails_every_rank(results: list[dict[str, Any]]) -> None:
    kind, message = results[0]["mismatch_load"]
    assert kind == "ValueError"
    assert "does not match this model: its weight inp.weight has shape [8, 4] and this model's [16, 4]" in message
    assert results[1]["mismatch_load"] == (kind, message)


def test_split_model_round_trip_is_exact(results: list[dict[str, Any]]) -> None:
    assert results[0]["split_exact"] and results[1]["split_exact"]


def test_dcp_failure_on_one_rank_fails_every_rank(results: list[dict[str, Any]]) -> None:
    kind, message = results[0]["crafted_load"]
    assert kind == "ValueError" and "could not be loaded (rank 1: UnpicklingError: Weights only load failed" in message
    assert results[1]["crafted_load"] == (kind, message)
    assert not results[0]["crafted_ran"] and not results[1]["crafted_ran"]
