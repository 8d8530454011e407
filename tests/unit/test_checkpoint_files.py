"""Checkpoint directories: only complete ones are resumed from, old ones are pruned, bad paths fail clearly.

Single process (a gloo group of one over an in-memory store, no port, no spawn). Checked:

- ``complete_checkpoints`` / ``Checkpointer.latest`` list only ``step_XXXXXXXX`` directories holding ``.metadata``:
  never ``step_XXXXXXXX.tmp`` (a save that crashed before its rename, even with ``.metadata``), a step directory
  without ``.metadata``, other names, or files; oldest first; none for a missing root.
- ``Checkpointer.save`` writes ``.metadata`` and ``rank_00000.pt`` into the final directory, removes a stale
  ``.tmp`` left by a crash, keeps the newest ``keep`` complete checkpoints and leaves no ``.tmp`` behind.
- ``Checkpointer.load`` and ``read_extra`` restore model, optimizer and extras exactly (``torch.equal``), and
  refuse a ``.tmp`` or a missing directory with a message that names the path.
- ``Trainer`` with ``checkpoint.resume=<missing path>`` fails with that message before writing into its run dir.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lctrain.config import load_config
from lctrain.train.checkpoint import Checkpointer, complete_checkpoints


@pytest.fixture(scope="module")
def process_group() -> Iterator[None]:
    """A gloo group of one (Checkpointer's collectives and DCP need a default group)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def make_dirs(root: Path, names: dict[str, bool]) -> None:
    """Directories ``root/name``, with a ``.metadata`` file where the value is True."""
    for name, complete in names.items():
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / ".metadata").write_bytes(b"")


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_only_complete_step_directories_are_listed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    make_dirs(
        root,
        {
            "step_00000003": True,
            "step_00000005": True,
            "step_00000010.tmp": True,  # crashed before the rename, after DCP wrote .metadata
            "step_00000020.tmp": False,
            "step_00000030": False,  # no .metadata
            "step_7": True,  # not the step_XXXXXXXX pattern
            "old_step_00000040": True,
        },
    )
    (root / "step_00000050").write_bytes(b"")  # a file
    assert complete_checkpoints(root) == [root / "step_00000003", root / "step_00000005"]
    assert Checkpointer(root, keep=2).latest() == root / "step_00000005"


def test_no_checkpoints(tmp_path: Path) -> None:
    assert complete_checkpoints(tmp_path / "missing") == []
    assert Checkpointer(tmp_path / "missing", keep=1).latest() is None
    make_dirs(tmp_path / "checkpoints", {"step_00000010.tmp": True})
    assert Checkpointer(tmp_path / "checkpoints", keep=1).latest() is None


def test_save_prunes_old_and_stale_checkpoints(process_group: None, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    make_dirs(root, {"step_00000002.tmp": True, "step_00000009": False})  # a crashed save; an incomplete dir
    model, optimizer = model_and_optimizer(0)
    checkpointer = Checkpointer(root, keep=2)
    for step in (1, 2, 3):
        path = checkpointer.save(step, model, optimizer, {"step": step})
        assert path == root / f"step_{step:08d}"
        assert (path / ".metadata").is_file() and (path / "rank_00000.pt").is_file()
        assert not list(root.glob("*.tmp"))
    # the newest 2 complete checkpoints are kept; the incomplete directory is neither resumed from nor counted
    assert names(root) == ["step_00000002", "step_00000003", "step_00000009"]
    assert checkpointer.latest() == root / "step_00000003"


def test_load_restores_model_optimizer_and_extras(process_group: None, tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    extra = {"step": 7, "scheduler": {"last_epoch": 7}, "data": {"epoch": 1, "offset": 3}, "rng": torch.get_rng_state()}
    path = Checkpointer(tmp_path, keep=1).save(7, model, optimizer, extra)
    other, other_optimizer = model_and_optimizer(1)
    Checkpointer(tmp_path, keep=1).load(path, other, other_optimizer)
    loaded = Checkpointer(tmp_path, keep=1).read_extra(path, 0)
    assert loaded.keys() == extra.keys() and torch.equal(loaded.pop("rng"), extra.pop("rng")) and loaded == extra
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    saved, restored = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert saved.keys() == restored.keys()
    for key in saved:
        for field, value in saved[key].items():
            assert torch.equal(value, restored[key][field]), (key, field)


@pytest.mark.parametrize("name", ["step_00000004.tmp", "no_such_checkpoint"])
def test_load_refuses_incomplete_or_missing(process_group: None, tmp_path: Path, name: str) -> None:
    make_dirs(tmp_path, {"step_00000004.tmp": True})
    (tmp_path / "step_00000004.tmp" / "rank_00000.pt").write_bytes(b"")
    model, optimizer = model_and_optimizer(0)
    path = tmp_path / name
    if name.endswith(".tmp"):
        (path / ".metadata").unlink()  # DCP had not finished
    for read in (
        lambda: Checkpointer(tmp_path, keep=1).load(path, model, optimizer),
        lambda: Checkpointer(tmp_path, keep=1).read_extra(path, 0),
    ):
        with pytest.raises(FileNotFoundError) as error:
            read()
        assert f"{path} is not a complete checkpoint" in str(error.value)
        assert "checkpoint.resume=auto" in str(error.value)


def test_trainer_resume_from_missing_path_names_it(process_group: None, tmp_path: Path) -> None:
    from lctrain.train.trainer import Trainer

    missing = tmp_path / "runs" / "old" / "checkpoints" / "step_00000100"
    run_dir = tmp_path / "run"
    cfg = load_config(
        [
            "model.hidden_size=32",
            "model.intermediate_size=64",
            "model.num_layers=1",
            "model.num_heads=2",
            "model.num_kv_heads=1",
            "data.seq_len=64",
            f"train.run_dir='{run_dir}'",
            f"checkpoint.resume='{missing}'",
            "logging.progress_bar=false",
        ]
    )
    with pytest.raises(FileNotFoundError, match=f"{missing} is not a complete checkpoint"):
        Trainer(cfg)
    assert not run_dir.exists()
