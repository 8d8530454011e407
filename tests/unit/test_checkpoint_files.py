"""Checkpoint directories: only complete ones are resumed from, old ones are pruned, bad paths, damaged files and
checkpoints of another model fail clearly, and no file of a checkpoint can run code when loaded.

Single process (a gloo group of one over an in-memory store, no port, no spawn; the agreement of several ranks on
one error is ``tests/distributed/test_checkpoint_integrity.py``). Checked:

- ``complete_checkpoints`` / ``Checkpointer.latest`` list only ``step_XXXXXXXX`` directories holding ``.metadata``:
  never ``step_XXXXXXXX.tmp`` (a save that crashed before its rename, even with ``.metadata``), a step directory
  without ``.metadata``, other names, or files; oldest first; none for a missing root.
- ``Checkpointer.save`` writes ``.metadata``, ``rank_00000.pt`` and ``checksums.json`` (the size and SHA-256 of
  every other file) into the final directory, removes a stale ``.tmp`` left by a crash, keeps the newest ``keep``
  complete checkpoints and leaves no ``.tmp`` behind.
- ``Checkpointer.load`` and ``read_extra`` restore model, optimizer and extras exactly (``torch.equal``), and
  refuse a ``.tmp`` or a missing directory with a message that names the path.
- Damage, named by both ``load`` and ``read_extra``: a flipped byte in the ``.distcp`` data file and a truncated
  ``rank_00000.pt`` (``ValueError``: the file is corrupted, resume from an earlier checkpoint or delete it); a
  deleted data file and a missing ``checksums.json`` (``FileNotFoundError`` naming it).
- Another model: a different hidden size (the first weight, both shapes, the ``model.*`` fix), a layer more or one
  less (the weight the checkpoint lacks or holds), each a ``ValueError`` naming the checkpoint.
- No code runs: a ``.metadata``, an optimizer entry or an extras file whose unpickling would create a directory
  (re-checksummed, as an attacker would) is refused with a ``ValueError`` naming it, and the directory is not made.
- ``verify`` hashes a checkpoint once per ``Checkpointer``: the resume's later reads do not read the manifest again.
- ``Trainer`` with ``checkpoint.resume=<missing path>`` fails with that message before writing into its run dir;
  resuming a 1-step run's checkpoint with another ``model.hidden_size`` names the embedding weight, both shapes and
  the saving run's ``config.yaml``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lctrain.checkpoint.store as checkpoint_module
from lctrain.checkpoint import Checkpointer, complete_checkpoints
from lctrain.config import load_config


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


def model_and_optimizer(seed: int, hidden: int = 8, mid: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model after one AdamW step (so the optimizer has state); ``mid`` adds a layer."""
    torch.manual_seed(seed)
    layers: OrderedDict[str, nn.Module] = OrderedDict(inp=nn.Linear(4, hidden), act=nn.Tanh())
    if mid:
        layers["mid"] = nn.Linear(hidden, hidden)
    layers["out"] = nn.Linear(hidden, 3)
    model = nn.Sequential(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def saved(root: Path, **model: Any) -> Path:
    """A checkpoint of a small model (``model_and_optimizer(0, **model)``) with extras ``{"step": 1}``."""
    return Checkpointer(root, keep=1).save(1, *model_and_optimizer(0, **model), {"step": 1})


def rehash(path: Path) -> None:
    """Rewrite ``checksums.json`` to match the files as they are now (what a deliberate forger would do)."""
    manifest = json.loads((path / "checksums.json").read_text())
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (path / "checksums.json").write_text(json.dumps(manifest))


def both_reads(path: Path, **model: Any) -> list[Any]:
    """``load`` and ``read_extra`` of ``path``, each by a fresh Checkpointer (nothing verified yet)."""
    return [
        lambda: Checkpointer(path.parent, keep=1).load(path, *model_and_optimizer(1, **model)),
        lambda: Checkpointer(path.parent, keep=1).read_extra(path, 0),
    ]


class MakesDir:
    """Unpickling it creates a directory: a stand-in for the code a crafted checkpoint would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple:
        return Path.mkdir, (self.path,)


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


def test_latest_is_none_without_a_complete_checkpoint(tmp_path: Path) -> None:
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
        manifest = json.loads((path / "checksums.json").read_text())
        assert manifest["algorithm"] == "sha256"
        assert sorted(manifest["files"]) == sorted(p.name for p in path.iterdir() if p.name != "checksums.json")
        for name, entry in manifest["files"].items():
            data = (path / name).read_bytes()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
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


def frozen_inp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model_and_optimizer(seed)`` with its first layer frozen, as a LoRA job's base weights are."""
    model, optimizer = model_and_optimizer(seed)
    model.inp.requires_grad_(False)
    optimizer.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
    for param in model.inp.parameters():
        optimizer.state.pop(param)
    return model, optimizer


def test_frozen_parameters_are_neither_saved_nor_loaded(process_group: None, tmp_path: Path) -> None:
    """A checkpoint holds the trained parameters and their optimizer state only; loading leaves the frozen ones as
    the job built them; a checkpoint with every weight (full fine-tuning) does not load into a frozen model, nor the
    reverse."""
    from lctrain.checkpoint.safe_read import read_metadata

    model, optimizer = frozen_inp(0)
    path = Checkpointer(tmp_path / "frozen", keep=1).save(1, model, optimizer, {"step": 1})
    keys = read_metadata(path).state_dict_metadata
    assert {key for key in keys if key.startswith("model.")} == {"model.out.weight", "model.out.bias"}
    assert not any("inp" in key for key in keys)
    other, other_optimizer = frozen_inp(1)
    frozen_before = {name: value.clone() for name, value in other.inp.state_dict().items()}
    Checkpointer(tmp_path / "frozen", keep=1).load(path, other, other_optimizer)
    assert torch.equal(other.out.weight, model.out.weight) and torch.equal(other.out.bias, model.out.bias)
    assert all(torch.equal(value, frozen_before[name]) for name, value in other.inp.state_dict().items())
    with pytest.raises(ValueError, match="it holds weight inp.weight, which this model does not have"):
        Checkpointer(tmp_path, keep=1).load(saved(tmp_path / "full"), *frozen_inp(1))
    with pytest.raises(ValueError, match="it has no weight inp.weight, which this model has"):
        Checkpointer(tmp_path, keep=1).load(path, *model_and_optimizer(1))


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
    from lctrain.train.job import build_training_job
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
        Trainer(build_training_job(cfg))
    assert not run_dir.exists()


@pytest.mark.parametrize("damage", ["flip a byte", "truncate"])
@pytest.mark.parametrize("name", ["__0_0.distcp", "rank_00000.pt", ".metadata"])
def test_corrupted_file_is_named(process_group: None, tmp_path: Path, name: str, damage: str) -> None:
    path = saved(tmp_path)
    file = path / name
    data = bytearray(file.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    for read in both_reads(path):
        with pytest.raises(ValueError) as error:
            read()
        message = str(error.value)
        assert message.startswith(f"{file} is corrupted (")
        assert "checkpoint.resume=<its directory>" in message and f"or delete {path}" in message


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank_00000.pt"])
def test_missing_file_is_named(process_group: None, tmp_path: Path, name: str) -> None:
    path = saved(tmp_path)
    (path / name).unlink()
    for read in both_reads(path):
        with pytest.raises(FileNotFoundError, match=f"^{path / name} is missing: the checkpoint {path} is incomplete"):
            read()


def test_missing_manifest_is_named(process_group: None, tmp_path: Path) -> None:
    path = saved(tmp_path)
    (path / "checksums.json").unlink()
    for read in both_reads(path):
        with pytest.raises(FileNotFoundError) as error:
            read()
        assert str(error.value).startswith(f"{path / 'checksums.json'} is missing, so the checkpoint {path} cannot")
        assert "checkpoint.resume=none" in str(error.value)


def test_verification_runs_once_per_checkpoint(process_group: None, tmp_path: Path) -> None:
    path = saved(tmp_path)
    checkpointer = Checkpointer(tmp_path, keep=1)
    assert checkpointer.read_extra(path, 0) == {"step": 1}
    (path / "checksums.json").unlink()  # not read again: the resume's later reads cost no second hashing
    checkpointer.load(path, *model_and_optimizer(1))
    assert checkpointer.read_extra(path, 0) == {"step": 1}


@pytest.mark.parametrize(
    ("saved_model", "model", "expected"),
    [
        ({}, {"hidden": 16}, "its weight inp.weight has shape [8, 4] and this model's [16, 4]"),
        ({}, {"mid": True}, "it has no weight mid.weight, which this model has"),
        ({"mid": True}, {}, "it holds weight mid.weight, which this model does not have"),
    ],
)
def test_checkpoint_of_another_model_is_refused(
    process_group: None, tmp_path: Path, saved_model: dict, model: dict, expected: str
) -> None:
    path = saved(tmp_path, **saved_model)
    before = model_and_optimizer(1, **model)[0].state_dict()
    other, other_optimizer = model_and_optimizer(1, **model)
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path, keep=1).load(path, other, other_optimizer)
    assert str(error.value) == (
        f"{path} does not match this model: {expected}. A checkpoint loads only into the model it was saved from: "
        f"the model.* settings must match the run that saved it"
    )
    for name, value in other.state_dict().items():
        assert torch.equal(value, before[name]), name  # left as it was


def test_crafted_metadata_runs_no_code(process_group: None, tmp_path: Path) -> None:
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(MakesDir(marker)))
    rehash(path)
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path, keep=1).load(path, *model_and_optimizer(1))
    assert str(error.value).startswith(
        f"{path / '.metadata'} cannot be read safely (it names pathlib.Path.mkdir, which DCP metadata does not hold)"
    )
    assert not marker.exists()


def test_crafted_optimizer_entry_runs_no_code(
    process_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    real = checkpoint_module.get_optimizer_state_dict

    def crafted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state = real(*args, **kwargs)
        state["param_groups.inp.weight.lr"] = MakesDir(marker)  # DCP stores non-tensors with torch.save
        return state

    monkeypatch.setattr(checkpoint_module, "get_optimizer_state_dict", crafted)
    path = saved(tmp_path)
    monkeypatch.undo()
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path, keep=1).load(path, *model_and_optimizer(1))
    assert str(error.value).startswith(f"{path} could not be loaded (rank 0: UnpicklingError: Weights only load failed")
    assert not marker.exists()


def test_crafted_extras_run_no_code(process_group: None, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = Checkpointer(tmp_path, keep=1).save(1, *model_and_optimizer(0), {"step": MakesDir(marker)})
    with pytest.raises(ValueError) as error:
        Checkpointer(tmp_path, keep=1).read_extra(path, 0)
    assert str(error.value).startswith(
        f"{path / 'rank_00000.pt'} cannot be read as a checkpoint's extras (Weights only load failed"
    )
    assert not marker.exists()


def test_trainer_resume_into_another_model_names_key_and_fix(process_group: None, tmp_path: Path) -> None:
    from lctrain.train.job import build_training_job
    from lctrain.train.trainer import Trainer
    from testbed.corpus import corpus_overrides, write_corpus

    def config(name: str, hidden: int, *extra: str) -> Any:
        return load_config(
            [
                f"model.hidden_size={hidden}",
                "model.intermediate_size=64",
                "model.num_layers=1",
                "model.num_heads=2",
                "model.num_kv_heads=1",
                "data.seq_len=32",
                "train.steps=1",
                "checkpoint.every=1",
                "checkpoint.export_hf=false",
                "logging.progress_bar=false",
                "logging.plot=false",
                f"train.run_dir='{tmp_path / name}'",
                *corpus_overrides(write_corpus(tmp_path / "corpus.jsonl", documents=20)),
                *extra,
            ]
        )

    Trainer(build_training_job(config("old", 32))).train()
    path = tmp_path / "old" / "checkpoints" / "step_00000001"
    with pytest.raises(ValueError) as error:
        Trainer(build_training_job(config("new", 48, f"checkpoint.resume='{path}'")))
    message = str(error.value)
    assert message.startswith(f"{path} does not match this model: its weight model.embed_tokens.weight has shape [")
    assert ", 32] and this model's [" in message and ", 48]. A checkpoint loads only into the model" in message
    assert message.endswith(
        f"the model.* settings must match the run that saved it (they are in {path.parents[1] / 'config.yaml'})"
    )


def test_an_optimizer_of_matrices_only_resumes(process_group: None, tmp_path: Path) -> None:
    """LoRA adapters alone (every trained parameter a matrix, no norm or bias): ``build_optimizer`` makes one group,
    whose state a checkpoint saves and loads back."""
    from lctrain.config.schema import OptimConfig
    from lctrain.train.optim import build_optimizer

    def adapters_only(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(OrderedDict(inp=nn.Linear(4, 8, bias=False), out=nn.Linear(8, 3)))
        model.out.requires_grad_(False)
        optimizer = build_optimizer(model, OptimConfig())
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        return model, optimizer

    model, optimizer = adapters_only(0)
    assert len(optimizer.param_groups) == 1
    path = Checkpointer(tmp_path, keep=1).save(1, model, optimizer, {"step": 1})
    other, other_optimizer = adapters_only(1)
    Checkpointer(tmp_path, keep=1).load(path, other, other_optimizer)
    assert torch.equal(other.inp.weight, model.inp.weight)
    saved_state, loaded_state = optimizer.state[model.inp.weight], other_optimizer.state[other.inp.weight]
    assert torch.equal(saved_state["exp_avg"], loaded_state["exp_avg"])
