"""A wheel of lctrain runs a job from any directory: the top-level configs/ and recipes/ travel inside the package.

The wheel is built from a copy of this checkout (``pip wheel``) and installed without dependencies into a fresh virtual
environment, which sees the test environment's packages (torch, transformers, ...) through a ``.pth`` line but not
its editable install of lctrain. ``lctrain train recipe=tiny_cpu`` then runs two steps on one process from an empty
directory, and the lctrain it ran is the wheel's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from testbed.corpus import corpus_overrides, write_corpus

REPO = Path(__file__).resolve().parents[2]


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_wheel_carries_the_configs_and_trains_from_another_directory(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info"))
    run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
        source,
    )
    (wheel,) = (tmp_path / "dist").glob("lctrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"lctrain/{path.relative_to(REPO).as_posix()}" for path in REPO.glob("configs/**/*.yaml")}
    shipped |= {f"lctrain/recipes/{path.name}" for path in (REPO / "recipes").glob("*.yaml")}
    modules = {path.relative_to(REPO).as_posix() for path in (REPO / "lctrain").rglob("*.py")}
    assert {"lctrain/configs/train.yaml", "lctrain/recipes/tiny_cpu.yaml"} <= shipped
    assert shipped | modules <= names, sorted((shipped | modules) - names)

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout)
    (Path(site.as_posix().strip()) / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([str(python), "-c", "import lctrain; print(lctrain.__file__)"], elsewhere).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    corpus = corpus_overrides(write_corpus(elsewhere / "corpus.jsonl"))
    overrides = ["recipe=tiny_cpu", "parallel.ring=1", "parallel.ulysses=1", "data.seq_len=64", "train.steps=2"]
    overrides += [*corpus, "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false"]
    run([str(venv / "bin" / "lctrain"), "train", *overrides], elsewhere)
    metrics = (elsewhere / "runs" / "tiny_cpu" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]
