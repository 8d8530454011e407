"""The command line's process settings: the CUDA allocator default (set before torch is imported, only when the user
has not chosen one), the process group backend (gloo beside NCCL with ``parallel.cpu_offload``) and SIGTERM, which
ends the job wherever it arrives."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from lctrain import cli, runtime
from lctrain.runtime import process_group_backend

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        ({}, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        (
            {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
            {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
        ),
        ({"PYTORCH_CUDA_ALLOC_CONF": ""}, {"PYTORCH_CUDA_ALLOC_CONF": ""}),
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}),
    ],
    ids=["unset", "user-setting", "user-empty", "user-new-name"],
)
def test_allocator_default_only_when_the_user_set_none(user: dict, expected: dict) -> None:
    environ = {"PATH": "/bin", **user}
    cli.set_allocator_defaults(environ)
    assert environ == {"PATH": "/bin", **expected}


def test_main_sets_the_allocator_before_the_command_imports_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    def import_module(name: str) -> types.SimpleNamespace:
        seen["module"] = name
        seen["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        return types.SimpleNamespace(main=lambda argv: seen.setdefault("argv", argv))

    monkeypatch.setattr(cli.importlib, "import_module", import_module)
    cli.main(["plan", "--help"])
    assert seen == {"module": "lctrain.planner.cli", "allocator": "expandable_segments:True", "argv": ["--help"]}


def test_process_group_backend() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert process_group_backend(cpu) == process_group_backend(cpu, host_collectives=True) == "gloo"
    assert process_group_backend(cuda) == "nccl"
    assert process_group_backend(cuda, host_collectives=True) == "cuda:nccl,cpu:gloo"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_bad_job_is_told_by_rank_0_at_once_and_by_the_others_only_after_a_wait(
    rank: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """torchrun stops every rank as soon as one exits: a rank but 0 that told the error and exited first could cut
    rank 0 off before its line (seen once on a loaded machine: only torchrun's report, no ``lctrain:`` line)."""
    waits: list[float] = []
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(runtime.time, "sleep", waits.append)

    def check(cfg: object, world_size: int) -> None:
        raise ValueError("parallel.ring=3 needs 3 processes")

    with pytest.raises(SystemExit) as exit:
        runtime.run_command(["train.device=cpu"], check=check, job=lambda cfg: None)
    assert exit.value.code == 1
    assert capsys.readouterr().err == "lctrain: parallel.ring=3 needs 3 processes\n"
    assert waits == ([] if rank == 0 else [runtime.OTHER_RANKS_WAIT_S])


SIGTERM_INSIDE = {
    # what the CI saw: SIGTERM while rank 0 logged "checkpoint ...", and the handler's ``except Exception`` kept it
    "a-log-line": "runtime.tqdm.write = stop_once\n    runtime.logger.warning('a line')",
    "except-exception": "try:\n        stop_here()\n    except Exception:\n        pass",
    # what the cluster suite saw: slurm's SIGTERM while DCP wrote a checkpoint, which gathers every rank's error
    # into one CheckpointException (a BaseException) and raises that instead
    "a-checkpoint-save": "import tempfile, torch, torch.distributed.checkpoint as dcp\n"
    "    torch.save = lambda *a, **k: stop_here()\n"
    "    dcp.save({'w': torch.zeros(2)}, checkpoint_id=tempfile.mkdtemp())",
}


@pytest.mark.parametrize("inside", SIGTERM_INSIDE.values(), ids=SIGTERM_INSIDE.keys())
def test_sigterm_stops_the_job_wherever_it_arrives(inside: str, tmp_path: Path) -> None:
    """SIGTERM that arrives inside code catching ``Exception`` still ends the rank with the one-line message."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os, signal, time
            from lctrain import runtime

            def stop_here():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)

            write = runtime.tqdm.write

            def stop_once(*args, **kwargs):  # as tqdm.write: the first line meets SIGTERM, later ones are written
                runtime.tqdm.write = write
                stop_here()

            def job(cfg):
                {inside}
                raise AssertionError("the job went on after SIGTERM")

            runtime.run_command(["train.device=cpu"], check=lambda cfg, world_size: None, job=job)
            """
        ).format(inside=inside)
    )
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stderr
    assert "lctrain: rank 0 stopped: received SIGTERM." in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
