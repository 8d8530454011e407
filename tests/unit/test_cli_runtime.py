"""The command line's process settings: the CUDA allocator default (set before torch is imported, only when the user
has not chosen one) and the process group backend (gloo beside NCCL with ``parallel.cpu_offload``)."""

from __future__ import annotations

import os
import types

import pytest
import torch

from lctrain import cli
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
