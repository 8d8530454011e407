"""The gated delta rule on pieces through fla's kernel (a CPU stand-in written from its documented semantics,
``tests/helpers/fake_fla.py``) equals the same pieces through transformers' torch kernel: outputs and gradients,
random documents and cuts, and rows of preference pairs sharing their prompt (``doc_prefix``); a piece's documents
that start from zero are one fla call; the kernel choice and its log line."""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from lctrain.linear_attention import kernel
from lctrain.linear_attention.delta_rule import delta_rule_pieces
from lctrain.linear_attention.plan import Documents, RowPlan, row_plan
from lctrain.models.patch import patch_attention
from tests.helpers import fake_fla
from tests.helpers.checkpoints import hf_model

LENGTH = 40


def _case(seed: int) -> RowPlan:
    """Random cuts in a random order; random documents (odd seeds), or (seeds 6 and 7) a row of pairs."""
    rng = random.Random(seed)
    cuts = sorted({0, *rng.sample(range(1, LENGTH), 3), LENGTH})
    pieces = list(zip(cuts, cuts[1:]))
    if seed >= 6:  # pairs [prompt | chosen | rejected] and a plain document
        documents = Documents.of([0, 7, 12, 16, 19, 25, 33, 36, LENGTH], [-1, 0, 0, -1, -1, 4, 4, -1])
    else:
        documents = Documents.of(sorted({0, *rng.sample(range(1, LENGTH), 5 * (seed % 2))}) + [LENGTH])
    return row_plan(documents, (tuple(rng.sample(pieces, len(pieces))),), 0, 4, torch.device("cpu"))


def _inputs(seed: int) -> list[torch.Tensor]:
    """q, k ``[2, L, 2, 8]``, v ``[2, L, 4, 6]``, g, beta ``[2, L, 4]``, float64 (fla refuses fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, LENGTH, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, LENGTH, 4, 6, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(2, LENGTH, 4, generator=gen, dtype=torch.float64))
    beta = torch.rand(2, LENGTH, 4, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _run(inputs: list[torch.Tensor], plan: RowPlan) -> tuple[torch.Tensor, list[torch.Tensor]]:
    local = [torch.cat([t[:, p.start : p.stop] for p in plan.pieces], dim=1) for t in inputs]
    out, _ = delta_rule_pieces(*local, plan, lambda t: t[None])
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    return out.detach(), list(grads)


@pytest.mark.parametrize("seed", range(8))
def test_fla_path_equals_the_torch_path(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _case(seed)
    inputs = _inputs(seed)
    torch_out, torch_grads = _run(inputs, plan)
    calls = fake_fla.installed(monkeypatch)
    fla_out, fla_grads = _run(inputs, plan)
    torch.testing.assert_close(fla_out, torch_out, atol=1e-5, rtol=1e-5)
    for name, got, want in zip("q k v g beta".split(), fla_grads, torch_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"grad {name}")
    if seed < 6:  # per piece: one call for the documents run from zero, one for the continuing segment
        sources = [[s.source[0] for s in piece.segments] for piece in plan.pieces]
        assert len(calls) == sum(("zero" in kinds) + (kinds[0] == "enter") for kinds in sources)
        several = [c for c in calls if c is not None and len(c) > 3]  # 2 rows: more than one document per row
        assert several or all(len(kinds) == 1 for kinds in sources)


def test_kernel_choice_and_its_line(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(kernel, "fla_installed", lambda: False)
    assert "not cpu" in kernel.describe_linear_kernel(cpu, torch.bfloat16)
    assert "not torch.float32" in kernel.describe_linear_kernel(cuda, torch.float32)
    assert not kernel.fla_usable(cuda, torch.bfloat16)
    assert "not installed" in kernel.describe_linear_kernel(cuda, torch.bfloat16)
    monkeypatch.setattr(kernel, "fla_installed", lambda: True)
    assert kernel.fla_usable(cuda, torch.bfloat16) and not kernel.fla_usable(cpu, torch.bfloat16)
    assert kernel.describe_linear_kernel(cuda, torch.float16).startswith("fla's chunk_gated_delta_rule")
    assert "not cpu" in kernel.describe_linear_kernel(cpu, torch.float32)
    with pytest.raises(
        ValueError, match="run in torch.float32 on CUDA only through .* set parallel.param_dtype=bfloat16"
    ):
        kernel.describe_linear_kernel(cuda, torch.float32)


def test_patch_attention_logs_the_linear_kernel(caplog: pytest.LogCaptureFixture) -> None:
    model = hf_model("qwen3_5_text")
    with caplog.at_level(logging.INFO, logger="lctrain"):
        patch_attention(model, ulysses_group=None, ring_group=None, device=torch.device("cpu"), dtype=torch.float32)
    assert (
        "linear-attention layers: 1 gated delta layers, transformers' torch chunked kernel "
        "(fla runs on CUDA only, not cpu)" in caplog.text
    )
