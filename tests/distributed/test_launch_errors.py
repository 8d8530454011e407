"""A real launch with a mesh that does not fit the job fails before doing anything.

``torchrun --standalone --nproc-per-node 2 -m lctrain train parallel.ring=3`` (1 x 1 x 3 x 1 = 3 ranks for 2
processes) must exit non-zero, print the config check's message (naming the degrees and the fix) on stderr, and
write nothing: its run directory is not created (no config, metrics or checkpoints). Rank 0 is held back until
rank 1 has exited (a ``sitecustomize``), and torchrun stops every rank as soon as one exits: the line must come all
the same (on a loaded machine a late rank 0 was once cut off before it, and nothing told the error).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RANK_0_AFTER_RANK_1 = """
import atexit, os, pathlib, time
exited = pathlib.Path(__file__).with_name("rank1_exited")
if os.environ.get("RANK") == "1":
    atexit.register(exited.touch)
elif os.environ.get("RANK") == "0":
    deadline = time.monotonic() + 120
    while not exited.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
"""


def test_mesh_that_does_not_multiply_fails_cleanly(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    (tmp_path / "sitecustomize.py").write_text(RANK_0_AFTER_RANK_1)
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "lctrain", "train", "parallel.ring=3", "model.num_heads=4", "model.num_kv_heads=2"]
    command += ["data.seq_len=96", f"train.run_dir={run_dir}", "logging.progress_bar=false"]
    result = subprocess.run(
        command,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1  # torchrun: a worker exited with status 1
    message = (
        "pp x dp x ring x ulysses = 1 x 1 x 3 x 1 = 3, but the job has 2 processes: make the degrees multiply to "
        "the world size"
    )
    assert message in result.stderr, result.stderr[-3000:]
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))
